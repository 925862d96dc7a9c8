"""Self-distillation data: an AR model's own answers to instructions
(`python -m mdlm_jax.distill`).

A diffusion model adapted from an AR model learns fastest from text its base
would write itself: the base is sure of every token of it, so the adapted
model can learn to be sure of several at once, and it learns to answer as its
base answers rather than as the corpus reads. Each user request of an
instruction set (`data/instructions.py`: the write examples) is rendered
through the model's chat template and answered greedily by our KV-cached AR
decoder in batches; an answer is kept when the model ended its turn within
`max_new_tokens` tokens. Tool-call examples are kept as mined (the calls are
written in the template's format, which a small base does not write by
itself), so the output is a chat set the trainer reads as is
(`data.kind="chat"`).

The output is appended a batch at a time, each line with the position of its
instruction (`index`), and the command resumes after the last one written (a
line cut by a kill is dropped).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Iterable, Sequence


@dataclasses.dataclass
class Counts:
  requests: int = 0  # answered this run (kept or not)
  kept: int = 0
  cut: int = 0  # dropped: no end of turn within max_new_tokens
  calls: int = 0  # tool-call examples copied as mined
  tokens: int = 0  # answer tokens generated this run


def requests_of(records: Iterable[dict]) -> list[dict]:
  """The records to distill or copy, in order: write conversations (their user
  turn) and tool-call conversations; infill records are left out."""
  out = []
  for r in records:
    messages = r.get("messages") if isinstance(r, dict) else None
    if not isinstance(messages, list) or not messages or messages[0].get("role") != "user":
      continue
    out.append(r)
  return out


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def resume_point(path: str) -> int:
  """The instruction after the last one `path` holds (0 for none); a last
  line cut by a kill is removed first."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    data = f.read()
  keep = data[:data.rfind(b"\n") + 1]
  if len(keep) != len(data):
    with open(path, "wb") as f:
      f.write(keep)
  lines = keep.splitlines()
  return int(json.loads(lines[-1])["index"]) + 1 if lines else 0


def distill(generator, render: Callable[[list[dict]], tuple[str, Sequence[str], bool]], records: Sequence[dict],
            out: str, *, max_new_tokens: int = 384, batch_size: int = 8, source: str = "",
            log: Callable[[str], None] | None = None) -> Counts:
  """Appends a line for each record of `records` after the last one `out`
  holds: a tool-call record as it is, a write record as its user turn and
  the model's greedy answer (`generator`: an ARGenerator), unless the answer
  did not end within `max_new_tokens`. `render(messages)` gives the prompt,
  the strings that end a turn and whether a BOS goes first."""
  start = resume_point(out)
  counts = Counts()
  t0 = time.monotonic()
  todo = list(range(start, len(records)))
  with open(out, "a", encoding="utf-8") as f:
    for lo in range(0, len(todo), batch_size):
      batch = [records[i] for i in todo[lo:lo + batch_size]]
      asks = [r for r in batch if "tools" not in r]
      answers = {}
      if asks:
        rendered = [render([r["messages"][0]]) for r in asks]
        prompts = [p for p, _, _ in rendered]
        stops = sorted({s for _, ss, _ in rendered for s in ss})
        result = generator.generate(prompts, max_new_tokens=max_new_tokens, stop=stops, add_bos=rendered[0][2])
        for r, c in zip(asks, result.completions):
          answers[id(r)] = c
          counts.tokens += len(c.tokens)
      for i, r in zip(todo[lo:lo + batch_size], batch):
        if "tools" in r:
          line, counts.calls = {**r, "index": i}, counts.calls + 1
        else:
          c = answers[id(r)]
          counts.requests += 1
          if c.finish_reason != "stop" or not c.text.strip():
            counts.cut += 1
            continue
          counts.kept += 1
          line = {"messages": [r["messages"][0], {"role": "assistant", "content": c.text.strip()}],
                  "index": i, "source": source}
        f.write(json.dumps(line, ensure_ascii=False) + "\n")
      f.flush()
      if log is not None:
        n = lo + len(batch)
        rate = counts.tokens / max(time.monotonic() - t0, 1e-9)
        per = (time.monotonic() - t0) / n
        log(f"{start + n}/{len(records)} records, {counts.kept} answers kept, {counts.cut} cut,"
            f" {counts.calls} tool calls; {rate:.0f} tokens/s, ETA {per * (len(todo) - n) / 60:.0f} min")
  return counts
