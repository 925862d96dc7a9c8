"""python -m mdlm_jax.distill --instructions FILE --checkpoint AR --out FILE [--limit N]

Writes an AR model's own greedy answers to the user requests of a mined
instruction set (`python -m mdlm_jax.corpus instructions`), through its chat
template, with the set's tool-call examples beside them: the chat data an
adaptation of that model to diffusion trains on (data/self_distill.py). A
second run with the same flags resumes where the first stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys

from mdlm_jax import cli


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.distill", description=__doc__.split("\n\n")[1])
  p.add_argument("--instructions", required=True, help="a jsonl that `corpus instructions` wrote (train.jsonl)")
  p.add_argument("--checkpoint", required=True, help="the AR model: a registry name, a GGUF file or a folder")
  p.add_argument("--out", required=True, help="the jsonl to write (appended to: a second run resumes)")
  p.add_argument("--limit", type=int, default=0, help="only the first N records after shuffling (0: all)")
  p.add_argument("--seed", type=int, default=0, help="the shuffle that orders the records")
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--max-new-tokens", type=int, default=320, help="an answer longer than this is dropped")
  p.add_argument("--kinds", default="writes,calls",
                 help="which records: writes (answered by the model), calls (tool calls, copied), or both")
  a = p.parse_args(argv)
  a.kinds = {k.strip() for k in a.kinds.split(",") if k.strip()}
  if not a.kinds or not a.kinds <= {"writes", "calls"}:
    p.error(f"--kinds must be writes, calls or writes,calls, got {','.join(sorted(a.kinds))!r}")
  if a.limit < 0 or a.batch_size < 1 or a.max_new_tokens < 1:
    p.error("--limit must be >= 0, --batch-size and --max-new-tokens >= 1")
  return a


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  from mdlm_jax import checkpoints
  from mdlm_jax.data import self_distill
  from mdlm_jax.sampling.generate import ARGenerator
  from mdlm_jax.server import chat_template
  try:
    records = [r for r in self_distill.requests_of(self_distill.read_jsonl(a.instructions))
               if ("calls" if "tools" in r else "writes") in a.kinds]
    if not records:
      raise ValueError(f"{a.instructions}: no {' or '.join(sorted(a.kinds))} record starts with a user turn")
    random.Random(a.seed).shuffle(records)
    # Answered shortest prompt first: a batch's rows pad to one width, and each width compiles once.
    records = sorted(records[:a.limit or None], key=lambda r: len(r["messages"][0]["content"]))
    loaded = checkpoints.load(a.checkpoint)
    if not loaded.spec.cfg.causal:
      raise ValueError(f"{a.checkpoint} is not an AR model: the answers to distill are an AR model's")
  except cli.USER_ERRORS as e:
    cli.fail("distill", e)
  counts = self_distill.distill(
      ARGenerator(loaded), lambda messages: chat_template.render(messages, loaded.chat_template, loaded.tokenizer),
      records, a.out, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, source=a.checkpoint,
      log=lambda m: print(m, file=sys.stderr, flush=True))
  print(json.dumps(dataclasses.asdict(counts)))


if __name__ == "__main__":
  main()
