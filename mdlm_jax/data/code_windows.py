"""Self-distilled code: an AR model's own greedy continuations of windows of
training code (`python -m mdlm_jax.distill --corpus`).

A revising pass keeps the drafts its base agrees with, so drafts are worth
what they predict of the base's own text. On code completions the base
writes in habits of its own (its greedy text is far likelier to it than the
corpus is), which neither copying from the prompt nor a table of chat
answers knows. A draft table built from the base's continuations of
training files' windows (`sampling.draft_table --answers`) knows them; the
windows come from the corpus's training split only, so held-out files stay
held out.

Each line holds a window (`prompt`, the text of `prompt_tokens` tokens from
a random offset of a random training file) and the base's continuation of
it (`completion`, `new_tokens` tokens, greedy), with its position in the
seeded draw (`index`): the command resumes after the last line written.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Sequence

import numpy as np

from mdlm_jax.data.self_distill import Counts, resume_point


def windows(documents: Sequence[str], tokenizer, count: int, prompt_tokens: int, seed: int = 0) -> list[str]:
  """`count` windows of `prompt_tokens` tokens, each from a document drawn
  at random (with replacement) among those of at least twice that many
  tokens, at a random offset that leaves as many after it; the same draw for
  the same seed and documents."""
  if count < 0 or prompt_tokens < 1:
    raise ValueError(f"need count >= 0 and prompt_tokens >= 1, got {count} and {prompt_tokens}")
  ids = [tokenizer.encode(d) for d in documents]
  long_enough = [d for d in ids if len(d) >= 2 * prompt_tokens]
  if count and not long_enough:
    raise ValueError(f"no document holds {2 * prompt_tokens} tokens: none can give a window")
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    d = long_enough[int(rng.integers(len(long_enough)))]
    at = int(rng.integers(0, len(d) - 2 * prompt_tokens + 1))
    out.append(tokenizer.decode(d[at:at + prompt_tokens]))
  return out


def continue_windows(generator, prompts: Sequence[str], out: str, *, new_tokens: int, batch_size: int = 8,
                     source: str = "", log: Callable[[str], None] | None = None) -> Counts:
  """Appends a line for each prompt after the last one `out` holds: the
  prompt and `generator`'s (an ARGenerator's) greedy continuation of it, at
  most `new_tokens` tokens. A continuation that ended at once (nothing
  written) is dropped."""
  from mdlm_jax.sampling.ar import ARSampler
  start = resume_point(out)
  counts = Counts()
  sampler = ARSampler(new_tokens, temperature=0.0)
  t0 = time.monotonic()
  todo = list(range(start, len(prompts)))
  with open(out, "a", encoding="utf-8") as f:
    for lo in range(0, len(todo), batch_size):
      index = todo[lo:lo + batch_size]
      result = generator.generate([prompts[i] for i in index], max_new_tokens=new_tokens, sampler=sampler)
      for i, c in zip(index, result.completions):
        counts.requests += 1
        counts.tokens += len(c.tokens)
        if not c.text:
          counts.cut += 1
          continue
        counts.kept += 1
        f.write(json.dumps({"prompt": prompts[i], "completion": c.text, "index": i, "source": source},
                           ensure_ascii=False) + "\n")
      f.flush()
      if log is not None:
        n = lo + len(index)
        elapsed = time.monotonic() - t0
        log(f"{start + n}/{len(prompts)} windows, {counts.kept} continued, {counts.cut} empty;"
            f" {counts.tokens / max(elapsed, 1e-9):.0f} tokens/s, ETA {elapsed / n * (len(todo) - n) / 60:.0f} min")
  return counts
