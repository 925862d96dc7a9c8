"""Tool calling: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls`,
decoded under the grammar of the chat format's calls, and read back out.

Calls are written the way the packaged ChatML template (and Qwen-based
diffusion models: Dream, DiffuCoder) writes them, JSON inside tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several separated by a newline. With `required` or a named function the
whole answer is calls; with `auto` the model writes text, or starts a call,
and from the opening tag on the call is constrained: its name is one of the
tools and its arguments validate against that tool's `parameters`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Sequence

from mdlm_jax.sampling.grammar import JSON_LAYOUT, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
OPENED = OPEN + "\n"  # what a call's body follows
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(OPEN) + r"\n(.*?)\n" + re.escape(CLOSE), re.S)


class ToolError(ValueError):
  """A malformed tools request; `param` names the field."""

  def __init__(self, param: str, message: str):
    super().__init__(f"{param}: {message}")
    self.param = param


@dataclasses.dataclass(frozen=True)
class Tools:
  """What a request asked for: its functions (as given, for the template),
  `choice` none | auto | required | named, the named function, and whether
  several calls may come in one answer."""
  specs: tuple[dict, ...]
  choice: str
  named: str | None = None
  parallel: bool = True

  @property
  def names(self) -> list[str]:
    return [t["function"]["name"] for t in self.specs]

  def parameters(self, name: str) -> dict:
    fn = next(t["function"] for t in self.specs if t["function"]["name"] == name)
    return fn.get("parameters") or {"type": "object", "properties": {}}


def parse(body: dict) -> Tools | None:
  """The request's tools, or None when it has none (or an empty list)."""
  tools = body.get("tools")
  if tools is None or tools == []:
    if body.get("tool_choice") not in (None, "none", "auto"):
      raise ToolError("tool_choice", "names a tool, but the request has no tools")
    return None
  if not isinstance(tools, list):
    raise ToolError("tools", "must be an array of function tools")
  seen = set()
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
      raise ToolError(f"tools[{i}]", 'each tool must be {"type": "function", "function": {"name": ...}}')
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
      raise ToolError(f"tools[{i}].function.name", "a name of 1 to 64 letters, digits, _ or - is required")
    if name in seen:
      raise ToolError(f"tools[{i}].function.name", f"{name!r} is defined twice")
    seen.add(name)
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
      raise ToolError(f"tools[{i}].function.parameters", "must be a JSON Schema object")
    for key in fn:
      if key not in ("name", "description", "parameters", "strict"):
        raise ToolError(f"tools[{i}].function.{key}", "not a function field")
  choice = body.get("tool_choice", "auto")
  choice = "auto" if choice is None else choice
  named = None
  if isinstance(choice, dict):
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
      raise ToolError("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    if fn["name"] not in seen:
      raise ToolError("tool_choice", f"names {fn['name']!r}, which is not one of the tools")
    choice, named = "named", fn["name"]
  elif choice not in ("none", "auto", "required"):
    raise ToolError("tool_choice", f"must be none, auto, required or a named function, got {choice!r}")
  parallel = body.get("parallel_tool_calls", True)
  if not isinstance(parallel, bool):
    raise ToolError("parallel_tool_calls", "must be a boolean")
  return Tools(tuple(tools), choice, named, parallel)


def one_call(tools: Tools) -> Tools:
  """The same tools with one call an answer: the grammar of each call of a
  lazily constrained answer (`lazy_calls`), which asks the model itself
  whether another follows."""
  return dataclasses.replace(tools, parallel=False)


def grammar(tools: Tools, opened: bool = False) -> Grammar | None:
  """The grammar of an answer under `tools.choice` (None for `none`), or
  with `opened` of what follows a call's opening tag and newline, the
  text before them already written (`lazy_calls`)."""
  if tools.choice == "none":
    return None
  names = [tools.named] if tools.choice == "named" else tools.names
  body = {"x-guidance": JSON_LAYOUT, "anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools.parameters(n)},
                     "required": ["name", "arguments"], "additionalProperties": False} for n in names]}
  parallel = tools.parallel and tools.choice != "named"
  more = ' (NEXT body "\\n</tool_call>")*' if parallel else ""
  if opened:
    start = "start: calls\ncalls: body \"\\n</tool_call>\"" + more
  elif tools.choice == "auto":
    # Text, or text then calls: the lazy head ends at the first opening tag,
    # and from there the call is forced (llguidance's tool-calling pattern).
    start = "start: TEXT | calls\ncalls: head body \"\\n</tool_call>\"" + more + "\nhead[lazy]: TEXT \"<tool_call>\\n\""
  else:
    start = "start: calls\ncalls: \"<tool_call>\\n\" body \"\\n</tool_call>\"" + more
  lark = (f"{start}\nbody: %json {json.dumps(body)}\nTEXT: /(.|\\n)*/\nNEXT: \"\\n<tool_call>\\n\"\n")
  return Grammar.lark(lark, "tools")


@dataclasses.dataclass
class Call:
  id: str
  name: str
  arguments: str  # JSON text, as OpenAI sends it

  def message(self) -> dict:
    return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_id() -> str:
  return "call_" + secrets.token_hex(12)


def split(text: str) -> tuple[str | None, list[Call]]:
  """(content, calls) of an answer: the text before the first call, and
  every complete call in it (a call cut by max_tokens is dropped)."""
  calls = []
  for m in _CALL.finditer(text):
    try:
      obj = json.loads(m.group(1))
    except ValueError:
      continue
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
      calls.append(Call(_call_id(), obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
  cut = text.find(OPEN)
  content = text if cut < 0 else text[:cut].rstrip("\n")
  return (content or None), calls


class CallStream:
  """OpenAI's streamed tool-call deltas from an answer's growing text: the
  content before the first call, then per call one delta with its id and
  name and others with pieces of its arguments' JSON."""

  def __init__(self):
    self.content_sent = 0
    self.calls: list[dict[str, Any]] = []  # per call: id, name, arguments sent so far

  def feed(self, text: str, final: bool = False) -> list[dict]:
    """Deltas for `text` (the whole answer so far): {"content": ...} or
    {"tool_calls": [...]}. A possible opening tag at the end waits."""
    out = []
    cut = text.find(OPEN)
    if cut >= 0:
      content = text[:cut].rstrip("\n")
    elif final:
      content = text
    else:  # hold back what could still be the start of a call: "\n<tool_c"
      keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)
      content = text[:len(text) - keep].rstrip("\n")
    if len(content) > self.content_sent:
      out.append({"content": content[self.content_sent:]})
      self.content_sent = len(content)
    if cut < 0:
      return out
    for i, start in enumerate(m.start() for m in re.finditer(re.escape(OPEN), text)):
      part = text[start + len(OPEN):]
      head = re.match(r'\n\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ', part)
      if head is None:
        continue
      if i == len(self.calls):
        self.calls.append({"id": _call_id(), "name": json.loads(head.group(1)), "sent": 0})
        c = self.calls[i]
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": ""}}]})
      args = part[head.end():]
      try:
        _, end = json.JSONDecoder().raw_decode(args)
        args = args[:end]
      except ValueError:
        pass  # still being written: all of it belongs to the arguments
      c = self.calls[i]
      if len(args) > c["sent"]:
        out.append({"tool_calls": [{"index": i, "function": {"arguments": args[c["sent"]:]}}]})
        c["sent"] = len(args)
    return out


def check_history(messages: Sequence[dict]) -> None:
  """Every tool message answers a call an earlier assistant message made."""
  made = set()
  for i, m in enumerate(messages):
    for call in m.get("tool_calls") or []:
      made.add(call["id"])
    if m["role"] == "tool" and m["tool_call_id"] not in made:
      raise ToolError(f"messages[{i}].tool_call_id", f"{m['tool_call_id']!r} answers no earlier tool call")


__all__ = ["CLOSE", "Call", "CallStream", "OPEN", "OPENED", "ToolError", "Tools", "check_history", "grammar", "parse", "split"]
