"""Tool calls as a chain of engine requests: free text until the model opens
a call, each call under its grammar, and after each call a short free probe
that says whether the model opens another.

Under one lazy grammar (any text, then calls from the first opening tag)
every pass of an answer is a guided pass, and a guided request neither
revises nor drafts from the table: on the packaged default, four chat
answers with tools (none calling one) ran at 46 to 52 tokens/s and 1.11
tokens a pass under it, and at 80 tokens/s and 1.56 tokens a pass as free
requests, which revise (the base's own text; docs/serving.md). So the text
goes first as a free request that also stops at the opening tag. Where it
stopped there, a request goes on from the prompt, that text and the tag,
under the grammar of one call after a tag (`tools.grammar(opened=True)`).

Parallel calls: under a grammar that allows another call after a closed one,
the only choices after `</tool_call>` are the end of the turn and the newline
that starts the next call, and a model whose own next token is a newline
(the start of prose, on the packaged default) is made to open a second call:
it repeated its call. So each call's grammar ends at its closing tag, and a
free probe goes on from there, as long as two newlines and a tag; the model opens another call
only where, free, it writes an opening tag after nothing but whitespace. The
probe's text is the answer's only if it does.

The chain sits behind the handle interface the server reads (`add_listener`,
`poll`, `cancel`), so streaming, usage and call parsing see one answer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from mdlm_jax.engine.requests import Event, Request
from mdlm_jax.server import tools as tools_lib

def first_request(request: Request) -> Request:
  """A free part of a lazily constrained answer (the text before any call, or
  a probe after one): no grammar, and the opening tag among its stop strings."""
  return dataclasses.replace(request, grammar=None, end_ids=(), stop=tuple(dict.fromkeys(request.stop + (
      tools_lib.OPEN,))))


class LazyCalls:
  """One choice as a chain of requests. `first`: the handle of the free text
  (or, with `calling`, of a request under the grammar of one call: the call
  alone, tool_choice required, or text and then at most one call). `submit`
  sends a request and returns its handle. `then(text, completion_tokens)`
  makes the request of a call that opens after `text` (the answer so far),
  with the tokens the tag takes, or None when no room is left. `probe(text,
  completion_tokens)` makes the free request that follows a closed call, or
  None where no further call may come (one call asked for, or no room)."""

  def __init__(self, first, submit: Callable[[Request], object],
               then: Callable[[str, int], tuple[Request, int] | None],
               probe: Callable[[str, int], Request | None] | None = None, calling: bool = False):
    self._current, self._submit, self._then, self._probe = first, submit, then, probe
    self._phase = "call" if calling else "text"
    self._lock = threading.Lock()
    self._listeners: list[tuple[Callable[[], None], bool]] = []
    self._cancelled = False
    # The answer before the current request's text: its text, tokens and the passes spent on it.
    self._prefix, self._tokens, self._passes = "", 0, 0
    self._ending: Event | None = None  # the answer's end, should the probe open no call

  def add_listener(self, fn: Callable[[], None], *, end_only: bool = False) -> None:
    with self._lock:
      self._listeners.append((fn, end_only))
      current = self._current
    current.add_listener(fn, end_only=end_only)

  def cancel(self) -> None:
    with self._lock:
      self._cancelled = True
      current = self._current
    current.cancel()

  def poll(self) -> list[Event]:
    out = []
    while True:
      handle = self._current
      for ev in handle.poll():
        out += self._step(ev)
      if self._current is handle:
        return out

  def _step(self, ev: Event) -> list[Event]:
    cancelled = self._cancelled
    if self._phase == "probe":
      return self._probed(ev) if ev.kind == "done" else []  # withheld until it says what comes next
    if ev.kind != "done" or cancelled or ev.finish_reason != "stop":
      return [self._joined(ev)]
    if self._phase == "text" and ev.stopped_by == tools_lib.OPEN:
      return self._open(self._prefix + ev.text, self._tokens + ev.completion_tokens, self._passes + ev.passes, ev)
    if self._phase == "call" and self._probe is not None and ev.text.rstrip().endswith(tools_lib.CLOSE):
      return self._closed(ev)  # (an answer whose grammar let it end in prose needs no probe)
    return [self._joined(ev)]

  def _open(self, text: str, tokens: int, passes: int, ev: Event) -> list[Event]:
    """`text` (the answer so far) ends where a call opens: the call's request starts."""
    made = self._then(text, tokens)
    if made is None:  # no room left for a call: the answer is its text (without a probe's), cut
      if self._phase == "probe":
        text, tokens = self._prefix, self._tokens
      return [dataclasses.replace(ev, text=text, completion_tokens=tokens, passes=passes, finish_reason="length",
                                  stopped_by=None)]
    request, tag_tokens = made
    delta = text[len(self._prefix):] if self._phase == "probe" else ""  # a probe's whitespace, withheld so far
    if not self._switch(request, "call"):
      return [Event("done", text, "error", completion_tokens=tokens, passes=passes)]
    self._prefix, self._tokens, self._passes = text + tools_lib.OPENED, tokens + tag_tokens, passes
    return [Event("delta", delta + tools_lib.OPENED, passes=passes)]

  def _closed(self, ev: Event) -> list[Event]:
    """A call closed: a probe asks whether the model opens another."""
    ending = self._joined(ev)
    request = self._probe(ending.text, ending.completion_tokens)
    if request is None:
      return [ending]
    self._ending = ending
    if not self._switch(request, "probe"):
      return [ending]
    self._prefix, self._tokens, self._passes = ending.text, ending.completion_tokens, ending.passes
    return []

  def _probed(self, ev: Event) -> list[Event]:
    """The probe's end: another call where it stopped at an opening tag after whitespace alone, else the
    answer ends where the last call closed."""
    ending, passes = self._ending, self._passes + ev.passes
    self._ending = None
    opens = (ev.finish_reason == "stop" and ev.stopped_by == tools_lib.OPEN and not ev.text.strip()
             and not self._cancelled)
    if opens:
      return self._open(self._prefix + ev.text, self._tokens + ev.completion_tokens, passes, ending)
    if ev.finish_reason in ("error", "cancelled"):
      return [dataclasses.replace(ending, finish_reason=ev.finish_reason, passes=passes)]
    return [dataclasses.replace(ending, passes=passes)]

  def _switch(self, request: Request, phase: str) -> bool:
    """Sends `request` as the chain's current one, its listeners moved on to it."""
    try:
      handle = self._submit(request)
    except Exception:  # pylint: disable=broad-except  (a full queue, a closing engine: the answer ends as one)
      return False
    with self._lock:
      self._current, self._phase = handle, phase
      listeners, cancelled = list(self._listeners), self._cancelled
    if cancelled:
      handle.cancel()
    for fn, end_only in listeners:
      handle.add_listener(fn, end_only=end_only)
    return True

  def _joined(self, ev: Event) -> Event:
    """An event of the current request as one of the whole answer."""
    passes = self._passes + ev.passes
    if ev.kind == "delta" or ev.finish_reason in ("error", "cancelled"):
      return dataclasses.replace(ev, passes=passes)
    if ev.kind == "draft":
      return dataclasses.replace(ev, text=self._prefix + ev.text, passes=passes)
    return dataclasses.replace(ev, text=self._prefix + ev.text, completion_tokens=self._tokens + ev.completion_tokens,
                               passes=passes)
