"""python -m mdlm_jax.distill --instructions FILE --checkpoint AR --out FILE [--limit N]
python -m mdlm_jax.distill --corpus stdlib --windows N --checkpoint AR --out FILE

Writes an AR model's own greedy text. With --instructions: its answers to
the user requests of a mined instruction set (`python -m mdlm_jax.corpus
instructions`), through its chat template, with the set's tool-call examples
beside them: the chat data an adaptation of that model to diffusion trains
on (data/self_distill.py). With --corpus: its continuations of windows of the
corpus's training files (data/code_windows.py), which a draft table learns
the base's code habits from. A second run with the same flags resumes where
the first stopped.
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
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--instructions", help="a jsonl that `corpus instructions` wrote (train.jsonl)")
  src.add_argument("--corpus", help="a corpus (as data.corpus takes it) whose training files give windows of code")
  p.add_argument("--checkpoint", required=True, help="the AR model: a registry name, a GGUF file or a folder")
  p.add_argument("--out", required=True, help="the jsonl to write (appended to: a second run resumes)")
  p.add_argument("--limit", type=int, default=0, help="only the first N records after shuffling (0: all)")
  p.add_argument("--seed", type=int, default=0, help="the shuffle that orders the records")
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="--instructions: an answer longer than this is dropped (default 320); --corpus: each"
                      " continuation's length (default 64)")
  from mdlm_jax.model.transformer import DECODE_DTYPE_CHOICES
  p.add_argument("--decode-dtype", choices=DECODE_DTYPE_CHOICES, default="float32",
                 help="the weights the model writes from (w8a8: what serve decodes with on CPU; its greedy text"
                      " can differ from float32's)")
  p.add_argument("--windows", type=int, default=1000, help="--corpus: how many windows to continue")
  p.add_argument("--prompt-tokens", type=int, default=64, help="--corpus: each window's length in tokens")
  p.add_argument("--validation-fraction", type=float, default=0.05,
                 help="--corpus: the share of files held out (as data.validation_fraction), never drawn from")
  p.add_argument("--kinds", default="writes,calls",
                 help="which records: writes (answered by the model), calls (tool calls, copied), or both")
  a = p.parse_args(argv)
  a.kinds = {k.strip() for k in a.kinds.split(",") if k.strip()}
  if not a.kinds or not a.kinds <= {"writes", "calls"}:
    p.error(f"--kinds must be writes, calls or writes,calls, got {','.join(sorted(a.kinds))!r}")
  if a.max_new_tokens is None:
    a.max_new_tokens = 320 if a.instructions else 64
  if a.limit < 0 or a.batch_size < 1 or a.max_new_tokens < 1 or a.windows < 0 or a.prompt_tokens < 1:
    p.error("--limit and --windows must be >= 0, --batch-size, --max-new-tokens and --prompt-tokens >= 1")
  if not 0 <= a.validation_fraction < 1:
    p.error(f"--validation-fraction must be in [0, 1), got {a.validation_fraction}")
  return a


def main(argv=None):
  a = parse(sys.argv[1:] if argv is None else argv)
  if a.corpus:
    return continue_corpus(a)
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
      ARGenerator(loaded, decode_dtype=a.decode_dtype),
      lambda messages: chat_template.render(messages, loaded.chat_template, loaded.tokenizer),
      records, a.out, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, source=a.checkpoint,
      log=lambda m: print(m, file=sys.stderr, flush=True))
  print(json.dumps(dataclasses.asdict(counts)))


def continue_corpus(a) -> None:
  """--corpus: the model's continuations of windows of the corpus's training files."""
  from mdlm_jax import checkpoints, data
  from mdlm_jax.data import code_windows
  from mdlm_jax.sampling.generate import ARGenerator
  try:
    loaded = checkpoints.load(a.checkpoint)
    if not loaded.spec.cfg.causal:
      raise ValueError(f"{a.checkpoint} is not an AR model: the text to distill is an AR model's")
    documents = data.load_documents(a.corpus, "train", a.validation_fraction)
    prompts = code_windows.windows(documents, loaded.tokenizer, a.windows, a.prompt_tokens, a.seed)
  except cli.USER_ERRORS as e:
    cli.fail("distill", e)
  generator = ARGenerator(loaded, decode_dtype=a.decode_dtype)
  counts = code_windows.continue_windows(generator, prompts, a.out, new_tokens=a.max_new_tokens,
                                         batch_size=a.batch_size, source=a.checkpoint,
                                         log=lambda m: print(m, file=sys.stderr, flush=True))
  print(json.dumps(dataclasses.asdict(counts)))


if __name__ == "__main__":
  main()
