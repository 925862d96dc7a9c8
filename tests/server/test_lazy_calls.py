"""tool_choice auto as a free request, then the calls' request: the joined
events against hand-built cases, with fake handles standing in for the engine's."""

import dataclasses

from mdlm_jax.engine.requests import Event, Request
from mdlm_jax.sampling.finish import finish
from mdlm_jax.server import lazy_calls, tools


class FakeHandle:
  """Events pushed by hand; listeners as the engine's handle calls them."""

  def __init__(self, request):
    self.request, self.events, self.listeners, self.cancelled = request, [], [], False

  def add_listener(self, fn, *, end_only=False):
    self.listeners.append((fn, end_only))

  def push(self, *events):
    self.events += events
    for fn, end_only in self.listeners:
      if not end_only or any(e.kind == "done" for e in events):
        fn()

  def poll(self):
    out, self.events = self.events, []
    return out

  def cancel(self):
    self.cancelled = True


def _pair(max_tokens=32, tag=3, probing=False, calling=False):
  first = FakeHandle(Request([1, 2], max_tokens, sampler=None))
  made, submitted = [], []

  def then(text, used):
    if max_tokens - used - tag < 1:
      return None
    made.append((text, used))
    return Request([1, 2, 9], max_tokens - used - tag, sampler=None), tag

  def submit(r):
    submitted.append(FakeHandle(r))
    return submitted[-1]

  def probe(text, used):
    if max_tokens - used - tag < 1:
      return None
    made.append(("probe", text, used))
    return Request([1, 2, 8], min(7, max_tokens - used), sampler=None, stop=(tools.OPEN,))

  return (lazy_calls.LazyCalls(first, submit, then, probe if probing else None, calling=calling), first, made,
          submitted)


def test_first_request_stops_at_the_opening_tag_without_a_grammar():
  r = Request([1], 8, sampler=None, stop=("<|im_end|>",), grammar="g", end_ids=(5,))
  got = lazy_calls.first_request(r)
  assert got.grammar is None and got.end_ids == () and got.stop == ("<|im_end|>", tools.OPEN)
  assert lazy_calls.first_request(got).stop == got.stop  # the tag once


def test_an_answer_without_a_call_is_the_free_request_alone():
  lazy, first, made, submitted = _pair()
  woken = []
  lazy.add_listener(lambda: woken.append(1))
  first.push(Event("delta", "Hello", passes=2), Event("done", "Hello", "stop", completion_tokens=2, passes=3,
                                                      stopped_by="<|im_end|>"))
  assert woken and [e.kind for e in lazy.poll()] == ["delta", "done"]
  assert not made and not submitted


def test_an_opened_call_goes_on_under_the_calls_request():
  lazy, first, made, submitted = _pair()
  woken = []
  lazy.add_listener(lambda: woken.append("end"), end_only=True)
  first.push(Event("delta", "Let me look.", passes=4),
             Event("done", "Let me look.\n", "stop", completion_tokens=5, passes=6, stopped_by=tools.OPEN))
  events = lazy.poll()
  assert [(e.kind, e.text) for e in events] == [("delta", "Let me look."), ("delta", tools.OPENED)]
  assert made == [("Let me look.\n", 5)] and len(submitted) == 1
  second = submitted[0]
  assert second.request.max_tokens == 32 - 5 - 3 and second.listeners  # the listener moved on with it
  call = '{"name": "f", "arguments": {}}\n</tool_call>'
  second.push(Event("delta", call[:10], passes=2), Event("draft", "x", passes=2),
              Event("done", call, "stop", completion_tokens=7, passes=3))
  joined = lazy.poll()
  assert woken == ["end", "end"]  # the first's end (the poller opens the call), then the answer's
  assert [(e.kind, e.passes) for e in joined] == [("delta", 8), ("draft", 8), ("done", 9)]
  assert joined[1].text == "Let me look.\n" + tools.OPENED + "x"
  done = joined[-1]
  assert done.text == "Let me look.\n" + tools.OPENED + call and done.finish_reason == "stop"
  assert done.completion_tokens == 5 + 3 + 7
  content, calls = tools.split(done.text)
  assert content.strip() == "Let me look." and [c.name for c in calls] == ["f"]
  lazy.cancel()
  assert second.cancelled and not first.cancelled


def test_no_room_for_a_call_ends_the_answer_by_length():
  lazy, first, made, submitted = _pair(max_tokens=8, tag=3)
  first.push(Event("done", "abc", "stop", completion_tokens=6, passes=2, stopped_by=tools.OPEN))
  (done,) = lazy.poll()
  assert done.kind == "done" and done.finish_reason == "length" and done.text == "abc" and not submitted


def test_a_cancelled_answer_opens_no_call():
  lazy, first, made, submitted = _pair()
  lazy.cancel()
  assert first.cancelled
  first.push(Event("done", "a", "cancelled", passes=1, stopped_by=tools.OPEN))
  assert [e.finish_reason for e in lazy.poll()] == ["cancelled"] and not submitted


def test_finish_names_the_stop_string_that_cut_it():
  class Tok:
    eos_id = 0

    @staticmethod
    def decode(ids):
      return "".join(chr(96 + i) for i in ids)

  ids = [1, 2, 3, 4, 5, 6]  # "abcdef"
  assert finish(Tok, ids, max_tokens=9, stop=("de", "cd", "bcx")).stopped_by == "cd"
  assert finish(Tok, ids, max_tokens=9, stop=("c", "cde")).stopped_by == "cde"  # the longest at the cut
  assert finish(Tok, ids, max_tokens=9, stop=("zz",)).stopped_by is None
  assert dataclasses.replace(finish(Tok, [1, 0, 2], max_tokens=9), tokens=[]).stopped_by is None  # EOS


CALL = '{"name": "f", "arguments": {}}\n</tool_call>'


def test_a_probe_that_opens_a_tag_after_whitespace_starts_another_call():
  """tool_choice required, parallel: the first call, a probe that opens a second, the second call, and a
  probe that writes prose: the answer is the two calls, the second probe's text and tokens left out."""
  lazy, first, made, submitted = _pair(max_tokens=64, probing=True, calling=True)
  woken = []
  lazy.add_listener(lambda: woken.append(1), end_only=True)
  first.push(Event("delta", tools.OPENED, passes=1), Event("done", tools.OPENED + CALL, "stop", completion_tokens=9,
                                                           passes=4))
  assert [(e.kind, e.text) for e in lazy.poll()] == [("delta", tools.OPENED)]  # the call's end is withheld
  assert made == [("probe", tools.OPENED + CALL, 9)] and len(submitted) == 1 and submitted[0].listeners
  probe = submitted[0]
  probe.push(Event("delta", "\n", passes=1), Event("done", "\n", "stop", completion_tokens=1, passes=1,
                                                   stopped_by=tools.OPEN))
  so_far = tools.OPENED + CALL + "\n"
  assert [(e.kind, e.text, e.passes) for e in lazy.poll()] == [("delta", "\n" + tools.OPENED, 5)]
  assert made[-1] == (so_far, 10) and len(submitted) == 2
  second = submitted[1]
  assert second.request.max_tokens == 64 - 10 - 3
  second.push(Event("done", CALL, "stop", completion_tokens=9, passes=3))
  assert lazy.poll() == [] and made[-1] == ("probe", so_far + tools.OPENED + CALL, 22)
  submitted[2].push(Event("done", "\n\nThe weather", "length", completion_tokens=4, passes=2))
  (done,) = lazy.poll()
  assert done.kind == "done" and done.finish_reason == "stop"
  assert done.text == so_far + tools.OPENED + CALL and done.completion_tokens == 22 and done.passes == 10
  assert [c.name for c in tools.split(done.text)[1]] == ["f", "f"]
  assert len(woken) == 4  # each request's end wakes the poller


def test_a_probe_ending_the_turn_ends_the_answer_and_one_call_asks_no_probe():
  lazy, first, made, submitted = _pair(probing=True, calling=True)
  first.push(Event("done", tools.OPENED + CALL, "stop", completion_tokens=9, passes=4))
  assert lazy.poll() == []
  submitted[0].push(Event("done", "", "stop", completion_tokens=1, passes=1))  # the end of the turn
  (done,) = lazy.poll()
  assert done.text == tools.OPENED + CALL and done.finish_reason == "stop" and done.completion_tokens == 9
  lazy, first, made, submitted = _pair(probing=False, calling=True)  # parallel_tool_calls false
  first.push(Event("done", tools.OPENED + CALL, "stop", completion_tokens=9, passes=4))
  (done,) = lazy.poll()
  assert done.text == tools.OPENED + CALL and not submitted


def test_a_probe_with_text_before_its_tag_or_no_room_opens_no_call():
  lazy, first, made, submitted = _pair(probing=True, calling=True)
  first.push(Event("done", tools.OPENED + CALL, "stop", completion_tokens=9, passes=4))
  lazy.poll()
  submitted[0].push(Event("done", "\nOK", "stop", completion_tokens=2, passes=1, stopped_by=tools.OPEN))
  (done,) = lazy.poll()
  assert done.text == tools.OPENED + CALL and len(submitted) == 1
  # room for the probe's whitespace but not for another call's tag: the answer is cut where the call closed
  lazy, first, made, submitted = _pair(max_tokens=13, probing=True, calling=True)
  first.push(Event("done", tools.OPENED + CALL, "stop", completion_tokens=9, passes=4))
  lazy.poll()
  submitted[0].push(Event("done", "\n", "stop", completion_tokens=1, passes=1, stopped_by=tools.OPEN))
  (done,) = lazy.poll()
  assert done.finish_reason == "length" and done.text == tools.OPENED + CALL and done.completion_tokens == 9


def test_an_answer_cancelled_while_probing_ends_cancelled():
  lazy, first, made, submitted = _pair(probing=True, calling=True)
  first.push(Event("done", tools.OPENED + CALL, "stop", completion_tokens=9, passes=4))
  lazy.poll()
  lazy.cancel()
  assert submitted[0].cancelled and not first.cancelled
  submitted[0].push(Event("done", "\n", "cancelled", passes=1, stopped_by=tools.OPEN))
  (done,) = lazy.poll()
  assert done.finish_reason == "cancelled" and len(submitted) == 1


def test_text_and_a_call_under_one_grammar_probe_only_after_the_call():
  """tool_choice auto where the answer outgrows a prompt: the text and its first call are one
  request under the grammar of one call; prose alone ends the answer, a closed call asks the probe."""
  lazy, first, made, submitted = _pair(probing=True, calling=True)
  first.push(Event("done", "It is sunny.", "stop", completion_tokens=4, passes=2, stopped_by="<|im_end|>"))
  (done,) = lazy.poll()
  assert done.text == "It is sunny." and done.finish_reason == "stop" and not made and not submitted
  lazy, first, made, submitted = _pair(probing=True, calling=True)
  first.push(Event("done", "Let me look.\n" + tools.OPENED + CALL, "stop", completion_tokens=14, passes=6))
  assert lazy.poll() == [] and made == [("probe", "Let me look.\n" + tools.OPENED + CALL, 14)]
  submitted[0].push(Event("done", "", "stop", completion_tokens=1, passes=1))
  (done,) = lazy.poll()
  assert done.text == "Let me look.\n" + tools.OPENED + CALL and done.completion_tokens == 14 and done.passes == 7
  content, calls = tools.split(done.text)
  assert content.strip() == "Let me look." and [c.name for c in calls] == ["f"]
