"""A pass's slot state as the events its callers see, without a model."""

import numpy as np

from mdlm_jax.engine import Handle, Request
from mdlm_jax.engine.publishing import Snapshot, events_for
from mdlm_jax.sampling.generate import MASK_TEXT
from mdlm_jax.sampling.samplers import ThresholdSampler

MASK, EOS, BLOCK = 1, 2, 4
LETTERS = "abcdefgh\n"


class CharTok:
  """Ids 3.. are single characters; 2 is EOS (decodes to nothing); 1 is [MASK]."""
  eos_id, mask_id = EOS, MASK

  def decode(self, ids):
    return "".join(LETTERS[i - 3] if 3 <= i < 3 + len(LETTERS) else "" for i in ids)


TOK = CharTok()


def _ids(text):
  return [3 + LETTERS.index(c) for c in text]


def _handle(*, max_tokens=12, stop=(), want_drafts=False, revise=False):
  sampler = ThresholdSampler(block_size=BLOCK, kv_cache=True, revise=revise)
  return Handle(Request(prompt_ids=[3], max_tokens=max_tokens, sampler=sampler, stop=tuple(stop)), want_drafts)


def _snap(gen, blocks, active=True, revise=False, filled=0, ahead=(), n_ahead=-1):
  gen = np.asarray(gen + [MASK] * (12 - len(gen)))[None]
  ahead_row = np.full((1, BLOCK), 7, np.int32)
  ahead_row[0, :len(ahead)] = ahead
  return Snapshot.of_slots(gen, np.array([blocks]), np.array([active]), np.array([3]), np.array([False]),
                           np.array([revise]), np.array([filled]), ahead_row, np.array([n_ahead]),
                           block_size=BLOCK, mask_id=MASK)


def _texts(events):
  return [(e.kind, e.text) for e in events]


def test_kept_text_goes_out_once_and_a_held_stop_prefix_waits():
  rng = np.random.default_rng()
  h = _handle(stop=["\n\n"])
  words = "".join(rng.choice(list("abcdefgh"), 3))
  first = _ids(words + "\n")  # one block; its last character may start the stop string
  events, done = events_for(h, 0, _snap(first, 1), TOK)
  assert _texts(events) == [("delta", words)] and done is None  # "\n" held back
  events, done = events_for(h, 0, _snap(first, 1), TOK)
  assert events == [] and done is None  # nothing new kept: nothing sent
  second = first + _ids("\nabc")
  events, done = events_for(h, 0, _snap(second, 2), TOK)
  assert events == [] and done.kind == "done" and done.text == words and done.finish_reason == "stop"


def test_an_ended_row_sends_its_tail_and_counts_its_tokens():
  h = _handle(max_tokens=6)
  gen = _ids("abcdef")
  events, done = events_for(h, 0, _snap(gen, 1), TOK)
  assert _texts(events) == [("delta", "abcd")]
  events, done = events_for(h, 0, _snap(gen, 2, active=False), TOK)
  assert _texts(events) == [("delta", "ef")]
  assert (done.text, done.finish_reason, done.completion_tokens, done.passes) == ("abcdef", "length", 6, 3)


def test_eos_ends_a_request_with_stop():
  h = _handle()
  events, done = events_for(h, 0, _snap(_ids("ab") + [EOS, 4], 1, active=False), TOK)
  assert _texts(events) == [("delta", "ab")] and (done.text, done.finish_reason) == ("ab", "stop")


def test_drafts_show_masks_and_a_revising_rows_offers():
  h = _handle(want_drafts=True)
  events, _ = events_for(h, 0, _snap(_ids("abcd") + _ids("e") + [MASK] * 3, 1), TOK)
  assert events[0].kind == "draft" and events[0].text == "abcde" + MASK_TEXT * 7
  # A revising row: 5 tokens verified, the base's next token and one draft offered (n_ahead=1).
  h = _handle(want_drafts=True, revise=True)
  gen = _ids("abcde") + [MASK] * 7
  events, _ = events_for(h, 0, _snap(gen, 1, revise=True, filled=5, ahead=_ids("fg"), n_ahead=1), TOK)
  assert _texts(events) == [("draft", "abcdefg" + MASK_TEXT * 5), ("delta", "abcde")]
