"""Structured outputs through the chat template, under each JSON layout.

  python -m mdlm_jax.bench layouts [--checkpoint=DIR] [--layouts=model,compact] [--json] [--png=F.png]

A chat model writes JSON in its own layout ("{\\n    \\"name\\": ...").
Held to another (`sampling.grammar.LAYOUTS`: "compact" is `json.dumps`'),
every token it would spend on whitespace is forbidden and it must pick among
what is left, which can derail it. Each task is a user message with
response_format json_object (any object) or json_schema (a schema with
required keys); a one-slot engine in this process answers every task under
each layout, greedy, after a warm-up run that compiles its programs.
Reported per layout: answers that parse (json_object) or validate
(json_schema; the `jsonschema` package is the referee), those of them whose
every key is a name (a letter, then letters, digits, "_", "-" or spaces:
`{",": 1}` parses but says nothing), answers that finished (`stop`) and
were cut by max_tokens (`length`), tokens, passes, tokens a pass, seconds,
and each task's answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from mdlm_jax.bench.common import add_output_flags, finish, load_checkpoint, save_figure
from mdlm_jax.sampling.presets import EFFORTS


def _object(props: dict) -> dict:
  return {"type": "object", "properties": props, "required": list(props)}


_S, _I = {"type": "string"}, {"type": "integer"}
# (name, user message, schema; None: json_object, any object)
TASKS = [
    ("person", "Give me a person with a name and an age, as JSON.", None),
    ("book", "Return a JSON object describing a book with a title and an author.", None),
    ("city", "Describe the city of Paris as a JSON object with its country and population.", None),
    ("fruits", "List three fruits as JSON.", None),
    ("account", "Create a JSON object for a user account with a username, an email and a list of roles.", None),
    ("extract", "Extract the name and the year from: 'Python was created by Guido van Rossum in 1991.' Answer in JSON.",
     None),
    ("server", "Write a JSON config for a web server with a host, a port and a debug flag.", None),
    ("abc", "Give a JSON object with the keys a, b and c set to 1, 2 and 3.", None),
    ("person_schema", "Give me a person with a name and an age.", _object({"name": _S, "age": _I})),
    ("book_schema", "Describe a book.", _object({"title": _S, "author": _S, "year": _I})),
    ("city_schema", "Describe the city of Paris.", _object({"country": _S, "population": _I})),
    ("fruits_schema", "List three fruits.", _object({"fruits": {"type": "array", "items": _S}})),
    ("account_schema", "Create a user account.",
     _object({"username": _S, "email": _S, "roles": {"type": "array", "items": _S}})),
    ("extract_schema", "Extract the name and the year from: 'Python was created by Guido van Rossum in 1991.'",
     _object({"name": _S, "year": _I})),
    ("server_schema", "Write a config for a web server.", _object({"host": _S, "port": _I, "debug": {"type": "boolean"}})),
    ("prime_schema", "Is 7 a prime number? Answer with a reason.", _object({"answer": {"type": "boolean"}, "reason": _S})),
]


def parse(argv):
  from mdlm_jax.sampling.grammar import LAYOUTS
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench layouts")
  p.add_argument("--checkpoint", default=None, help="diffusion checkpoint (default: the packaged model)")
  p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
  p.add_argument("--max-tokens", type=int, default=96)
  p.add_argument("--effort", default="medium", choices=EFFORTS)
  p.add_argument("--limit", type=int, default=None, help="the first N tasks only")
  from mdlm_jax.model.transformer import DECODE_DTYPE_CHOICES
  p.add_argument("--decode-dtype", choices=DECODE_DTYPE_CHOICES, default="auto",
                 help="the decoding weights (auto: as the server picks, model.spec.resolve_decode_dtype)")
  add_output_flags(p, "bench_layouts.png", "valid and finished answers per layout")
  a = p.parse_args(argv)
  a.layouts = [x for x in a.layouts.split(",") if x]
  unknown = [x for x in a.layouts if x not in LAYOUTS]
  if unknown or not a.layouts:
    p.error(f"--layouts must name some of {', '.join(LAYOUTS)}, got {unknown or a.layouts}")
  if a.max_tokens < 1 or (a.limit is not None and a.limit < 1):
    p.error("--max-tokens and --limit must be positive")
  return a


def valid(text: str, schema: dict | None) -> bool:
  """Whether `text` is a JSON object (schema None) or validates under `schema`."""
  import jsonschema
  try:
    value = json.loads(text)
    if schema is None:
      return isinstance(value, dict)
    jsonschema.validate(value, schema)
  except (ValueError, jsonschema.ValidationError):
    return False
  return True


_NAME_KEY = re.compile(r"[A-Za-z][\w -]*")


def named_keys(value) -> bool:
  """Whether every key of every object in `value` is a name."""
  if isinstance(value, dict):
    return all(_NAME_KEY.fullmatch(k) and named_keys(v) for k, v in value.items())
  if isinstance(value, list):
    return all(named_keys(v) for v in value)
  return True


def run(loaded, a, tasks) -> dict:
  """Every task under every layout on one engine: a warm-up round, then the timed one."""
  from mdlm_jax.engine.engine import Engine, Request
  from mdlm_jax.sampling import presets
  from mdlm_jax.sampling.grammar import Grammar
  from mdlm_jax.server import chat_template
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  engine = Engine(loaded, num_slots=1, max_prompt=256, max_new_tokens=-(-a.max_tokens // bs) * bs,
                  decode_dtype=a.decode_dtype).start()
  sampler = engine.sampler_for(a.effort, temperature=0.0, revisable=False)

  def request(message: str, schema, layout: str) -> Request:
    prompt, stops, add_bos = chat_template.render([{"role": "user", "content": message}], loaded.chat_template,
                                                  engine.tok)
    grammar = Grammar.json_object(layout=layout) if schema is None else Grammar.json_schema(schema, layout=layout)
    ends = tuple(ids[0] for ids in (engine.tok.encode(s) for s in stops) if len(ids) == 1)
    return Request(engine.encode(prompt, add_bos=add_bos), a.max_tokens, sampler, stop=tuple(stops),
                   grammar=grammar, end_ids=ends)

  def answers(layout: str):
    return [engine.submit(request(message, schema, layout)).result(timeout=1800) for _, message, schema in tasks]

  out = {}
  try:
    for layout in a.layouts:
      answers(layout)  # compiles every program the timed round uses
    for layout in a.layouts:
      t0 = time.perf_counter()
      done = answers(layout)
      seconds = time.perf_counter() - t0
      ok = [valid(d.text, schema) for d, (_, _, schema) in zip(done, tasks)]
      tokens, passes = sum(d.completion_tokens for d in done), sum(d.passes for d in done)
      out[layout] = {
          "valid": sum(ok), "valid_object_mode": sum(v for v, t in zip(ok, tasks) if t[2] is None),
          "valid_schema_mode": sum(v for v, t in zip(ok, tasks) if t[2] is not None),
          "valid_named_keys": sum(v and named_keys(json.loads(d.text)) for v, d in zip(ok, done)),
          "finished_stop": sum(d.finish_reason == "stop" for d in done),
          "finished_length": sum(d.finish_reason == "length" for d in done),
          "completion_tokens": tokens, "passes": passes, "tokens_per_pass": tokens / max(passes, 1),
          "seconds": seconds, "answers": {t[0]: d.text for t, d in zip(tasks, done)},
      }
      print(f"{layout}: {json.dumps({k: v for k, v in out[layout].items() if k != 'answers'})}", file=sys.stderr,
            flush=True)
  finally:
    engine.close(deadline_s=5)
  return out


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  path, loaded = load_checkpoint(a.checkpoint, "bench layouts")
  from mdlm_jax.model.spec import resolve_decode_dtype
  a.decode_dtype = resolve_decode_dtype(loaded, a.decode_dtype)
  tasks = TASKS[:a.limit]
  result = {"bench": "layouts", "checkpoint": path, "decode_dtype": a.decode_dtype, "tasks": len(tasks),
            "object_tasks": sum(t[2] is None for t in tasks), "max_tokens": a.max_tokens, "effort": a.effort,
            "layouts": run(loaded, a, tasks)}
  finish(result, a, plot)


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  layouts = list(result["layouts"])
  keys = ("valid_object_mode", "valid_schema_mode", "valid_named_keys", "finished_stop")
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  width = 0.8 / len(layouts)
  for i, layout in enumerate(layouts):
    ax.bar([k + i * width for k in range(len(keys))], [result["layouts"][layout][k] for k in keys], width,
           label=layout)
  ax.set_xticks([k + width * (len(layouts) - 1) / 2 for k in range(len(keys))],
                ["valid\n(json_object)", "valid\n(json_schema)", "valid, keys\nare names", "finished\n(stop)"])
  ax.set_ylabel(f"answers of {result['tasks']}")
  ax.legend(title="JSON layout")
  ax.set_title(f"structured outputs by JSON layout, {os.path.basename(result['checkpoint'].rstrip('/'))}"
               f" ({result['decode_dtype']})", fontsize=9)
  fig.tight_layout()
  save_figure(fig, path)
