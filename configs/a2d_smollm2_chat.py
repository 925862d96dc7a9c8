"""Stage 3 of the SmolLM2 adaptation (configs/a2d_smollm2.py): chat, on answers
SmolLM2-135M-Instruct wrote itself (self-distillation) to requests mined from
the standard library, and tool calls mined from PyPI code (the base writes
none by itself, so they are taken as mined, in the template's format).

  python -m mdlm_jax.corpus instructions --corpus=stdlib --out=data/stdlib_instructions --per-file=6
  python -m mdlm_jax.corpus build --out=data/pycode_small --limit=60
  python -m mdlm_jax.corpus instructions --corpus=data/pycode_small --out=data/pycode_small_instructions
  mkdir -p data/a2d_chat
  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --batch-size=32 \\
      --instructions=data/stdlib_instructions/train.jsonl --out=data/a2d_chat/train.jsonl
  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --batch-size=32 \\
      --instructions=data/pycode_small_instructions/heldout.jsonl --out=data/a2d_chat/heldout.jsonl
  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --kinds=calls \\
      --instructions=data/pycode_small_instructions/train.jsonl --out=data/a2d_chat/calls.jsonl
  cat data/a2d_chat/calls.jsonl >> data/a2d_chat/train.jsonl
  python -m mdlm_jax.train --config=configs/a2d_smollm2_chat.py --workdir=runs/a2d_smollm2_chat \\
      --config.train.init_from=runs/a2d_smollm2_b4

A second round adds the base's answers to 600 mined PyPI-code requests (407
kept, 104K tokens) and continues from the first round's adapters:

  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --batch-size=32 --kinds=writes --limit=600 \\
      --instructions=data/pycode_small_instructions/train.jsonl --out=data/a2d_chat/pycode_writes.jsonl
  cat data/a2d_chat/pycode_writes.jsonl >> data/a2d_chat/train.jsonl
  python -m mdlm_jax.train --config=configs/a2d_smollm2_chat.py --workdir=runs/a2d_smollm2_chat2 \\
      --config.train.init_from=runs/a2d_smollm2_chat --config.data.shuffle_seed=1

A third round adds the answers to the rest of those requests (the same command
with --limit=0 resumes after the first 600; 245 were written before the run
stopped) and continues from the second round:

  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --batch-size=32 --kinds=writes --limit=0 \
      --instructions=data/pycode_small_instructions/train.jsonl --out=data/a2d_chat/pycode_writes.jsonl
  mkdir -p data/a2d_chat3 && cp data/a2d_chat/heldout.jsonl data/a2d_chat3/
  cat data/a2d_chat/train.jsonl <(tail -n +408 data/a2d_chat/pycode_writes.jsonl) > data/a2d_chat3/train.jsonl
  python -m mdlm_jax.train --config=configs/a2d_smollm2_chat.py --workdir=runs/a2d_smollm2_chat3 \
      --config.train.init_from=runs/a2d_smollm2_chat2 --config.data.corpus=data/a2d_chat3 \
      --config.data.shuffle_seed=2 --config.train.eval_every=50

A fourth round (a fresh machine, 2026-11-27: the third round's data was not on it)
continues from the packaged adapters on the base's answers to a second set of
standard-library requests, the first set's and the tool calls of a rebuilt PyPI
sample (its wheels are the registry's newest, so not the earlier sample's):

  python -m mdlm_jax.corpus instructions --corpus=stdlib --out=data/stdlib_instructions12 --per-file=12 --seed=1
  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --batch-size=32 --kinds=writes --limit=0 --seed=1 \
      --instructions=data/stdlib_instructions12/train.jsonl --out=data/draft_answers/stdlib12.jsonl
  python -m mdlm_jax.corpus build --out=data/pycode_small --limit=60
  python -m mdlm_jax.corpus instructions --corpus=data/pycode_small --out=data/pycode_small_instructions
  mkdir -p data/a2d_chat4
  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --kinds=calls \
      --instructions=data/pycode_small_instructions/train.jsonl --out=data/a2d_chat4/calls.jsonl
  python -m mdlm_jax.distill --checkpoint=smollm2-135m-instruct --batch-size=12 --kinds=writes \
      --instructions=data/pycode_small_instructions/heldout.jsonl --out=data/a2d_chat4/heldout.jsonl
  cat <(gunzip -c exports/a2d_chat_data/stdlib_distilled.jsonl.gz) data/draft_answers/stdlib12.jsonl \
      data/a2d_chat4/calls.jsonl > data/a2d_chat4/train.jsonl
  python -m mdlm_jax.train --config=configs/a2d_smollm2_chat.py --workdir=runs/a2d_smollm2_chat4 \
      --config.train.init_from=mdlm_jax/assets/a2d_smollm2 --config.data.corpus=data/a2d_chat4 \
      --config.data.shuffle_seed=4 --config.train.eval_every=50

exports/a2d_chat_data/README.md rebuilds data/a2d_chat4 from committed files in
seconds instead (what the GPU round, launch/a2d_gpu.sh, trained on).

Each answer is the base's own greedy text, so the base is sure of each of its
tokens: the adapters can learn to be sure of several at once, which is what
tokens per pass need, and the distillation term pulls every masked token to
the base's full distribution. Only the answer is masked and scored (the
template's generation span); the prompt stays clean context.
"""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "a2d_smollm2.py"))
  c.diffusion.block_size = 4
  # Prompts with the default system turn take about 60 tokens; answers up to 320. Batch 4:
  # batch 8 of 512-token rows (the dense [L, 2L] mask, the model's and the base's vocabulary
  # distributions) passes the 24 GiB of the development machine.
  c.data.update(kind="chat", corpus="data/a2d_chat", seq_len=512, length_buckets="256", batch_size=4)
  c.optim.update(learning_rate=3e-4, warmup_steps=20)
  c.train.update(num_steps=2000, eval_every=200, eval_batches=2, checkpoint_every=50)
  return c
