"""Chat templates rendered as transformers renders them (jinja2 sandbox, trim
and lstrip of blocks, tojson without ASCII escapes, raise_exception)."""

import json

import pytest

from mdlm_jax.data import chat_template as ct

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est Paris?"},
        {"role": "assistant", "content": "En France."}, {"role": "user", "content": "Merci"}]

# The shape of Llama 3's template: header ids, trimmed content, BOS before the first turn.
LLAMA3_STYLE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# The shape of LLaDA's: a role header per turn, bos_token once, whitespace trimmed by the block options.
LLADA_STYLE = """{% set loop_messages = messages %}
{% for message in loop_messages %}
  {% if loop.index0 == 0 %}{{ bos_token }}{% endif %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""


def test_chatml_renders_turns_tools_and_calls():
  tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
  messages = [{"role": "user", "content": "Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                  {"id": "b", "type": "function", "function": {"name": "weather", "arguments": {"city": "Lyon"}}}]},
              {"role": "tool", "tool_call_id": "a", "content": "21"}, {"role": "tool", "tool_call_id": "b", "content": "19"}]
  got = ct.render(ct.CHATML, messages, tools=tools, add_generation_prompt=True)
  want = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions. Their signatures are in <tools></tools>:"
          "\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>\n\nFor each call, return a JSON object with the function"
          " name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>,"
          " \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
          "<|im_start|>user\nParis?<|im_end|>\n"
          "<|im_start|>assistant\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
          "\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call><|im_end|>\n"
          "<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n19\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\n")
  assert got == want
  plain = ct.render(ct.CHATML, CHAT)
  assert plain == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOù est Paris?<|im_end|>\n"
                   "<|im_start|>assistant\nEn France.<|im_end|>\n<|im_start|>user\nMerci<|im_end|>\n")


def test_llama3_and_llada_shapes():
  want = ("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nOù est Paris?<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\nEn France.<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nMerci<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert ct.render(LLAMA3_STYLE, CHAT, add_generation_prompt=True, special_tokens={"bos_token": "<s>"}) == want
  # trim_blocks and lstrip_blocks remove the template's own newlines and indentation.
  assert ct.render(LLADA_STYLE, CHAT, add_generation_prompt=True, special_tokens={"bos_token": "<s>"}) == want


def test_jinja_environment_matches_transformers():
  assert ct.render("{{ x | tojson }}", [], x={"é": [1, 2]}) == '{"é": [1, 2]}'  # non-ASCII kept
  assert ct.render("{{ x | tojson(indent=2) }}", [], x={"a": 1}) == '{\n  "a": 1\n}'
  assert ct.render("{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.role }}"
                   "{% endfor %}", CHAT) == "system"
  assert ct.render("{% generation %}{{ messages[0].content }}{% endgeneration %}", CHAT) == "Be brief."
  assert len(ct.render("{{ strftime_now('%Y') }}", [])) == 4
  with pytest.raises(ValueError, match="nope"):
    ct.render("{{ raise_exception('nope') }}", CHAT)
  with pytest.raises(ValueError, match="chat template"):
    ct.render("{{ messages.append(1) }}", CHAT)  # the sandbox forbids changing its inputs
  with pytest.raises(ValueError, match="chat template"):
    ct.render("{% for %}", CHAT)
  with pytest.raises(ValueError, match="a system message must come first"):
    ct.render(ct.CHATML, CHAT[1:] + CHAT[:1])
  with pytest.raises(ValueError, match="unknown role"):
    ct.render(ct.CHATML, [{"role": "robot", "content": "x"}])


def test_templates_are_read_from_checkpoint_folders(tmp_path):
  assert ct.from_folder(str(tmp_path)) is None
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
      "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
  assert ct.from_folder(str(tmp_path)) == "D"
  assert ct.special_tokens_of(str(tmp_path)) == {"bos_token": "<s>", "eos_token": "</s>"}
  (tmp_path / "chat_template.jinja").write_text(LLAMA3_STYLE)
  assert ct.from_folder(str(tmp_path)) == LLAMA3_STYLE  # the file wins, as in transformers
  (tmp_path / "chat_template.jinja").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
  with pytest.raises(ValueError, match="chat_template must be"):
    ct.from_folder(str(tmp_path))


def test_same_as_transformers_when_installed():
  transformers = pytest.importorskip("transformers")
  from transformers.utils.chat_template_utils import render_jinja_template
  for template in (ct.CHATML, LLAMA3_STYLE, LLADA_STYLE):
    theirs, _ = render_jinja_template(conversations=[CHAT], chat_template=template, add_generation_prompt=True,
                                      bos_token="<s>")
    assert ct.render(template, CHAT, add_generation_prompt=True, special_tokens={"bos_token": "<s>"}) == theirs[0]
  del transformers


def test_templates_travel_with_exports_and_imports(tiny_checkpoints, tmp_path):
  """A params-only folder keeps chat_template.jinja, a LLaDA/Dream export puts
  the template in tokenizer_config.json, and import brings it back."""
  from mdlm_jax import checkpoints, export
  from mdlm_jax.checkpoints import interop, params_only
  loaded = checkpoints.load(tiny_checkpoints["mdlm"])
  assert loaded.chat_template is None  # trained with data.chat_template=""
  native = params_only.save(str(tmp_path / "native"), loaded.params, loaded.config, loaded.tokenizer, step=2,
                            chat_template=ct.CHATML)
  assert checkpoints.load(native).chat_template == ct.CHATML
  llada = interop.save(str(tmp_path / "llada"), "llada", loaded.params, loaded.config, loaded.tokenizer, step=2,
                       chat_template=ct.CHATML)
  assert json.load(open(f"{llada}/tokenizer_config.json"))["chat_template"] == ct.CHATML
  assert checkpoints.load(llada).chat_template == ct.CHATML
  export.main(["--import", f"--checkpoint={llada}", f"--out={tmp_path / 'back'}"])
  assert checkpoints.load(str(tmp_path / "back")).chat_template == ct.CHATML
  assert ct.named("chatml") == ct.CHATML and ct.named("") is None
  with pytest.raises(ValueError, match="unknown chat template"):
    ct.named("vicuna")
