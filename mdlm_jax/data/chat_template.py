"""Chat templates: a checkpoint's Jinja template, rendered as transformers'
`apply_chat_template` renders it.

The environment matches transformers': a sandbox that cannot touch Python
objects (`ImmutableSandboxedEnvironment`), `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps
non-ASCII text (`ensure_ascii=False`), `raise_exception` and `strftime_now`,
and the `{% generation %}` tag (rendered as its body). Templates receive
`messages`, `tools`, `add_generation_prompt` and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...), like theirs.

`CHATML` is the template of this project's own chat models: ChatML turns,
tools listed in the system turn as JSON, and tool calls as JSON inside
<tool_call> tags (the format of Qwen-based diffusion models such as Dream and
DiffuCoder), tool results inside <tool_response> tags in a user turn.
`SMOLLM2` is the same with SmolLM2-Instruct's default system prompt.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Sequence

CHATML = """\
{%- if tools %}
  {{- '<|im_start|>system\\n' }}
  {%- if messages and messages[0].role == 'system' %}
    {{- messages[0].content + '\\n\\n' }}
  {%- endif %}
  {{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:\\n<tools>' }}
  {%- for tool in tools %}
    {{- '\\n' + (tool | tojson) }}
  {%- endfor %}
  {{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments inside'
      ' <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
      '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
  {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'system' %}
    {%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}
  {%- elif message.role == 'user' %}
    {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {{- '<|im_start|>assistant\\n' }}
    {%- generation %}
      {%- if message.content %}{{- message.content }}{%- endif %}
      {%- for call in message.tool_calls or [] %}
        {%- set fn = call.function if call.function is defined else call %}
        {%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
        {{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' }}
        {%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
        {{- '}\\n</tool_call>' }}
      {%- endfor %}
      {{- '<|im_end|>' }}
    {%- endgeneration %}
    {{- '\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- else %}
    {{- raise_exception('unknown role: ' + message.role) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _with_default_system(template: str, system: str) -> str:
  """A ChatML template that opens with `system` when the conversation has no
  system turn of its own (with tools too), as SmolLM2-Instruct's does."""
  tools_head = "    {{- messages[0].content + '\\n\\n' }}\n  {%- endif %}"
  plain_head = "  {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n{%- endif %}"
  for head in (tools_head, plain_head):
    if template.count(head) != 1:
      raise AssertionError(f"the ChatML template changed: {head!r} not found once")
  out = template.replace(tools_head, tools_head[:-len("{%- endif %}")]
                         + "{%- else %}\n    {{- default_system + '\\n\\n' }}\n  {%- endif %}")
  out = out.replace(plain_head, plain_head[:-len("{%- endif %}")]
                    + "{%- else %}\n  {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}\n{%- endif %}")
  return "{%- set default_system = " + json.dumps(system) + " %}\n" + out


# SmolLM2-Instruct's own ChatML (its default system prompt) with CHATML's tools and tool calls:
# the template of the packaged default, SmolLM2-135M-Instruct adapted to block diffusion.
SMOLLM2 = _with_default_system(CHATML, SMOLLM2_SYSTEM)

TURN_END = "<|im_end|>"  # where a ChatML assistant turn ends: a stop string for decoding


def _environment():
  import jinja2
  from jinja2 import ext, nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's part in
    transformers' templates; here it renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.Scope(body, lineno=lineno)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


@functools.lru_cache(maxsize=16)
def compile_template(template: str):
  """The compiled template (cached: a server renders one template many times).
  ValueError with jinja's message for a template that does not parse."""
  import jinja2
  try:
    return _environment().from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"chat template: {e.message} (line {e.lineno})") from None


def render(template: str, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = False, special_tokens: dict[str, str] | None = None,
           **kwargs: Any) -> str:
  """The conversation as the model reads it. A `raise_exception` in the
  template (a role it does not allow, ...) is a ValueError with its message."""
  import jinja2
  try:
    return compile_template(template).render(messages=list(messages), tools=list(tools) if tools else None,
                                             add_generation_prompt=add_generation_prompt,
                                             **(special_tokens or {}), **kwargs)
  except jinja2.TemplateError as e:
    raise ValueError(f"chat template: {e}") from None


BUILT_IN = {"chatml": CHATML, "smollm2": SMOLLM2}


def named(name: str) -> str | None:
  """A training config's `data.chat_template`: "" (none) or a built-in name."""
  if not name:
    return None
  if name not in BUILT_IN:
    raise ValueError(f"unknown chat template {name!r}; choose from {sorted(BUILT_IN)}")
  return BUILT_IN[name]


def from_folder(folder: str) -> str | None:
  """A checkpoint folder's chat template: `chat_template.jinja`, else the
  `chat_template` of `tokenizer_config.json` (a string, or named templates of
  which `default` is taken); None when it has none."""
  path = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    value = json.load(f).get("chat_template")
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    value = named.get("default")
  if value is not None and not isinstance(value, str):
    raise ValueError(f"{path}: chat_template must be a string or a list of named templates")
  return value


def special_tokens_of(folder: str) -> dict[str, str]:
  """bos_token, eos_token, ... as `tokenizer_config.json` names them (strings
  or AddedToken objects), for templates that print them."""
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  out = {}
  for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token"):
    value = config.get(name)
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      out[name] = value
  return out
