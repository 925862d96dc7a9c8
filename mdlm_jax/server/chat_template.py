"""Turns chat messages into the prompt text the model continues.

The packaged models are code models trained on plain source files, so the
template is plain text: an optional system preamble, then the turns labelled
by role, ending with the assistant's label for the model to continue. The
assistant's answer ends at EOS, or at the next user label (a stop string the
server always adds).
"""

from __future__ import annotations

USER, ASSISTANT = "User:", "Assistant:"
TURN_STOP = "\n" + USER


def render(messages: list[dict[str, str]]) -> str:
  parts = []
  for m in messages:
    if m["role"] == "system":
      parts.append(m["content"].strip() + "\n\n")
    else:
      parts.append(f"{USER if m['role'] == 'user' else ASSISTANT} {m['content'].strip()}\n")
  parts.append(ASSISTANT)
  return "".join(parts)
