"""Structured outputs: the same prompts decoded free and under their JSON schemas.

  python -m mdlm_jax.bench agent [--checkpoint=DIR] [--json] [--out=F.json] [--png=F.png]

Each task is a prompt and a schema from OpenAI's strict subset (objects with
required keys and additionalProperties false, enums, const, anyOf, $defs and
$ref, arrays, numbers, strings, booleans, null). For each mode, free
("unconstrained") and under the schema with each accept policy of
`sampling.grammar` ("confident": the rule's picks leading from the cursor;
"bridge": the grammatical prefix up to the rule's last pick in it; "valid":
every grammatical proposal), a one-slot engine in this
process decodes the tasks x --seeds one after another (after a warm-up run
that compiles its programs; the fastest of --timed-runs), so every pass of every mode covers one request
and seconds per pass compare. Reported per mode: tokens committed per pass,
tokens/s, seconds per pass (the guide program and the grammar's host work
included), the grammar's host seconds per pass, validity (the `jsonschema`
package is the referee; a constrained output cut by max_tokens is counted
apart, as `finish_reason: "length"`) and the outputs' NLL per token under
the model's own objective (what committing more per pass costs in quality).
Constrained against unconstrained: the share of tokens/s kept (against free
decoding at --max-tokens, and against free decoding cut at each constrained
answer's length, so both spread the same prefills over the same tokens), the
tokens-per-pass ratio (exact under greedy decoding), and the time
a constraint adds to a pass: the guided pass against the plain one (each the
median of --pass-repeats, over one slot, with and without a finished block)
plus the grammar's host time and the guide program, measured in the run, and
averaged over the mode's own passes (the share of them with a finished block).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mdlm_jax.bench.common import add_output_flags, finish, load_checkpoint, save_figure
from mdlm_jax.bench.layouts import valid
from mdlm_jax.sampling.presets import EFFORTS

_NAME = {"type": "string"}
TASKS = [
    ("person", 'import json\n\n# One record of the users table.\nuser = json.loads(\'',
     {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer"}, "admin": {"type": "boolean"}},
      "required": ["name", "age", "admin"], "additionalProperties": False}),
    ("config", "# settings.json for the test runner\nCONFIG = ",
     {"type": "object", "properties": {
         "mode": {"enum": ["fast", "full"]}, "workers": {"type": "integer"}, "verbose": {"type": "boolean"},
         "timeout": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
      "required": ["mode", "workers", "verbose", "timeout"], "additionalProperties": False}),
    ("tool_args", "# Arguments of the call read_file(path, start, end)\nargs = ",
     {"type": "object", "properties": {"path": _NAME, "start": {"type": "integer"}, "end": {"type": "integer"}},
      "required": ["path", "start", "end"], "additionalProperties": False}),
    ("points", "points = ",
     {"type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
      "required": ["points"], "additionalProperties": False,
      "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                          "required": ["x", "y"], "additionalProperties": False}}}),
    ("status", "response = ",
     {"type": "object", "properties": {"ok": {"const": True}, "code": {"enum": [200, 201, 204]},
                                       "error": {"type": "null"}},
      "required": ["ok", "code", "error"], "additionalProperties": False}),
]
MODES = ("unconstrained", "confident", "bridge", "valid")


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench agent")
  p.add_argument("--checkpoint", default=None, help="diffusion checkpoint (default: the packaged model)")
  p.add_argument("--seeds", type=int, default=4, help="requests per task and mode (seeds 0, 1, ...)")
  p.add_argument("--max-tokens", type=int, default=96)
  p.add_argument("--effort", default="medium", choices=EFFORTS)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--layout", default="compact", choices=("model", "compact"),
                 help="the JSON layout the schemas are held to (sampling.grammar.LAYOUTS): compact suits these code"
                 " prompts (json.loads('...'); the server's default for chat is model)")
  p.add_argument("--pass-repeats", type=int, default=100, help="timed passes of each kind (the median counts)")
  p.add_argument("--timed-runs", type=int, default=3,
                 help="timed runs of each mode's requests (the fastest counts: wall time on a shared CPU drifts)")
  add_output_flags(p, "bench_agent.png", "tokens per pass and tokens/s per mode")
  a = p.parse_args(argv)
  if min(a.seeds, a.max_tokens, a.pass_repeats, a.timed_runs) < 1:
    p.error("--seeds, --max-tokens, --pass-repeats and --timed-runs must be positive")
  return a


def run_mode(loaded, mode: str, a, scorer, lengths: list[int] | None = None) -> dict:
  """One one-slot engine, the tasks x seeds in turn (after a warm-up run);
  the mode's totals and per-pass figures. `lengths`: each request's
  max_tokens (default --max-tokens)."""
  from mdlm_jax.engine.engine import Engine, Request
  from mdlm_jax.sampling import presets
  from mdlm_jax.sampling import grammar
  from mdlm_jax.sampling.grammar import Grammar
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  n = len(TASKS) * a.seeds
  engine = Engine(loaded, num_slots=1, max_prompt=64, max_new_tokens=-(-a.max_tokens // bs) * bs,
                  grammar_policy=grammar.ACCEPT_POLICIES[0] if mode == "unconstrained" else mode)
  engine.start()
  sampler = engine.sampler_for(a.effort, temperature=a.temperature, revisable=False)  # both modes decode alike

  def requests():
    caps = iter(lengths or [a.max_tokens] * n)
    return [Request(engine.encode(prompt), max(1, next(caps)), sampler, seed=seed,
                    grammar=None if mode == "unconstrained" else Grammar.json_schema(schema, layout=a.layout))
            for _, prompt, schema in TASKS for seed in range(a.seeds)]

  reqs = requests()
  for h in [engine.submit(r) for r in reqs]:  # compiles every program the timed run uses
    h.result(timeout=1800)
  wall = float("inf")
  for _ in range(a.timed_runs):  # greedy: every run decodes the same tokens; the fastest counts
    engine.stats.clear()
    t0 = time.perf_counter()
    out = [h.result(timeout=1800) for h in [engine.submit(r) for r in reqs]]
    seconds = time.perf_counter() - t0
    if seconds < wall:
      wall, done, stats = seconds, out, dict(engine.stats)
  rows = [list(r.prompt_ids) + engine.tok.encode(d.text) for r, d in zip(reqs, done)]
  nll, scored = scorer(rows, [len(r.prompt_ids) for r in reqs])
  engine.close(deadline_s=5)
  schemas = [schema for _, _, schema in TASKS for _ in range(a.seeds)]
  tokens = sum(d.completion_tokens for d in done)
  stopped = [d for d in done if d.finish_reason == "stop"]
  steps = stats.get("steps", 0)
  guided_steps = stats.get("steps_guided", 0)
  return {
      "requests": n, "completion_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
      "passes": steps, "seconds_per_pass": wall / max(steps, 1),
      "with_head_share": stats.get("steps_with_head", 0) / max(steps, 1),
      "tokens_per_request_pass": tokens / max(sum(d.passes for d in done), 1),
      "grammar_host_s_per_pass": stats.get("grammar_seconds", 0.0) / guided_steps if guided_steps else 0.0,
      "finished_stop": len(stopped), "finished_length": sum(d.finish_reason == "length" for d in done),
      "valid": sum(valid(d.text, s) for d, s in zip(done, schemas)),
      "valid_of_stopped": sum(valid(d.text, s) for d, s in zip(done, schemas) if d.finish_reason == "stop"),
      "nll_per_token": float(nll.sum() / max(scored.sum(), 1)),
      "examples": [d.text for d in done[::a.seeds]][:3],
      "lengths": [d.completion_tokens for d in done],
  }


def pass_times(loaded, a) -> dict:
  """The median plain and guided pass over one slot, with and without a
  finished block, timed in alternation (a shared machine's drift hits both;
  the median, unlike the fastest, is not one lucky pass)."""
  import numpy as np
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.sampling import presets
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  engine = Engine(loaded, num_slots=1, max_prompt=64, max_new_tokens=-(-a.max_tokens // bs) * bs)
  times = {kind: {f"with_head={h}": [] for h in (False, True)} for kind in ("plain", "guided")}
  for _ in range(a.pass_repeats):
    for h in (False, True):
      for kind in times:
        times[kind][f"with_head={h}"].append(engine.pass_seconds(1, h, repeats=1, guided=kind == "guided"))
  return {kind: {h: float(np.median(t)) for h, t in by_head.items()} for kind, by_head in times.items()}


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  path, loaded = load_checkpoint(a.checkpoint, "bench agent")
  result = {"bench": "agent", "checkpoint": path, "tasks": [t[0] for t in TASKS], "seeds": a.seeds,
            "max_tokens": a.max_tokens, "effort": a.effort, "temperature": a.temperature, "layout": a.layout,
            "modes": {}}
  from mdlm_jax.training.evaluation import Scorer
  scorer = Scorer.for_model(loaded)
  result["median_pass_s"] = pass_times(loaded, a)
  print(f"passes: {json.dumps(result['median_pass_s'])}", file=sys.stderr, flush=True)
  for mode in MODES:
    result["modes"][mode] = run_mode(loaded, mode, a, scorer)
    print(f"{mode}: {json.dumps({k: v for k, v in result['modes'][mode].items() if k != 'examples'})}",
          file=sys.stderr, flush=True)
  free = result["modes"]["unconstrained"]
  for mode in MODES[1:]:
    m = result["modes"][mode]
    m["tokens_per_s_vs_unconstrained"] = m["tokens_per_s"] / free["tokens_per_s"]
    # Free decoding cut at each constrained answer's length: the same prefills
    # spread over the same tokens.
    same = run_mode(loaded, "unconstrained", a, scorer, lengths=m["lengths"])
    m["unconstrained_same_length_tokens_per_s"] = same["tokens_per_s"]
    m["tokens_per_s_vs_unconstrained_same_length"] = m["tokens_per_s"] / same["tokens_per_s"]
    # Greedy decoding makes tokens per pass exact; wall time on a shared CPU is not.
    m["tokens_per_pass_vs_unconstrained"] = m["tokens_per_request_pass"] / free["tokens_per_request_pass"]
    # What a constraint adds to a pass: a guided pass for a plain one, and the host's grammar work.
    median = result["median_pass_s"]
    m["pass_time_added"] = {kind: (median["guided"][kind] + m["grammar_host_s_per_pass"]) / plain - 1.0
                            for kind, plain in median["plain"].items()}
    # Over this mode's own passes: a block takes several, one of them with the finished block before it.
    share = m["with_head_share"]
    m["pass_time_added_over_passes"] = (share * m["pass_time_added"]["with_head=True"]
                                        + (1 - share) * m["pass_time_added"]["with_head=False"])
    m["validity_rate"] = m["valid_of_stopped"] / max(m["finished_stop"], 1)
  finish(result, a, plot)


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  modes = list(result["modes"])
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
  for ax, key, label in zip(axes, ("tokens_per_request_pass", "tokens_per_s", "seconds_per_pass"),
                            ("tokens committed per pass", "tokens/s (all requests)", "seconds per pass")):
    ax.bar(modes, [result["modes"][m][key] for m in modes], color=["0.6", "tab:blue", "tab:green", "tab:orange"][:len(modes)])
    ax.set_title(label, fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
  fig.suptitle(f"structured outputs, {result['checkpoint']} ({result['effort']}, T={result['temperature']})",
               fontsize=10)
  fig.tight_layout()
  save_figure(fig, path)
