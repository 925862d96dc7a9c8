"""Turns chat messages into the prompt the model continues.

A checkpoint with a chat template (`data.chat_template`: its own
Jinja template, or the packaged models' ChatML) is rendered with it, and the
answer ends at EOS or at the template's end-of-turn marker. A checkpoint
without one gets plain text: an optional system preamble, then the turns
labelled by role, ending with the assistant's label; the answer ends at EOS
or at the next user label.
"""

from __future__ import annotations

from mdlm_jax.data import chat_template

USER, ASSISTANT = "User:", "Assistant:"
TURN_STOP = "\n" + USER
# End-of-turn markers of common templates: where an assistant's answer ends.
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def render_plain(messages: list[dict]) -> str:
  parts = []
  for m in messages:
    if m["role"] == "system":
      parts.append(m["content"].strip() + "\n\n")
    else:
      parts.append(f"{USER if m['role'] == 'user' else ASSISTANT} {m['content'].strip()}\n")
  parts.append(ASSISTANT)
  return "".join(parts)


def render(messages: list[dict], template: str | None, tok, tools: list[dict] | None = None
           ) -> tuple[str, tuple[str, ...], bool]:
  """(prompt, stop strings, whether to put BOS before it). A template that
  writes the BOS piece itself gets no second one. A conversation with tools
  or tool turns on a checkpoint without a template is rendered in ChatML,
  the format of the calls the server decodes."""
  if template is None and (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)):
    template = chat_template.CHATML
  if template is None:
    return render_plain(messages), (TURN_STOP,), True
  bos = tok.piece(tok.bos_id)
  special = {"bos_token": bos, "eos_token": tok.piece(tok.eos_id)}
  prompt = chat_template.render(template, messages, tools=tools, add_generation_prompt=True,
                                special_tokens=special)
  return prompt, tuple(t for t in TURN_ENDS if t in template), not prompt.startswith(bos)
