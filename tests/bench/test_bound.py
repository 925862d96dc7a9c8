"""bench.bound: the bytes a decoding pass reads, against a count by hand."""

import jax
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
