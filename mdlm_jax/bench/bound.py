"""The memory-bandwidth bound of a decoding pass: at batch 1 a pass reads
every weight once and the KV cache it attends to, and does little
arithmetic per byte, so the fastest it can go is those bytes over the
machine's memory bandwidth. The bandwidth is measured in the same run (a
large array read once), so a pass's fraction of the bound says
how much of the time is the memory's and how much is left to take."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax.model.kv_cache import KVCache


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
  """Bytes per second of reading a `mib`-MiB float32 array once (its sum),
  the fastest of `repeats` after a warm-up: what a pass does with its
  weights. The array is far larger than any cache, as a model's weights are.
  (A copy measures less than half of it here: every call writes a fresh
  output buffer, and the first touch of each of its pages costs a fault.)"""
  x = jnp.ones((mib * (1 << 20) // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  jax.block_until_ready(total(x))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(total(x))
    best = min(best, time.perf_counter() - t0)
  return x.nbytes / best


def weight_bytes(params, cfg) -> int:
  """Bytes of weights one pass reads: every array of the model, but an
  untied token embedding, of which a pass gathers only its tokens' rows
  (a tied one is the output head too, read whole), and of an int8 weight
  the layout its product reads (the kernel's tiles where it has them, not
  also `q`; its joined adapters, where it carries them). An array several
  leaves share (a stack of every layer's, `model.stacked`) counts once."""
  from mdlm_jax import kernels
  is_q = lambda x: isinstance(x, kernels.QuantizedWeight)  # noqa: E731
  nbytes = lambda x: int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize  # noqa: E731
  read = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]:
    name = jax.tree_util.keystr(path)
    if not cfg.tie_embeddings and "embedding" in name:
      continue
    arrays = ([leaf.q if leaf.tiles is None else leaf.tiles, leaf.scale, *jax.tree.leaves(leaf.adapters)]
              if is_q(leaf) else [leaf])
    read.update((id(x), x) for x in arrays)
  return sum(nbytes(x) for x in read.values())


def pass_bound(pass_s: float, weights: int, cache_tokens: float, cfg, bandwidth: float) -> dict:
  """A pass's bytes (weights and the keys and values of `cache_tokens`
  cached tokens, the mean a pass attends to), the time those bytes take at
  `bandwidth`, and the fraction of that bound the measured pass reaches."""
  read = weights + cache_tokens * KVCache.bytes_per_token(cfg)
  bound_s = read / bandwidth
  return {"bytes_per_pass": int(read), "weight_bytes": int(weights), "pass_s": pass_s, "bound_s": bound_s,
          "fraction_of_bound": bound_s / pass_s if pass_s > 0 else float("nan")}
