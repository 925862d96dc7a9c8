"""bench.bound: the bytes a decoding pass reads, against a count by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.bench import bound
from mdlm_jax.model import ModelConfig
from mdlm_jax.model.spec import init_params, model_spec


def _model(tie: bool):
  rng = np.random.default_rng()
  cfg = ModelConfig(vocab_size=int(rng.integers(50, 90)), embed_dim=32, num_heads=4, num_kv_heads=2,
                    num_layers=int(rng.integers(1, 4)), mlp_dim=64, tie_embeddings=tie)
  spec = model_spec(cfg, None)
  return cfg, init_params(spec, jax.random.key(0))


@pytest.mark.parametrize("tie", [True, False])
def test_a_pass_reads_every_weight_but_an_untied_embedding_and_its_cache(tie):
  cfg, params = _model(tie)
  sizes = {jax.tree_util.keystr(k): v.size * v.dtype.itemsize
           for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  table = sum(n for k, n in sizes.items() if "embedding" in k)
  assert table == cfg.vocab_size * cfg.embed_dim * 4
  want = sum(sizes.values()) - (0 if tie else table)
  assert bound.weight_bytes(params, cfg) == want
  head_dim = cfg.embed_dim // cfg.num_heads
  per_token = 2 * cfg.num_layers * 2 * head_dim * 4  # keys and values, 2 KV heads, float32
  row = bound.pass_bound(0.5, want, 10.5, cfg, 1e9)
  assert row["bytes_per_pass"] == int(want + 10.5 * per_token)
  assert row["bound_s"] == pytest.approx(row["bytes_per_pass"] / 1e9)
  assert row["fraction_of_bound"] == pytest.approx(row["bound_s"] / 0.5)


def test_read_bandwidth_is_a_memory_speed():
  bw = bound.read_bandwidth(mib=64, repeats=2)
  assert 1e8 < bw < 1e13  # between a slow disk and any memory there is


def test_adapters_joined_into_int8_weights_are_counted_once(tiny_checkpoints):
  """An adapted model's int8 copy holds its adapters joined into the weights
  only (the float32 copy keeps their own params) and each weight twice (`q`
  and the kernel's tiles): a pass reads the joined adapters and the tiles."""
  from mdlm_jax import checkpoints, kernels
  from mdlm_jax.model.spec import for_decoding
  from tests.conftest import adapted_from
  adapted = adapted_from(checkpoints.load(tiny_checkpoints["ar"]), lora_rank=4)
  q = for_decoding(adapted, decode_dtype="int8")
  cfg = q.spec.cfg
  # each array once: the blocks' layers are views of one stack of each kind
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in {id(x): x for x in jax.tree.leaves(tree)}.values())
  is_q = lambda x: isinstance(x, kernels.QuantizedWeight)
  quantized = [x for x in jax.tree.leaves(q.params, is_leaf=is_q) if is_q(x)]
  assert any(x.adapters is not None for x in quantized)
  loras = nbytes([v for blk in q.params["blocks"].values() for part in blk.values() if isinstance(part, dict)
                  for k, v in part.items() if k.startswith("lora_")])
  assert loras == 0
  untied = 0 if cfg.tie_embeddings else nbytes(q.params["embedding"])
  assert all(x.tiles is not None for x in quantized)
  rows = nbytes([x.q for x in quantized if not (not cfg.tie_embeddings and x is q.params["embedding"])])
  assert bound.weight_bytes(q.params, cfg) == nbytes(q.params) - untied - rows
  # the float32 model reads its adapters' own params
  assert bound.weight_bytes(adapted.params, cfg) == nbytes(adapted.params) - (
      0 if cfg.tie_embeddings else nbytes(adapted.params["embedding"]))


@pytest.mark.parametrize("decode_dtype", ["int8", pytest.param("w8a8", marks=pytest.mark.slow)])
def test_bench_a2d_counts_the_bytes_of_the_decoding_copy_it_runs(tiny_checkpoints, decode_dtype):
  """`bench a2d`'s bound reads the decoding copy's weights from shapes alone:
  the same bytes as the copy `for_decoding` makes, bfloat16 adapters (where
  they hold the adapters exactly) and 8-bit tiles included."""
  import ml_dtypes
  from mdlm_jax import checkpoints
  from mdlm_jax.bench.a2d import decoding_weight_bytes
  from mdlm_jax.model.spec import for_decoding
  from tests.conftest import adapted_from
  adapted = adapted_from(checkpoints.load(tiny_checkpoints["ar"]), lora_rank=4)
  rng = np.random.default_rng()
  to_bf16 = lambda x: jnp.asarray(np.asarray(rng.normal(size=x.shape), ml_dtypes.bfloat16), jnp.float32)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: to_bf16(x) if "lora_" in jax.tree_util.keystr(path) else x, adapted.params)
  adapted = dataclasses.replace(adapted, params=params)
  copy = for_decoding(adapted, decode_dtype=decode_dtype)
  assert any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(copy.params))  # the adapters were held in bfloat16
  assert decoding_weight_bytes(adapted, decode_dtype) == bound.weight_bytes(copy.params, copy.spec.cfg)


def test_bench_ar_gives_a_steps_bound_at_batch_1_only(tiny_checkpoints):
  from mdlm_jax import checkpoints
  from mdlm_jax.bench import ardecode
  from mdlm_jax.model.spec import for_decoding
  loaded = checkpoints.load(tiny_checkpoints["ar"])
  one = ardecode.ours(loaded, ["def f(x):\n"], 8, 1, "int8", bandwidth=1e10)
  b = one["bound"]
  assert b["pass_s"] == pytest.approx(one["seconds"] / 8)
  assert b["weight_bytes"] == bound.weight_bytes(for_decoding(loaded, decode_dtype="int8").params, loaded.spec.cfg)
  assert b["fraction_of_bound"] == pytest.approx(b["bytes_per_pass"] / 1e10 / b["pass_s"])
  assert "bound" not in ardecode.ours(loaded, ["a", "b"], 8, 1, "int8", bandwidth=1e10)
