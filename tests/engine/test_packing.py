"""The slot state's packing: exact round trips, and what stays whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from mdlm_jax.engine import packing as packing_lib
from mdlm_jax.engine.slots import SlotConfig, state_packing
from mdlm_jax.model.spec import model_spec
from mdlm_jax.model.transformer import ModelConfig


@struct.dataclass
class Inner:
  bits: jax.Array
  flags: jax.Array


@struct.dataclass
class State:
  cache: jax.Array
  scores: jax.Array
  ids: jax.Array
  inner: Inner
  half: jax.Array
  wide: jax.Array


def _state(rows, rng):
  wide = packing_lib.MAX_PACKED_PER_SLOT + 1
  scores = rng.standard_normal((rows, 3, 5)).astype(np.float32)
  scores[0, 0, :3] = [np.nan, np.inf, -0.0]  # bit patterns survive the int32 view
  return State(cache=rng.standard_normal((4, rows, 6)).astype(np.float32), scores=scores,
               ids=rng.integers(-2 ** 31, 2 ** 31 - 1, (rows, 7), dtype=np.int64).astype(np.int32),
               inner=Inner(bits=rng.integers(0, 2 ** 32, (rows, 2), dtype=np.uint64).astype(np.uint32),
                           flags=rng.random((rows,)) < 0.5),
               half=rng.standard_normal((rows, 4)).astype(jnp.bfloat16),
               wide=rng.integers(0, 9, (rows, wide), dtype=np.int32))


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_round_trips_bit_exactly_eagerly_and_under_jit():
  rows = 3
  state = _state(rows, np.random.default_rng(0))
  p = packing_lib.Packing.of(state, rows, keep_whole=lambda name: name == "cache")
  # Kept whole: the named cache, the bfloat16 array (not 4 bytes wide), the one too large to copy.
  assert p.num_own == 3
  assert p.columns == 3 * 5 + 7 + 2 + 1
  packed = p.pack(state)
  assert len(packed) == 4 and packed[-1].dtype == np.int32 and packed[-1].shape == (rows, p.columns)
  _same(p.unpack(packed), state)
  on_device = jax.tree.map(jnp.asarray, state)
  _same(jax.jit(lambda s: p.unpack(p.pack(s)))(on_device), state)
  _same(jax.jit(p.unpack)(jax.jit(p.pack)(on_device)), state)
  np.testing.assert_array_equal(p.own_buffer(packed, "cache"), state.cache)


def test_rows_stay_rows():
  """Row i of the packed buffer holds slot i's values alone (it shards over slots)."""
  rows = 4
  state = _state(rows, np.random.default_rng(1))
  p = packing_lib.Packing.of(state, rows, keep_whole=lambda name: name == "cache")
  buffer = p.pack(state)[-1]
  one = jax.tree.map(lambda x: x[1:2] if x.shape[0] == rows else x[:, 1:2], state)
  p1 = packing_lib.Packing.of(one, 1, keep_whole=lambda name: name == "cache")
  np.testing.assert_array_equal(buffer[1:2], p1.pack(one)[-1])


def test_mismatched_buffers_are_refused():
  rows = 2
  state = _state(rows, np.random.default_rng(2))
  p = packing_lib.Packing.of(state, rows, keep_whole=lambda name: name == "cache")
  packed = p.pack(state)
  with pytest.raises(ValueError, match="not this packing's buffers"):
    p.unpack(packed[1:])
  with pytest.raises(ValueError, match="not this packing's buffers"):
    p.unpack(packed[:-1] + (packed[-1][:, 1:],))
  with pytest.raises(ValueError, match="is packed"):
    p.own_buffer(packed, "ids")


def test_the_engine_state_packs_all_but_keys_and_values():
  cfg = ModelConfig(vocab_size=40, embed_dim=16, num_heads=2, num_layers=2, mlp_dim=32)
  sc = SlotConfig(num_slots=2, block_size=4, max_prompt=16, max_new_tokens=8, mask_id=39, eos_id=2, vocab_size=40)
  p = state_packing(model_spec(cfg, None), sc)
  assert p.num_own == 2
  assert {p.names[i] for i, leaf in enumerate(p.leaves) if leaf.own >= 0} == {"cache.k", "cache.v"}
