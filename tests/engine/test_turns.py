"""A turn's encoding for the other processes of a multi-host server: every decoding setting of a
request arrives as it was sent, whichever field it is."""

import dataclasses
import types

import numpy as np

from mdlm_jax.engine.requests import Request
from mdlm_jax.engine.slots import SlotConfig
from mdlm_jax.engine.turns import Turn, decode, encode
from mdlm_jax.sampling.samplers import RULES, ThresholdSampler

SC = types.SimpleNamespace(num_slots=3, max_prompt=8, block_size=4, bitmask_words=2)


def samplers_unlike_the_default(rng) -> list:
  """Every travelling field of every rule the engine serves away from its default, in one sampler or
  another (revise excludes the fused head; agreement, lookup, head_width and model_drafts go with revise): a field
  the encoding forgot comes back wrong."""
  out = []
  for kind in RULES.values():
    changes = _changed_fields(kind, rng)
    apart = [f for f in ("revise", "fused_head") if f in changes] or [None]
    for other in apart:
      left_out = ({other, "agreement", "lookup", "head_width", "model_drafts", "table_floor"} if other == "revise"
                  else {other})
      out.append(kind(block_size=SC.block_size, kv_cache=True,
                      **{k: v for k, v in changes.items() if k not in left_out}))
  return out


def _changed_fields(kind, rng) -> dict:
  changes = {}
  for f in dataclasses.fields(kind):
    # The engine's own: cached blocks of its size, and the widths of its passes.
    if f.name in ("block_size", "kv_cache", "block_causal", "pass_widths"):
      continue
    if f.name == "head_width":  # at least the block
      changes[f.name] = SC.block_size + int(rng.integers(1, 3))
    elif isinstance(f.default, bool):
      changes[f.name] = not f.default
    elif isinstance(f.default, float):
      changes[f.name] = float(np.float32(rng.uniform(0.05, 0.95)))
    elif isinstance(f.default, int):
      changes[f.name] = f.default + int(rng.integers(1, 3))
    elif f.name == "logit_bias":
      changes[f.name] = ((int(rng.integers(5, 50)), float(np.float32(rng.normal()))),)
    else:
      raise AssertionError(f"the test does not know how to vary {f.name}")
  return changes


def test_every_setting_travels():
  rng = np.random.default_rng()
  for sampler in samplers_unlike_the_default(rng):
    request = Request([1, 2, 3], 8, sampler, suffix_ids=[7, 9])
    key = np.asarray(rng.integers(0, 1 << 31, 2), np.uint32)
    revising = getattr(sampler, "revise", False)
    head_only = revising and not sampler.model_drafts
    turn = Turn(release=[2], admits=[(1, request, key, 0, 5)], rows=2, with_head=True, revising=revising,
                head_only=head_only)
    back = decode(encode(turn, SC), SC)
    (row, got, got_key, start, stop), = back.admits
    assert type(got.sampler) is type(sampler) and got.sampler == sampler
    assert (row, start, stop, list(got.prompt_ids), list(got.suffix_ids), got.max_tokens) == (1, 0, 5, [1, 2, 3],
                                                                                               [7, 9], 8)
    np.testing.assert_array_equal(got_key, key)
    assert back.release == [2] and back.rows == 2 and back.with_head and not back.stop
    assert back.revising == revising and back.head_only == head_only


def test_turns_survive_the_broadcast_encoding():
  """What process 0 sends its followers each turn decodes to the same device work."""
  sc = SlotConfig(num_slots=4, block_size=8, max_prompt=16, max_new_tokens=32, mask_id=3, eos_id=2, vocab_size=100)
  rng = np.random.default_rng(0)
  sampler = ThresholdSampler(threshold=0.7, min_tokens=2, temperature=0.5, top_p=0.9, block_size=8, kv_cache=True,
                             presence_penalty=0.25, frequency_penalty=-1.5, logit_bias=((7, -100.0), (99, 3.5)))
  admits = [(row, Request(rng.integers(0, 100, size=n).tolist(), 24, sampler, seed=10 ** 12, stop=("x",),
                          suffix_ids=rng.integers(0, 100, size=s).tolist()),
             rng.integers(0, 2 ** 32, size=2, dtype=np.uint64).astype(np.uint32), start, stop)
            for row, n, s, start, stop in ((2, 16, 0, 8, 16), (0, 1, 5, 0, 6))]
  guides = [(1, rng.integers(0, 100, size=3).tolist(), 11, rng.integers(0, 2 ** 32, size=4, dtype=np.uint64)
             .astype(np.uint32), 2), (3, [], 0, np.zeros(4, np.uint32), 0)]
  turn = Turn(release=[1, 3], admits=admits, guides=guides, rows=4, with_head=True, guided=True, logprobs=True)
  back = decode(encode(turn, sc), sc)
  assert (back.stop, back.release, back.rows, back.with_head, back.guided, back.logprobs) == \
      (False, [1, 3], 4, True, True, True)
  for (row, tokens, cursor, allowed, n), (row2, tokens2, cursor2, allowed2, n2) in zip(guides, back.guides,
                                                                                     strict=True):
    assert (row2, tokens2, cursor2, n2) == (row, tokens, cursor, n)
    np.testing.assert_array_equal(allowed2, allowed)
  for (row, r, key, *span), (row2, r2, key2, *span2) in zip(turn.admits, back.admits, strict=True):
    assert span2 == span  # the chunk of the prompt this turn encodes
    assert row2 == row and list(r2.prompt_ids) == list(r.prompt_ids) and r2.max_tokens == r.max_tokens
    assert list(r2.suffix_ids) == list(r.suffix_ids)
    a, b = r.sampler, r2.sampler
    assert b.min_tokens == a.min_tokens and np.float32(b.threshold) == np.float32(a.threshold)
    assert np.float32(b.temperature) == np.float32(a.temperature) and np.float32(b.top_p) == np.float32(a.top_p)
    assert (b.presence_penalty, b.frequency_penalty, b.logit_bias) == (a.presence_penalty, a.frequency_penalty,
                                                                       a.logit_bias)
    np.testing.assert_array_equal(key2, key)
  assert decode(encode(Turn(stop=True), sc), sc).stop
