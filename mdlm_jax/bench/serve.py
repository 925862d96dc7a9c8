"""Serving under bounded load: the HTTP server against the engine in-process.

  python -m mdlm_jax.bench serve [--checkpoint=DIR] [--json] [--out=F.json] [--png=F.png]

Starts the real server on 127.0.0.1 (uvicorn in this process, engine with
--slots slots), then for each concurrency level runs that many clients, each
sending --requests-per-client non-streaming completions in turn (prompts from
held-out validation code). Reports p50/p95 latency and total tokens/s per
level, the HTTP overhead at concurrency 1 against calling the engine directly,
and the throughput gained by batching (highest level against 1). Then
--fim-requests fill-in-the-middle requests (prefix and suffix cut from the
same held-out code), one after another and then all at once, --fim-rounds
times: infilling runs in the slots and requests waiting together share
prefills (--admit-batch), so the concurrent batch should take a fraction of
the time (`fim.concurrent_over_sequential`, medians). Before the
load, it times single passes over 1 slot and over all of them against the
machine's matmul peak: where one slot's pass already computes near the peak,
batching cannot multiply throughput (`pass_compute.batching_gain_bound`).

The overhead comes from --overhead-pairs pairs, each the same request sent to
the engine and then over HTTP, back to back: pairing cancels the drift of a
shared machine's speed, which otherwise swamps a difference of milliseconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import threading
import time

from mdlm_jax.bench.common import add_output_flags, finish, free_port, positive_ints, save_figure
from mdlm_jax.sampling.presets import EFFORTS
from mdlm_jax.model.layers import WEIGHT_LAYOUTS


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench serve")
  p.add_argument("--checkpoint", default=None, help="diffusion checkpoint (default: the packaged model)")
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--concurrency", default="1,4,16")
  p.add_argument("--requests-per-client", type=int, default=3)
  p.add_argument("--overhead-pairs", type=int, default=8,
                 help="engine-then-HTTP pairs of one request each, for the HTTP overhead at 1 client")
  p.add_argument("--max-tokens", type=int, default=128)
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--effort", default="medium", choices=EFFORTS)
  p.add_argument("--fim-requests", type=int, default=6, help="FIM requests timed in turn and at once")
  p.add_argument("--fim-rounds", type=int, default=5, help="rounds of both (medians reported)")
  p.add_argument("--weight-layout", choices=WEIGHT_LAYOUTS, default=None,
                 help="one weight layout for the engine (default: as the server picks them)")
  p.add_argument("--admit-batch", type=int, default=4, help="the most waiting requests that share one prefill")
  p.add_argument("--admit-wait-ms", type=float, default=20.0,
                 help="how long an idle engine waits for requests still being read (as serve --admit-wait-ms)")
  add_output_flags(p, "bench_serve.png", "latency/throughput plot")
  a = p.parse_args(argv)
  a.concurrency = positive_ints(p, "--concurrency", a.concurrency)
  if a.admit_wait_ms < 0:
    p.error(f"--admit-wait-ms must be >= 0, got {a.admit_wait_ms}")
  if min(a.requests_per_client, a.slots, a.overhead_pairs, a.fim_requests, a.fim_rounds, a.admit_batch) < 1:
    p.error("--requests-per-client, --overhead-pairs, --fim-requests, --fim-rounds, --slots and --admit-batch"
            " must be positive")
  return a


def _summary(latencies, tokens, wall):
  import numpy as np
  return {"requests": len(latencies), "p50_latency_s": float(np.percentile(latencies, 50)),
          "p95_latency_s": float(np.percentile(latencies, 95)), "mean_latency_s": float(np.mean(latencies)),
          "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def main(argv):
  a = parse(argv)
  import numpy as np
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  import httpx
  import uvicorn
  from mdlm_jax import cli
  from mdlm_jax.checkpoints import packaged
  from mdlm_jax import checkpoints
  from mdlm_jax.bench.sample import validation_prompts
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.engine.engine import Request as EngineRequest
  from mdlm_jax.sampling import presets
  from mdlm_jax.server.app import create_app
  from mdlm_jax.server.protocol import Limits
  try:
    path = a.checkpoint or packaged.path()
    loaded = checkpoints.load(path)
    prompts = validation_prompts(loaded, 8, a.prompt_tokens)
  except cli.USER_ERRORS as e:
    cli.fail("bench serve", e)
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  max_new = -(-a.max_tokens // bs) * bs
  engine = Engine(loaded, num_slots=a.slots, max_prompt=2 * a.prompt_tokens + 16, max_new_tokens=max_new,
                  max_queue=max(4 * max(a.concurrency) * a.requests_per_client, 2 * a.fim_requests),
                  weight_layout=a.weight_layout, admit_batch=a.admit_batch,
                  admit_wait_s=a.admit_wait_ms / 1000).warmup()
  result_compute = pass_compute(engine, a.slots)
  engine.start()
  app = create_app(engine, model_id="bench",
                   limits=Limits(max_tokens=max_new, max_prompt_tokens=2 * a.prompt_tokens + 16))
  port = free_port()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  base = f"http://127.0.0.1:{port}"
  while not server.started:
    time.sleep(0.05)
  sampler = engine.sampler_for(a.effort, temperature=0.0)

  def engine_call(i):
    ids = engine.encode(prompts[i % len(prompts)])
    t0 = time.perf_counter()
    done = engine.submit(EngineRequest(ids, a.max_tokens, sampler, seed=i)).result(timeout=600)
    return time.perf_counter() - t0, done.completion_tokens

  http = httpx.Client(timeout=600)

  def http_call(i):
    body = {"model": "bench", "prompt": prompts[i % len(prompts)], "max_tokens": a.max_tokens, "seed": i,
            "reasoning_effort": a.effort, "temperature": 0}
    t0 = time.perf_counter()
    r = http.post(base + "/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]

  # Compile every program (prefill buckets, the step) before timing.
  for i in range(2):
    engine_call(i)
    http_call(i)
  result = {"bench": "serve", "checkpoint": path, "slots": a.slots, "max_tokens": a.max_tokens,
            "effort": a.effort, "weight_layouts": engine.weight_layouts,
            "pass_compute": result_compute, "levels": {}}
  pairs = [(engine_call(i), http_call(i)) for i in range(a.overhead_pairs)]
  direct, served = [p[0] for p in pairs], [p[1] for p in pairs]
  result["engine_in_process_c1"] = _summary([r[0] for r in direct], sum(r[1] for r in direct),
                                            sum(r[0] for r in direct))
  result["http_paired_c1"] = _summary([r[0] for r in served], sum(r[1] for r in served), sum(r[0] for r in served))
  if any(d[1] != h[1] for d, h in pairs):
    raise RuntimeError("the engine and the server gave different token counts for the same request")
  result["http_overhead_c1"] = sum(h[0] for h in served) / sum(d[0] for d in direct) - 1.0
  result["http_overhead_c1_median"] = float(np.median([h[0] / d[0] - 1.0 for d, h in zip(direct, served)]))
  print(f"engine in-process, 1 client: {json.dumps(result['engine_in_process_c1'])}", file=sys.stderr, flush=True)
  print(f"http paired with it: {json.dumps(result['http_paired_c1'])}; overhead {result['http_overhead_c1']:.1%}"
        f" (median pair {result['http_overhead_c1_median']:.1%})", file=sys.stderr, flush=True)
  for c in a.concurrency:
    jobs = c * a.requests_per_client

    def client(k, c=c):
      return [http_call(k * 1000 + j) for j in range(a.requests_per_client)]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(c) as pool:
      runs = [r for rs in pool.map(client, range(c)) for r in rs]
    result["levels"][str(c)] = _summary([r[0] for r in runs], sum(r[1] for r in runs), time.perf_counter() - t0)
    assert len(runs) == jobs
    print(f"http, {c} clients: {json.dumps(result['levels'][str(c)])}", file=sys.stderr, flush=True)
  levels = result["levels"]
  if "1" in levels:
    top = str(max(a.concurrency))
    result["throughput_gain"] = levels[top]["tokens_per_s"] / levels["1"]["tokens_per_s"]
  result["fim"] = fim_timing(http, base, prompts, a, engine)
  print(f"fim: {json.dumps(result['fim'])}", file=sys.stderr, flush=True)
  server.should_exit = True
  thread.join(timeout=30)
  engine.close(deadline_s=5)
  finish(result, a, plot)


def fim_timing(http, base: str, prompts, a, engine) -> dict:
  """Seconds for a.fim_requests FIM requests in turn and all at once, the
  median of a.fim_rounds alternating rounds (one round moves by 20% on a
  shared 2-core machine), and how many prefills the concurrent requests took."""
  import numpy as np

  def call(i):
    text = prompts[i % len(prompts)]
    cut = len(text) // 2
    body = {"model": "bench", "prompt": text[:cut], "suffix": text[cut:], "max_tokens": 32, "seed": i,
            "reasoning_effort": a.effort, "temperature": 0}
    r = http.post(base + "/v1/fim/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]

  call(0)  # the prefill bucket of prefix + suffix compiles here
  sequential, concurrent_s, prefills = [], [], 0
  for _ in range(a.fim_rounds):
    t0 = time.perf_counter()
    for i in range(a.fim_requests):
      call(i)
    sequential.append(time.perf_counter() - t0)
    before = engine.stats["prefills"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(a.fim_requests) as pool:
      list(pool.map(call, range(a.fim_requests)))
    concurrent_s.append(time.perf_counter() - t0)
    prefills += engine.stats["prefills"] - before
  seq, conc = float(np.median(sequential)), float(np.median(concurrent_s))
  return {"requests": a.fim_requests, "rounds": a.fim_rounds, "sequential_s": seq, "concurrent_s": conc,
          "concurrent_over_sequential": conc / seq, "ratio_per_round": [c / s for c, s in zip(concurrent_s, sequential)],
          "concurrent_prefills_per_request": prefills / (a.fim_rounds * a.fim_requests)}


def pass_compute(engine, slots: int) -> dict:
  """How fast one pass over 1 slot and over `slots` slots computes, against
  the machine's matmul peak. Where a 1-slot pass already runs near the peak
  (compute-bound, as on a small CPU), batching cannot gain much: the bound is
  the gain if the full pass ran at the peak while the 1-slot pass stays as is."""
  from mdlm_jax.training import flops
  out = {"passes": {}}
  for n in sorted({1, slots}):
    for with_head in (True, False):
      seconds, work = engine.pass_seconds(n, with_head), engine.pass_flops(n, with_head)
      out["passes"][f"{n}_slots_{'with' if with_head else 'without'}_finished_blocks"] = {
          "slots": n, "with_finished_blocks": with_head, "ms": seconds * 1e3, "gflop": work / 1e9,
          "gflop_per_s": work / seconds / 1e9}
  peak = flops.measure_matmul_peak()
  out["matmul_peak_gflop_per_s"] = peak / 1e9
  # Passes with and without finished blocks alternate: weigh them equally.
  rows = lambda n: [p for p in out["passes"].values() if p["slots"] == n]  # noqa: E731
  one = sum(p["ms"] for p in rows(1)) / 2
  full_at_peak = sum(p["gflop"] for p in rows(slots)) / 2 / out["matmul_peak_gflop_per_s"] * 1e3
  out["batching_gain_bound"] = slots * one / full_at_peak
  for name, p in out["passes"].items():
    print(f"pass, {name.replace('_', ' ')}: {p['ms']:.2f} ms, {p['gflop_per_s']:.0f} GFLOP/s", file=sys.stderr)
  print(f"matmul peak {out['matmul_peak_gflop_per_s']:.0f} GFLOP/s: {slots} slots can gain at most"
        f" {out['batching_gain_bound']:.2f}x over 1", file=sys.stderr, flush=True)
  return out


def plot(result: dict, path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  levels = sorted(result["levels"], key=int)
  xs = [int(c) for c in levels]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
  ax1.plot(xs, [result["levels"][c]["tokens_per_s"] for c in levels], "o-")
  ax1.set_xlabel("concurrent clients")
  ax1.set_ylabel("total tokens / s")
  ax1.set_xscale("log", base=2)
  ax2.plot(xs, [result["levels"][c]["p50_latency_s"] for c in levels], "o-", label="p50")
  ax2.plot(xs, [result["levels"][c]["p95_latency_s"] for c in levels], "s--", label="p95")
  ax2.set_xlabel("concurrent clients")
  ax2.set_ylabel("latency (s)")
  ax2.set_xscale("log", base=2)
  ax2.legend()
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
  fig.suptitle(f"serving {result['checkpoint'].rstrip('/').split('/')[-1]}: {result['slots']} slots,"
               f" {result['max_tokens']} tokens, effort {result['effort']}")
  fig.tight_layout()
  save_figure(fig, path)


if __name__ == "__main__":
  main(sys.argv[1:])
