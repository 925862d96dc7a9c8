"""Model FLOPs per token and the hardware peak they are compared against (MFU)."""

from __future__ import annotations

import json
import os
import tempfile
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


def adapter_train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Per data token of an adapted AR model's step (model.clean_causal, adapters
  trained alone): the frozen clean stream runs forward only; the noisy stream
  forward and backward, where the backward computes activation gradients
  through every layer (one forward's worth) and weight gradients for the
  adapters alone; the vocabulary head on the noisy stream."""
  layers = layers_flops_per_token(cfg, seq_len)
  head = 2 * cfg.embed_dim * cfg.vocab_size
  n_mlp = 3 if cfg.mlp == "swiglu" else 2
  d, hd, m = cfg.embed_dim, cfg.resolved_head_dim, cfg.mlp_dim
  shapes = [(d, cfg.num_heads * hd), (d, cfg.resolved_kv_heads * hd), (d, cfg.resolved_kv_heads * hd),
            (cfg.num_heads * hd, d)] + [(d, m)] * (n_mlp - 1) + [(m, d)]
  adapters = cfg.num_layers * sum(2 * cfg.lora_rank * (i + o) for i, o in shapes)  # forward, noisy tokens
  return layers + (layers + head + adapters) + (layers + head + 2 * adapters)


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
    return cpu_peak_flops() / len(jax.devices())
  return measure_matmul_peak(n=4096, dtype=jnp.bfloat16)


# Where the best CPU peak measured on each machine is kept (`cpu_peak_flops`).
PEAK_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "mdlm_jax", "cpu_peak_flops.json")


def cpu_machine_key() -> str:
  """The CPU model and the cores this process may use: a peak belongs to both."""
  model = ""
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"{model or 'cpu'} x{cores}"


def cpu_peak_flops(measure=measure_matmul_peak, path: str | None = None) -> float:
  """The machine's matmul peak: the higher of a measurement now and the best
  one kept for this machine. A run that starts while other work holds the
  cores measures a fraction of the peak and would report an MFU near 100%;
  the kept best does not drop with it. The store is best effort: an
  unwritable home only loses the memory."""
  path = path or PEAK_CACHE
  key = cpu_machine_key()
  try:
    with open(path) as f:
      kept = json.load(f)
    if not isinstance(kept, dict):
      kept = {}
  except (OSError, ValueError):
    kept = {}
  best = float(kept.get(key, 0.0))
  now = measure()
  if now > best:
    kept[key] = best = now
    _write_atomically(path, kept)
  return best


def _write_atomically(path: str, obj) -> None:
  """`obj` as JSON at `path` through a temporary file and a rename, so that
  concurrent runs each leave a whole file; an OSError leaves nothing."""
  tmp = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=1)
    os.replace(tmp, path)
  except OSError:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
