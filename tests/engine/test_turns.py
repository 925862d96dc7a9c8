"""A turn's encoding for the other processes of a multi-host server: every decoding setting of a
request arrives as it was sent, whichever field it is."""

import dataclasses
import types

import numpy as np

from mdlm_jax.engine.requests import Request
from mdlm_jax.engine.turns import Turn, decode, encode
from mdlm_jax.sampling.samplers import ThresholdSampler

SC = types.SimpleNamespace(num_slots=3, max_prompt=8, block_size=4, bitmask_words=2)


def a_sampler_unlike_the_default(rng) -> ThresholdSampler:
  """Every travelling field away from its default: a field the encoding forgot comes back wrong."""
  changes = {}
  for f in dataclasses.fields(ThresholdSampler):
    if f.name in ("block_size", "kv_cache", "block_causal"):  # the engine's own (cached blocks of its size)
      continue
    if isinstance(f.default, bool):
      changes[f.name] = not f.default
    elif isinstance(f.default, float):
      changes[f.name] = float(np.float32(rng.uniform(0.05, 0.95)))
    elif isinstance(f.default, int):
      changes[f.name] = f.default + int(rng.integers(1, 3))
    elif f.name == "logit_bias":
      changes[f.name] = ((int(rng.integers(5, 50)), float(np.float32(rng.normal()))),)
    else:
      raise AssertionError(f"the test does not know how to vary {f.name}")
  return ThresholdSampler(block_size=SC.block_size, kv_cache=True, **changes)


def test_every_setting_travels():
  rng = np.random.default_rng()
  sampler = a_sampler_unlike_the_default(rng)
  request = Request([1, 2, 3], 8, sampler, suffix_ids=[7, 9])
  key = np.asarray(rng.integers(0, 1 << 31, 2), np.uint32)
  turn = Turn(release=[2], admits=[(1, request, key, 0, 5)], rows=2, with_head=True)
  back = decode(encode(turn, SC), SC)
  (row, got, got_key, start, stop), = back.admits
  assert got.sampler == sampler
  assert (row, start, stop, list(got.prompt_ids), list(got.suffix_ids), got.max_tokens) == (1, 0, 5, [1, 2, 3],
                                                                                             [7, 9], 8)
  np.testing.assert_array_equal(got_key, key)
  assert back.release == [2] and back.rows == 2 and back.with_head and not back.stop
