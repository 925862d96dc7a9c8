"""A submitted request as its caller holds it: the events it streams back,
in order, and a way to cancel it; and the engine's bookkeeping of it."""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable

import numpy as np

from mdlm_jax.engine.requests import Event, Request
from mdlm_jax.sampling import grammar as grammar_lib


class Handle:
  """A submitted request: its events, in order, and a way to cancel it."""

  _ids = itertools.count()

  def __init__(self, request: Request, want_drafts: bool):
    self.id = next(self._ids)
    self.request, self.want_drafts = request, want_drafts
    self._events: collections.deque[Event] = collections.deque()
    self._cond = threading.Condition()
    self._listeners: list[Callable[[], None]] = []
    self._end_listeners: list[Callable[[], None]] = []
    # Set with the "done" event: what `result` waits on, so a caller that
    # wants only the end is not woken (its thread contending with the
    # engine's for the interpreter) by every pass's delta.
    self._ended = threading.Event()
    self._done: Event | None = None
    self.cancelled = False
    self.submitted = time.perf_counter()
    # Engine bookkeeping.
    self.slot: int | None = None
    self.emitted = ""
    self.detokenizer = None  # its text so far, decoded a window a pass (`IncrementalText`)
    self.kept_seen = -1  # tokens kept in order (finished blocks' or verified) at the last publish
    self.constraint: grammar_lib.Constraint | None = None
    self.logprobs_sent = 0  # tokens whose log-probabilities went out
    # Prefill progress: tokens of the request's fixed row sent to the device,
    # of `fixed_len` (a chunked prefill sends one chunk a turn).
    self.prefilled = 0
    self.fixed_len = len(request.prompt_ids) + len(request.suffix_ids)
    self.key: np.ndarray | None = None

  @property
  def finished(self) -> bool:
    """Its "done" event has been pushed."""
    return self._ended.is_set()

  @property
  def prefilling(self) -> bool:
    """Holds a slot whose prompt is not all encoded yet (no passes)."""
    return self.slot is not None and self.prefilled < self.fixed_len

  def add_listener(self, fn: Callable[[], None], *, end_only: bool = False) -> None:
    """`fn()` is called (from the engine thread) whenever an event arrives,
    or with `end_only` once the "done" event has (the events before it are
    then all waiting in `poll`)."""
    with self._cond:
      (self._end_listeners if end_only else self._listeners).append(fn)
      pending = self.finished if end_only else bool(self._events)
    if pending:
      fn()

  def _push(self, ev: Event) -> None:
    with self._cond:
      self._events.append(ev)
      if ev.kind == "done":
        self._done = ev
        self._ended.set()
      self._cond.notify_all()
      listeners = list(self._listeners) + (list(self._end_listeners) if ev.kind == "done" else [])
    for fn in listeners:
      fn()

  def poll(self) -> list[Event]:
    with self._cond:
      out = list(self._events)
      self._events.clear()
    return out

  def events(self, timeout: float | None = None):
    """Blocking iterator over events, ending after "done"."""
    while True:
      with self._cond:
        if not self._events and not self._cond.wait_for(lambda: bool(self._events), timeout):
          raise TimeoutError(f"request {self.id}: no event in {timeout}s")
        ev = self._events.popleft()
      yield ev
      if ev.kind == "done":
        return

  def result(self, timeout: float | None = None) -> Event:
    """The "done" event, once the request has ended (the events before it are dropped)."""
    if not self._ended.wait(timeout):
      raise TimeoutError(f"request {self.id}: not done in {timeout}s")
    with self._cond:
      self._events.clear()
    return self._done

  def cancel(self) -> None:
    self.cancelled = True

  def logprob_entries(self, ids, row: int, arrays, upto: int):
    """The entries of the request's tokens [sent so far, upto), if it asked:
    `ids` its generation region, `arrays` the gathered log-probabilities
    (row `row` is this request's)."""
    k = self.request.logprobs
    if k is None or arrays is None:
      return None
    out = []
    if upto > self.logprobs_sent:  # only this row crosses to the host, and only when it has new tokens
      logp, top_ids, top_logp = (np.asarray(a[row]) for a in arrays)
      for j in range(self.logprobs_sent, upto):
        alts = [(int(i), float(v)) for i, v in zip(top_ids[j, :k], top_logp[j, :k]) if np.isfinite(v)]
        out.append((int(ids[j]), float(logp[j]), alts))
    self.logprobs_sent = max(self.logprobs_sent, upto)
    return out
