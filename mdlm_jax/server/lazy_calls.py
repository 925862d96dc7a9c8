"""tool_choice "auto" as two engine requests: the answer as free text until
the model opens a call, then the calls under their grammar.

Under one lazy grammar (any text, then calls from the first opening tag)
every pass of an answer is a guided pass, and a guided request neither
revises nor drafts from the table: on the packaged default, four chat
answers with tools (none calling one) ran at 46 to 52 tokens/s and 1.11
tokens a pass under it, and at 80 tokens/s and 1.56 tokens a pass as free
requests, which revise (the base's own text; docs/serving.md). So the text
goes first as a free request that also stops at the opening tag. Where it
stopped there, a second request goes on from the prompt, that text and the
tag, under the grammar of what follows a tag (`tools.grammar(opened=True)`);
its answer is the first's text, the tag and its own. The pair sits behind
the handle interface the server reads (`add_listener`, `poll`, `cancel`), so
streaming, usage and call parsing see one answer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from mdlm_jax.engine.requests import Event, Request
from mdlm_jax.server import tools as tools_lib


def first_request(request: Request) -> Request:
  """The free part of a lazily constrained answer: no grammar, and the
  opening tag among its stop strings."""
  return dataclasses.replace(request, grammar=None, end_ids=(), stop=tuple(dict.fromkeys(request.stop + (
      tools_lib.OPEN,))))


class LazyCalls:
  """One choice: the free request's handle `first`, then (if it opened a
  call) the calls' request, sent with `submit`. `then(text,
  completion_tokens)` makes that request from the first's text, with the
  tokens the tag takes, or None when no room is left for a call."""

  def __init__(self, first, submit: Callable[[Request], object],
               then: Callable[[str, int], tuple[Request, int] | None]):
    self._first, self._submit, self._then = first, submit, then
    self._lock = threading.Lock()
    self._listeners: list[tuple[Callable[[], None], bool]] = []
    self._cancelled = False
    self._second = None
    self._prefix, self._tokens, self._passes = "", 0, 0  # the first's text and the tag, their tokens, its passes

  def add_listener(self, fn: Callable[[], None], *, end_only: bool = False) -> None:
    with self._lock:
      self._listeners.append((fn, end_only))
      current = self._second or self._first
    current.add_listener(fn, end_only=end_only)

  def cancel(self) -> None:
    with self._lock:
      self._cancelled = True
      current = self._second or self._first
    current.cancel()

  def poll(self) -> list[Event]:
    out = []
    if self._second is None:
      for ev in self._first.poll():
        if ev.kind == "done" and ev.stopped_by == tools_lib.OPEN and not self._cancelled:
          out += self._open(ev)
        else:
          out.append(ev)
    if self._second is not None:
      out += [self._joined(ev) for ev in self._second.poll()]
    return out

  def _open(self, ev: Event) -> list[Event]:
    """The first request stopped at a call's opening tag: the second starts."""
    made = self._then(ev.text, ev.completion_tokens)
    if made is None:  # no room left for a call: the answer is its text, cut
      return [dataclasses.replace(ev, finish_reason="length", stopped_by=None)]
    request, tag_tokens = made
    self._prefix, self._tokens, self._passes = ev.text + tools_lib.OPENED, ev.completion_tokens + tag_tokens, ev.passes
    try:
      second = self._submit(request)
    except Exception:  # pylint: disable=broad-except  (a full queue, a closing engine: the answer fails as one)
      return [Event("done", ev.text, "error", passes=ev.passes)]
    with self._lock:
      self._second = second
      listeners, cancelled = list(self._listeners), self._cancelled
    if cancelled:
      second.cancel()
    for fn, end_only in listeners:
      second.add_listener(fn, end_only=end_only)
    return [Event("delta", tools_lib.OPENED, passes=ev.passes)]

  def _joined(self, ev: Event) -> Event:
    """An event of the second request as one of the whole answer."""
    passes = self._passes + ev.passes
    if ev.kind == "delta":
      return dataclasses.replace(ev, passes=passes)
    if ev.kind == "draft":
      return dataclasses.replace(ev, text=self._prefix + ev.text, passes=passes)
    if ev.finish_reason in ("error", "cancelled"):
      return dataclasses.replace(ev, passes=passes)
    return dataclasses.replace(ev, text=self._prefix + ev.text, completion_tokens=self._tokens + ev.completion_tokens,
                               passes=passes)
