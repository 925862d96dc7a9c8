"""Offline lm-eval tasks over held-out Python source: the validation split
(5%, by path) of the standard library of the interpreter that runs them,
which the packaged models never trained on. Nothing is downloaded.

- pycode_ppl: rolling log-likelihood of whole files (word and byte
  perplexity, bits per byte).
- pycode_next_line: multiple choice, the line that comes next in a file
  against three lines drawn from other files (seeded).
"""

from __future__ import annotations

import random

DOCS = 128  # files per task, the first of the held-out split
MAX_CHARS = 4000  # of each file, from its start
CONTEXT_CHARS = 1200  # of the lines before the asked one


def held_out_documents(validation_fraction: float = 0.05) -> list[str]:
  from mdlm_jax import data
  docs = [d[:MAX_CHARS] for d in data.load_documents("stdlib", "validation", validation_fraction)]
  return [d for d in docs if d.count("\n") >= 8][:DOCS]


def _dataset(rows: list[dict]):
  import datasets
  return {"test": datasets.Dataset.from_list(rows)}


def ppl_docs(**_) -> dict:
  return _dataset([{"text": d} for d in held_out_documents()])


def next_line_docs(seed: int = 1234, **_) -> dict:
  docs = held_out_documents()
  rng = random.Random(seed)
  pool = [(i, line) for i, d in enumerate(docs) for line in d.splitlines() if len(line.strip()) >= 8]
  rows = []
  for i, d in enumerate(docs):
    lines = d.splitlines(keepends=True)
    candidates = [k for k in range(4, len(lines) - 1) if len(lines[k].strip()) >= 8]
    if not candidates:
      continue
    k = rng.choice(candidates)
    truth = lines[k].rstrip("\n")
    others = [line for j, line in rng.sample(pool, 12) if j != i and line != truth][:3]
    if len(others) < 3:
      continue
    choices = others + [truth]
    rng.shuffle(choices)
    rows.append({"context": "".join(lines[:k])[-CONTEXT_CHARS:], "choices": choices, "answer": choices.index(truth)})
  return _dataset(rows)
