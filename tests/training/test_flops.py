"""Model FLOPs per token (MFU's numerator) against a count from the weights'
shapes: every matmul weight of the layers costs 2 FLOPs per weight per token,
the scores and the value mix 2 * 2 * keys * head_dim per head, the
vocabulary head 2 * d * V."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from mdlm_jax.model.spec import model_spec
from mdlm_jax.model.transformer import ModelConfig
from mdlm_jax.training import flops


def _layer_matmul_weights(cfg: ModelConfig) -> int:
  leaves = jax.tree_util.tree_flatten_with_path(model_spec(cfg, None).abstract)[0]
  return sum(int(np.prod(x.shape)) for path, x in leaves
             if "blocks" in jax.tree_util.keystr(path) and len(x.shape) >= 2)


@pytest.mark.parametrize("kw", [dict(num_kv_heads=2), dict(mlp="gelu", num_layers=3)])
def test_flops_match_a_count_from_the_weights(kw):
  rng = np.random.default_rng()
  cfg = ModelConfig(**{**dict(vocab_size=int(rng.integers(30, 90)), num_layers=2, embed_dim=32, num_heads=4,
                              mlp_dim=int(rng.integers(1, 5)) * 16), **kw})
  seq_len = int(rng.integers(8, 64))
  attention = cfg.num_layers * cfg.num_heads * 2 * 2 * seq_len * cfg.resolved_head_dim
  layers = 2 * _layer_matmul_weights(cfg) + attention
  head = 2 * cfg.embed_dim * cfg.vocab_size
  assert flops.layers_flops_per_token(cfg, seq_len) == layers
  assert flops.train_flops_per_token(cfg, seq_len) == 3 * (layers + head)
  # BD3: the layers over both halves, each attending over one sequence's
  # length; the head on the noisy half only.
  assert flops.block_diffusion_train_flops_per_token(cfg, seq_len) == 3 * (2 * layers + head)


def test_adapter_training_flops_count_the_frozen_base_once_forward():
  """A2D with adapters alone: clean stream forward, noisy stream forward and backward
  with activation gradients only, adapter weights counted from the model's own shapes."""
  rng = np.random.default_rng()
  cfg = ModelConfig(vocab_size=int(rng.integers(30, 90)), num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2,
                    mlp_dim=48, lora_rank=int(rng.integers(1, 8)), clean_causal=True, shift_logits=True)
  seq_len = int(rng.integers(8, 64))
  leaves = jax.tree_util.tree_flatten_with_path(model_spec(cfg, None).abstract)[0]
  adapter_weights = sum(int(np.prod(x.shape)) for path, x in leaves if "lora_" in jax.tree_util.keystr(path))
  base = dataclasses.replace(cfg, lora_rank=0)
  layers = 2 * _layer_matmul_weights(base) + cfg.num_layers * cfg.num_heads * 4 * seq_len * cfg.resolved_head_dim
  head, adapters = 2 * cfg.embed_dim * cfg.vocab_size, 2 * adapter_weights
  assert flops.adapter_train_flops_per_token(cfg, seq_len) == layers + (layers + head + adapters) + (
      layers + head + 2 * adapters)


def test_cpu_peak_keeps_the_best_measurement_per_machine(tmp_path):
  """A measurement taken while other work holds the cores must not lower the
  peak MFU is reported against; a better one raises it, and the file it is
  kept in stays valid JSON keyed by machine."""
  path = str(tmp_path / "sub" / "peak.json")
  rng = np.random.default_rng()
  high = float(rng.uniform(1e11, 3e11))
  low = high * float(rng.uniform(0.2, 0.6))
  assert flops.cpu_peak_flops(lambda: low, path) == low
  assert flops.cpu_peak_flops(lambda: high, path) == high
  assert flops.cpu_peak_flops(lambda: low, path) == high  # contended: the kept best stands
  with open(path) as f:
    kept = json.load(f)
  assert kept == {flops.cpu_machine_key(): high}
  assert not [p for p in os.listdir(tmp_path / "sub") if p.endswith(".tmp")]


def test_cpu_peak_survives_a_corrupt_or_unwritable_store(tmp_path):
  bad = tmp_path / "peak.json"
  bad.write_text("{not json")
  assert flops.cpu_peak_flops(lambda: 5e10, str(bad)) == 5e10
  assert json.loads(bad.read_text()) == {flops.cpu_machine_key(): 5e10}
  blocked = tmp_path / "file"
  blocked.write_text("")
  # A path under a regular file cannot be created: the measurement is still returned.
  assert flops.cpu_peak_flops(lambda: 7e10, str(blocked / "peak.json")) == 7e10
