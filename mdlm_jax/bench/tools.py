"""Chat answers with tools offered against the same chat without them, through the server.

  python -m mdlm_jax.bench tools [--checkpoint=DIR] [--max-tokens=96] [--json] [--out=F.json] [--png=F.png]

Agents offer tools with every request (tool_choice auto). An answer is then
free text until the model opens a call, and the calls are decoded under
their grammar from there (`server/lazy_calls.py`); an answer that calls
nothing should cost what the same chat without tools costs. A server in this
process (one slot, warmed up, the decoding weights "auto" picks) answers each
prompt with the tools and without them in turn, greedy, after an untimed
round. Reported per side: completion tokens, passes (`usage.forward_passes`),
tokens a pass, tokens/s (each answer timed alone, prefills included), the
answers that called a tool, and finish reasons.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

from mdlm_jax.bench.common import add_output_flags, finish, free_port, load_checkpoint, save_figure
from mdlm_jax.sampling.presets import EFFORTS

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]
PROMPTS = [
    "What is the weather in Paris?",
    "Search the web for the latest Python release.",
    "Write a Python function that reverses a list.",
    "What is the capital of France?",
    "Explain what a hash map is.",
    "Write a haiku about the sea.",
    "Call get_weather for Berlin.",
    "How do I read a file line by line in Python?",
]
SIDES = ("tools", "no_tools")


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench tools")
  p.add_argument("--checkpoint", default=None, help="diffusion checkpoint (default: the packaged model)")
  p.add_argument("--max-tokens", type=int, default=96)
  p.add_argument("--effort", default="medium", choices=EFFORTS)
  p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
  add_output_flags(p, "bench_tools.png", "tokens/s and tokens a pass with and without tools")
  a = p.parse_args(argv)
  if a.max_tokens < 1 or (a.limit is not None and a.limit < 1):
    p.error("--max-tokens and --limit must be positive")
  return a


def summarize(rows: list[dict]) -> dict:
  """One side's totals from its answers ({tokens, passes, seconds, calls, finish})."""
  tokens, passes, seconds = (sum(r[k] for r in rows) for k in ("tokens", "passes", "seconds"))
  return {"answers": len(rows), "completion_tokens": tokens, "passes": passes,
          "tokens_per_pass": tokens / max(passes, 1), "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
          "answers_with_calls": sum(r["calls"] > 0 for r in rows),
          "finish_reasons": dict(collections.Counter(r["finish"] for r in rows))}


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  import httpx
  import uvicorn
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.sampling import presets
  from mdlm_jax.server.app import create_app
  from mdlm_jax.server.protocol import Limits
  path, loaded = load_checkpoint(a.checkpoint, "bench tools")
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  max_new = -(-a.max_tokens // bs) * bs
  engine = Engine(loaded, num_slots=1, max_prompt=1024, max_new_tokens=max_new, decode_dtype="auto").warmup().start()
  app = create_app(engine, model_id="bench", limits=Limits(max_tokens=max_new, max_prompt_tokens=1024))
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
  threading.Thread(target=server.run, daemon=True).start()
  while not server.started:
    time.sleep(0.05)
  base = f"http://127.0.0.1:{server.config.port}/v1/chat/completions"
  http = httpx.Client(timeout=1800)
  prompts = PROMPTS[:a.limit]

  def answer(prompt: str, side: str) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": a.max_tokens,
            "temperature": 0, "reasoning_effort": a.effort, **({"tools": TOOLS} if side == "tools" else {})}
    t0 = time.perf_counter()
    r = http.post(base, json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    return {"tokens": out["usage"]["completion_tokens"], "passes": out["usage"]["forward_passes"],
            "seconds": seconds, "calls": len(choice["message"].get("tool_calls") or []),
            "finish": choice["finish_reason"]}

  try:
    for prompt in prompts:  # compiles every prefill and pass the timed round uses
      for side in SIDES:
        answer(prompt, side)
    rows = {side: [] for side in SIDES}
    for i, prompt in enumerate(prompts):
      for side in (SIDES if i % 2 == 0 else SIDES[::-1]):  # neither side always first
        rows[side].append(answer(prompt, side))
  finally:
    server.should_exit = True
    engine.close(deadline_s=5)
  result = {"bench": "tools", "checkpoint": path, "decode_dtype": engine.decode_dtype, "prompts": len(prompts),
            "max_tokens": a.max_tokens, "effort": a.effort, "sides": {s: summarize(r) for s, r in rows.items()}}
  t, n = result["sides"]["tools"], result["sides"]["no_tools"]
  result["tokens_per_s_with_tools_vs_without"] = t["tokens_per_s"] / n["tokens_per_s"]
  result["tokens_per_pass_with_tools_vs_without"] = t["tokens_per_pass"] / n["tokens_per_pass"]
  finish(result, a, plot)


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sides = list(result["sides"])
  fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
  for ax, key, label in zip(axes, ("tokens_per_s", "tokens_per_pass"), ("tokens/s", "tokens a pass")):
    ax.bar(sides, [result["sides"][s][key] for s in sides], color=["tab:blue", "0.6"])
    ax.set_title(label, fontsize=10)
  fig.suptitle(f"chat answers with and without tools offered ({result['decode_dtype']}, {result['effort']})",
               fontsize=10)
  fig.tight_layout()
  save_figure(fig, path)
