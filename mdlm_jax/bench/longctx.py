"""Long-context prefill: time and memory against the prompt's length.

  python -m mdlm_jax.bench longctx [--checkpoint=DIR] [--lengths=1024,...,131072]
      [--time-up-to=32768] [--json] [--out=F.json] [--png=F.png]

For each length L, the model encodes an L-token prompt into a fresh KV cache
of L slots, as the serving engine's prefill does (`Transformer.forward_cached`
with commit; the prompt's tokens read one another bidirectionally), once with
the attention the model runs by default ("xla": the chunked online softmax
from 256 queries) and once with the materialised reference ("reference").
Memory is XLA's own account of the compiled program (arguments, outputs and
temporaries, `memory_analysis`), so lengths past this machine's memory are
reported without running them; a program needing more than --memory-gib is
marked as not fitting. Time is one run after compiling, for lengths up to
--time-up-to that fit. Reported per length: seconds, GiB, and bytes per
context token (flat when memory is linear in the length).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from mdlm_jax.bench.common import add_output_flags, finish, load_checkpoint, positive_ints, save_figure

DEFAULT_LENGTHS = "1024,2048,4096,8192,16384,32768,65536,131072"
ATTENTIONS = ("xla", "reference")


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench longctx")
  p.add_argument("--checkpoint", default=None, help="diffusion checkpoint (default: the packaged model)")
  p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens")
  p.add_argument("--time-up-to", type=int, default=32768, help="time prefills up to this length (0: none)")
  p.add_argument("--memory-gib", type=float, default=24.0, help="what fits: this machine's memory")
  add_output_flags(p, "bench_longctx.png", "time and memory against length")
  a = p.parse_args(argv)
  a.lengths = positive_ints(p, "--lengths", a.lengths)
  if a.time_up_to < 0 or a.memory_gib <= 0:
    p.error("--time-up-to must be >= 0 and --memory-gib positive")
  return a


def prefill_program(loaded, attention: str, length: int):
  """(jitted prefill, its arguments) for an `length`-token prompt."""
  import jax
  import jax.numpy as jnp
  from mdlm_jax.model.kv_cache import KVCache
  from mdlm_jax.model.spec import bind, model_spec
  cfg = dataclasses.replace(loaded.spec.cfg, attention=attention)
  spec = model_spec(cfg, None)

  def prefill(params, tokens):
    model = bind(spec, params)
    cache = KVCache.init(cfg, 1, length, per_row=True)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    t = jnp.zeros((1,), jnp.float32) if cfg.time_conditioning else None
    _, cache = model.forward_cached(tokens, positions, cache, commit=True, t=t, commit_len=jnp.full((1,), length))
    return cache

  tokens = jnp.full((1, length), loaded.tokenizer.eos_id, jnp.int32)
  return jax.jit(prefill), (loaded.params, tokens)


def measure(loaded, attention: str, length: int, a) -> dict:
  import jax
  fn, args = prefill_program(loaded, attention, length)
  compiled = fn.lower(*args).compile()
  m = compiled.memory_analysis()
  total = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
              - getattr(m, "alias_size_in_bytes", 0))
  out = {"attention": attention, "length": length, "gib": total / 2**30, "temp_gib": m.temp_size_in_bytes / 2**30,
         "bytes_per_token": total / length, "fits": total <= a.memory_gib * 2**30, "seconds": None}
  if out["fits"] and length <= a.time_up_to:
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    out["seconds"] = time.perf_counter() - t0
  return out


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
  for attention in ATTENTIONS:
    rows = [r for r in result["runs"] if r["attention"] == attention]
    timed = [r for r in rows if r["seconds"] is not None]
    label = {"xla": "chunked (default)", "reference": "reference [L, L]"}[attention]
    ax_t.plot([r["length"] for r in timed], [r["seconds"] for r in timed], "o-", label=label)
    ax_m.plot([r["length"] for r in rows], [r["gib"] for r in rows], "o-", label=label)
  ax_m.axhline(result["memory_gib"], color="gray", ls="--", label=f"{result['memory_gib']:g} GiB")
  for ax, ylabel in ((ax_t, "prefill seconds"), (ax_m, "GiB (XLA's account)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(ylabel)
    ax.legend()
  fig.suptitle(f"prefill against length: {result['checkpoint']}")
  fig.tight_layout()
  save_figure(fig, path)


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  from mdlm_jax.model.kv_cache import KVCache
  path, loaded = load_checkpoint(a.checkpoint, "bench longctx")
  cfg = loaded.spec.cfg
  result = {"bench": "longctx", "checkpoint": path, "memory_gib": a.memory_gib,
            "model": {"layers": cfg.num_layers, "embed_dim": cfg.embed_dim, "heads": cfg.num_heads,
                      "kv_heads": cfg.resolved_kv_heads, "head_dim": cfg.resolved_head_dim},
            "kv_cache_bytes_per_token": KVCache.bytes_per_token(cfg),
            "runs": []}
  for length in a.lengths:
    for attention in ATTENTIONS:
      r = measure(loaded, attention, length, a)
      result["runs"].append(r)
      secs = "not timed" if r["seconds"] is None else f"{r['seconds']:.2f} s"
      print(f"{attention:>9} L={length:>6}: {r['gib']:8.2f} GiB ({r['bytes_per_token'] / 1024:.1f} KiB/token), "
            f"{'fits' if r['fits'] else 'does not fit'}, {secs}", file=sys.stderr, flush=True)
  finish(result, a, plot)


if __name__ == "__main__":
  main(sys.argv[1:])
