"""An instruction set mined from the code corpus itself.

    python -m mdlm_jax.corpus instructions --corpus DIR --out DIR [--per-file 2] [--seed 0]

Three kinds of example, as jsonl records. Two are conversations,
`{"messages": [...], "tools": [...]}`, that the chat template
(`data.chat_template`) renders:
- write: the user gives a function's signature and docstring, or says in
  words what it does and what it is called (`REQUESTS`), and the assistant
  answers with the whole function (the docstring-to-body task HumanEval asks);
- call: a real function's signature becomes a tool schema (its annotated
  parameters as JSON Schema types, its docstring's first paragraph as the
  description), offered beside two other functions' schemas; the user asks
  for it with arguments, and the assistant answers with the tool call.
The third, `{"fim": {"prefix", "middle", "suffix"}}`, is infilling in the
fill-in-the-middle format (`data/fim.py`): one line of a function's body
after its docstring is the middle, the file's imports and the function
around it prefix and suffix, as HumanEval-infilling cuts its single lines.

Files of the corpus's validation split go to `heldout.jsonl`, the rest to
`train.jsonl`, so held-out functions never appear in training.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import random
import textwrap
import time
from typing import Callable, Iterator, Sequence

JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "list": "array",
              "dict": "object", "List": "array", "Dict": "object", "Sequence": "array", "Mapping": "object"}
MAX_BODY_LINES = 40
PROGRESS_EVERY = 5000  # files between progress lines


@dataclasses.dataclass(frozen=True)
class Function:
  name: str
  header: str  # signature and docstring, as written
  source: str  # the whole function, dedented
  doc: str
  params: tuple[tuple[str, str | None, object], ...]  # (name, JSON type or None, default or MISSING)
  imports: str = ""  # the file's top-level import statements, as written


MISSING = object()


def _json_type(annotation: ast.expr | None) -> str | None:
  if annotation is None:
    return None
  if isinstance(annotation, ast.Name):
    return JSON_TYPES.get(annotation.id)
  if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
    return JSON_TYPES.get(annotation.value.id)
  if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
    return JSON_TYPES.get(annotation.value.split("[")[0])
  return None


def functions(text: str) -> Iterator[Function]:
  """Public top-level functions with a docstring and a short body."""
  try:
    tree = ast.parse(text)
  except (SyntaxError, ValueError):
    return
  lines = text.splitlines(keepends=True)
  imports = "".join("".join(lines[n.lineno - 1:n.end_lineno]) for n in tree.body
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and n.col_offset == 0)
  for node in tree.body:
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
      continue
    doc = ast.get_docstring(node)
    if not doc or len(node.body) < 2:
      continue
    start, doc_end, end = node.lineno - 1, node.body[0].end_lineno, node.end_lineno
    if end - doc_end > MAX_BODY_LINES or end - doc_end < 1:
      continue
    args = node.args
    if args.vararg or args.kwarg or args.posonlyargs:
      continue
    positional = args.args
    defaults = [MISSING] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = []
    for a, d in list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults)):
      default = MISSING
      if d is not None and d is not MISSING:
        try:
          default = ast.literal_eval(d)
        except ValueError:
          default = MISSING
      params.append((a.arg, _json_type(a.annotation), default))
    yield Function(node.name, textwrap.dedent("".join(lines[start:doc_end])).rstrip() + "\n",
                   textwrap.dedent("".join(lines[start:end])).rstrip() + "\n", doc, tuple(params), imports)


def signature(fn: Function) -> str:
  """The `def` line(s) up to the colon before the docstring."""
  head = fn.header.split("\n")
  for n, line in enumerate(head):
    if line.rstrip().endswith(":"):
      return "\n".join(head[:n + 1])
  return head[0]


def summary(doc: str) -> str:
  """A docstring's first paragraph on one line."""
  return " ".join(doc.strip().split("\n\n")[0].split())


# How a write request is put: the header given as code, or the task said in
# words (users ask both ways; a model tuned on one answers the other with EOS).
REQUESTS = (
    lambda fn: f"Complete this Python function.\n\n```python\n{fn.header}```",
    lambda fn: f"Implement `{fn.name}`:\n\n```python\n{fn.header}```",
    lambda fn: f"Write a Python function `{' '.join(signature(fn)[4:].rstrip(':').split())}`. {summary(fn.doc)}",
    lambda fn: f"{summary(fn.doc)}\n\nWrite this as a Python function named `{fn.name}`.",
)


def write_example(fn: Function, rng: random.Random | None = None) -> dict:
  """The function asked for in one of the REQUESTS' phrasings (the first
  without `rng`), answered with the whole function."""
  request = REQUESTS[0] if rng is None else rng.choice(REQUESTS)
  return {"messages": [
      {"role": "user", "content": request(fn)},
      {"role": "assistant", "content": f"```python\n{fn.source}```"}]}


def infill_example(fn: Function, rng: random.Random) -> dict | None:
  """One non-blank body line after the docstring as the middle; None if the
  body has none."""
  lines = fn.source.splitlines(keepends=True)
  body = [i for i in range(fn.header.count("\n"), len(lines)) if lines[i].strip()]
  if not body:
    return None
  i = rng.choice(body)
  head = fn.imports + "\n\n" if fn.imports else ""
  return {"fim": {"prefix": head + "".join(lines[:i]), "middle": lines[i], "suffix": "".join(lines[i + 1:])}}


def tool_schema(fn: Function) -> dict | None:
  """The function as an OpenAI tool; None unless every parameter has a JSON type."""
  if not fn.params or any(t is None for _, t, _ in fn.params):
    return None
  summary = fn.doc.strip().split("\n\n")[0].replace("\n", " ")
  properties = {name: {"type": t} for name, t, _ in fn.params}
  required = [name for name, _, default in fn.params if default is MISSING]
  return {"type": "function", "function": {"name": fn.name, "description": summary[:300], "parameters": {
      "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def _value(name: str, json_type: str, rng: random.Random):
  return {"integer": lambda: rng.randint(0, 100), "number": lambda: round(rng.uniform(0, 10), 2),
          "string": lambda: f"{name}_{rng.randint(1, 9)}", "boolean": lambda: rng.random() < 0.5,
          "array": lambda: [rng.randint(0, 9) for _ in range(rng.randint(1, 3))],
          "object": lambda: {"key": rng.randint(0, 9)}}[json_type]()


def call_example(fn: Function, schema: dict, others: Sequence[dict], rng: random.Random) -> dict:
  """A request for `fn` among other tools, answered by its tool call."""
  args = {name: (default if default is not MISSING and rng.random() < 0.5 else _value(name, t, rng))
          for name, t, default in fn.params if default is MISSING or rng.random() < 0.5}
  tools = [schema, *others]
  rng.shuffle(tools)
  summary = schema["function"]["description"].rstrip(".")
  shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())
  request = rng.choice([f"Use {fn.name} with {shown}.", f"{summary}: {shown}." if shown else f"{summary}.",
                        f"Please call {fn.name}" + (f" where {shown}." if shown else ".")])
  return {"tools": tools, "messages": [
      {"role": "user", "content": request},
      {"role": "assistant", "content": "", "tool_calls": [
          {"id": "call_0", "type": "function", "function": {"name": fn.name, "arguments": json.dumps(args)}}]}]}


def mine(documents: Sequence[str], *, per_file: int = 2, seed: int = 0,
         progress: Callable[[int, int], None] | None = None) -> list[dict]:
  """Up to `per_file` write and infill examples and one call example per
  file; `progress(files read, files)` every PROGRESS_EVERY files."""
  rng = random.Random(seed)
  found = []
  for n, text in enumerate(documents, 1):
    found.append(list(functions(text)))
    if progress is not None and (n % PROGRESS_EVERY == 0 or n == len(documents)):
      progress(n, len(documents))
  schemas = [s for fns in found for s in (tool_schema(f) for f in fns) if s is not None]
  out = []
  for fns in found:
    for fn in rng.sample(fns, min(per_file, len(fns))):
      out.append(write_example(fn, rng))
      if (infill := infill_example(fn, rng)) is not None:
        out.append(infill)
    callable_ = [(f, s) for f in fns if (s := tool_schema(f)) is not None]
    if callable_ and len(schemas) > 2:
      fn, schema = rng.choice(callable_)
      others = [s for s in rng.sample(schemas, 3) if s["function"]["name"] != fn.name][:2]
      out.append(call_example(fn, schema, others, rng))
  return out


def build(corpus: str, out: str, *, per_file: int = 2, seed: int = 0, validation_fraction: float = 0.01,
          log: Callable[[str], None] | None = None) -> dict:
  """train.jsonl from the corpus's train split, heldout.jsonl from its validation split."""
  from mdlm_jax.data import pipeline
  os.makedirs(out, exist_ok=True)
  counts = {}
  for split, name in (("train", "train"), ("validation", "heldout")):
    t0 = time.monotonic()

    def progress(n, total):
      if log is not None:
        rate = n / max(time.monotonic() - t0, 1e-9)
        log(f"{split}: {n}/{total} files parsed, {rate:.0f} files/s, ETA {(total - n) / rate:.0f}s")
    examples = mine(pipeline.load_documents(corpus, split, validation_fraction), per_file=per_file, seed=seed,
                    progress=progress)
    path = os.path.join(out, f"{name}.jsonl")
    with open(path + ".tmp", "w") as f:
      for e in examples:
        f.write(json.dumps(e, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    counts[name] = {"examples": len(examples), "calls": sum("tools" in e for e in examples),
                    "infills": sum("fim" in e for e in examples)}
  return counts
