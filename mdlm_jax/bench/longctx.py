"""Long-context prefill: time and memory against the prompt's length.

  python -m mdlm_jax.bench longctx [--checkpoint=DIR] [--lengths=1024,...,131072]
      [--time-up-to=32768] [--beside-length=32768 --prefill-chunks=0,512,2048]
      [--json] [--out=F.json] [--png=F.png]

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

Then, in the serving engine: what one --beside-length prompt adds to the
latency of --short-requests short requests decoding beside it, for each
--prefill-chunks setting (0: the prompt in one prefill). The short requests
are submitted first and the long one right after them; each setting runs
the scene once to compile and once timed, and the short requests alone
give the baseline. Reported: their mean latency alone and beside the long
prompt (the difference is what it adds), and the long request's own time
to its first block.
"""

from __future__ import annotations

import argparse
import dataclasses
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
  p.add_argument("--beside-length", type=int, default=32768,
                 help="engine: a prompt this long arrives beside short requests (0: skip)")
  p.add_argument("--prefill-chunks", default="0,512,2048", help="engine prefill_chunk settings (0: off)")
  p.add_argument("--short-requests", type=int, default=3, help="short requests decoding beside it")
  p.add_argument("--short-tokens", type=int, default=64, help="their prompt and generation lengths")
  p.add_argument("--effort", default="medium", help="their decoding effort")
  add_output_flags(p, "bench_longctx.png", "time and memory against length")
  a = p.parse_args(argv)
  a.lengths = positive_ints(p, "--lengths", a.lengths)
  if a.time_up_to < 0 or a.memory_gib <= 0:
    p.error("--time-up-to must be >= 0 and --memory-gib positive")
  try:
    a.prefill_chunks = [int(x) for x in a.prefill_chunks.split(",") if x.strip()]
  except ValueError:
    p.error(f"--prefill-chunks must be comma-separated integers, got {a.prefill_chunks!r}")
  if a.beside_length < 0 or a.short_requests < 1 or a.short_tokens < 1 or any(c < 0 for c in a.prefill_chunks):
    p.error("--beside-length and --prefill-chunks must be >= 0, --short-requests and --short-tokens >= 1")
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


def beside(loaded, chunk: int, a) -> dict:
  """The engine scene: short requests, then one long prompt (see the module doc)."""
  import numpy as np
  from mdlm_jax.engine.engine import Engine, Request
  rng = np.random.default_rng(0)
  tok = loaded.tokenizer
  specials = {tok.bos_id, tok.eos_id, tok.mask_id, tok.pad_id}
  ordinary = np.asarray([i for i in range(tok.vocab_size) if i not in specials], np.int32)
  shorts = [[tok.bos_id] + rng.choice(ordinary, a.short_tokens - 1).tolist() for _ in range(a.short_requests)]
  long = [tok.bos_id] + rng.choice(ordinary, a.beside_length - 1).tolist()
  from mdlm_jax.sampling import presets
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  e = Engine(loaded, num_slots=a.short_requests + 1, max_prompt=a.beside_length,
             max_new_tokens=-(-a.short_tokens // bs) * bs, prefill_chunk=chunk)
  smp = e.sampler_for(a.effort)

  def scene(with_long: bool):
    t0 = time.perf_counter()
    handles = [e.submit(Request(p, a.short_tokens, smp, seed=i)) for i, p in enumerate(shorts)]
    lh = e.submit(Request(long, bs, smp)) if with_long else None
    ends = []
    for h in handles:
      h.result(timeout=3600)
      ends.append(time.perf_counter() - t0)
    long_s = None
    if lh is not None:
      lh.result(timeout=3600)
      long_s = time.perf_counter() - t0
    return float(np.mean(ends)), long_s

  e.start()
  try:
    for with_long in (False, True):  # compile every program the scene runs
      scene(with_long)
    alone, _ = scene(False)
    mean, long_s = scene(True)
  finally:
    e.close(deadline_s=1)
  return {"prefill_chunk": chunk, "long_prompt": a.beside_length, "short_requests": a.short_requests,
          "short_tokens": a.short_tokens, "short_latency_alone_s": alone, "short_latency_beside_s": mean,
          "added_s": mean - alone, "long_first_block_s": long_s, "prefill_chunks_run": e.stats["prefill_chunks"]}


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  scenes = result.get("beside", [])
  fig, axes = plt.subplots(1, 3 if scenes else 2, figsize=(16 if scenes else 11, 4))
  ax_t, ax_m = axes[:2]
  for attention in ATTENTIONS:
    rows = [r for r in result["runs"] if r["attention"] == attention]
    timed = [r for r in rows if r["seconds"] is not None]
    label = {"xla": "chunked (default)", "reference": "reference [L, L]"}[attention]
    ax_t.plot([r["length"] for r in timed], [r["seconds"] for r in timed], "o-", label=label)
    ax_m.plot([r["length"] for r in rows], [r["gib"] for r in rows], "o-", label=label)
  ax_m.axhline(result["memory_gib"], color="gray", ls="--", label=f"{result['memory_gib']:g} GiB")
  for ax, ylabel in ((ax_t, "prefill seconds"), (ax_m, "GiB (XLA's account)")):
    if not ax.lines or not any(len(line.get_xdata()) for line in ax.lines):
      continue  # nothing timed (--time-up-to 0): no scale to set
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(ylabel)
    ax.legend()
  if scenes:
    ax = axes[2]
    labels = [f"chunk {r['prefill_chunk']}" if r["prefill_chunk"] else "one prefill" for r in scenes]
    ax.bar(labels, [r["added_s"] for r in scenes])
    ax.set_ylabel("seconds added to short requests")
    ax.set_title(f"a {scenes[0]['long_prompt']:,}-token prompt beside {scenes[0]['short_requests']} short requests",
                 fontsize=9)
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
  if a.beside_length:
    result["beside"] = []
    for chunk in a.prefill_chunks:
      r = beside(loaded, chunk, a)
      result["beside"].append(r)
      print(f"prefill_chunk={chunk}: short requests {r['short_latency_alone_s']:.2f} s alone, "
            f"{r['short_latency_beside_s']:.2f} s beside a {a.beside_length}-token prompt (+{r['added_s']:.2f} s);"
            f" its first block {r['long_first_block_s']:.2f} s", file=sys.stderr, flush=True)
  finish(result, a, plot)


if __name__ == "__main__":
  main(sys.argv[1:])
