"""Model FLOPs per token and the hardware peak they are compared against (MFU)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax.model import ModelConfig

# Dense bf16 peaks (FLOP/s) per chip for the accelerators we run on.
KNOWN_PEAKS = {
    "H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6": 918e12,
}


def layers_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Matmul FLOPs of the transformer layers per token in one forward pass,
  the attention scores counted over all seq_len keys (the usual convention:
  a causal mask is not halved)."""
  d, h, hd, m = cfg.embed_dim, cfg.num_heads, cfg.resolved_head_dim, cfg.mlp_dim
  g = cfg.resolved_kv_heads
  n_mlp = 3 if cfg.mlp == "swiglu" else 2
  per_layer = 2 * ((2 * h + 2 * g) * d * hd + n_mlp * d * m) + 2 * 2 * seq_len * h * hd
  return cfg.num_layers * per_layer


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Matmul FLOPs of one forward pass per token (attention scores included)."""
  return layers_flops_per_token(cfg, seq_len) + 2 * cfg.embed_dim * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  return 3.0 * forward_flops_per_token(cfg, seq_len)


def block_diffusion_train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Per data token of a BD3-LM step over [x_t ; x_0]: the layers run on both
  halves, each a sequence of seq_len (its attention counted over seq_len
  keys, as an AR or MDLM step's is, not over the 2 * seq_len the layout
  concatenates: the mask lets no query read more than seq_len), and the
  vocabulary head on the noisy half only."""
  return 3.0 * (2 * layers_flops_per_token(cfg, seq_len) + 2 * cfg.embed_dim * cfg.vocab_size)


def matmul_operands(n: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Two random [n, n] matrices on the first local device only: under a mesh
  (`jax.set_mesh`) new arrays are replicated over all its devices, and every
  device would compute the whole product, halving the rate on 2 CPU devices."""
  rng = np.random.default_rng(0)
  device = jax.local_devices()[0]
  return tuple(jax.device_put(rng.standard_normal((n, n), np.float32).astype(dtype), device) for _ in range(2))


def measure_matmul_peak(n: int = 1024, dtype=jnp.float32, seconds: float = 1.0, windows: int = 5) -> float:
  """Achieved FLOP/s of a large square matmul on the default device: the best
  of `windows` timing windows, so that other work briefly sharing the machine
  lowers the figure less (a low peak would report an MFU above 100%)."""
  a, b = matmul_operands(n, dtype)
  f = jax.jit(lambda a, b: a @ b)
  one_device = jax.sharding.Mesh(np.asarray(list(a.devices())), ("one",))
  best = 0.0
  with jax.set_mesh(one_device):  # inside a caller's mesh, too
    f(a, b).block_until_ready()
    for _ in range(windows):
      reps, start = 0, time.perf_counter()
      while time.perf_counter() - start < seconds / windows or reps < 2:
        f(a, b).block_until_ready()
        reps += 1
      best = max(best, 2.0 * n ** 3 * reps / (time.perf_counter() - start))
  return best


def device_peak_flops(measure_if_unknown: bool = True) -> float:
  """Per-device peak: the spec sheet for known accelerators, else measured."""
  kind = jax.devices()[0].device_kind
  for name, peak in KNOWN_PEAKS.items():
    if name.lower() in kind.lower():
      return peak
  if not measure_if_unknown:
    return float("nan")
  if jax.default_backend() == "cpu":
    # All CPU "devices" share the same cores: the peak is the machine's.
    return measure_matmul_peak() / len(jax.devices())
  return measure_matmul_peak(n=4096, dtype=jnp.bfloat16)
