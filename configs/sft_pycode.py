"""Instruction tuning of the BD3 code model, the way LLaDA tunes: the prompt
is never masked, the loss covers the answer and the EOS padding after it.

  python -m mdlm_jax.corpus instructions --corpus=data/pycode --out=data/pycode_instructions
  python -m mdlm_jax.train --config=configs/sft_pycode.py --workdir=runs/sft_pycode \\
      --config.train.init_from=runs/bd3_pycode

The instruction folder holds write-the-function and tool-call conversations
in ChatML and single-line infill records mined from the same corpus (its
held-out files apart). Half of each batch's rows are infills, so the tuned
model keeps the fill-in-the-middle it was pretrained for and sharpens it on
the HumanEval-infilling task shape. Rows hold up to 1,024 tokens (the
model's context), but a mined example takes a median of about 290: batches
are bucketed at 256, 512 and 1,024 tokens (43%, 41% and 16% of the rows), an
average row of 483 tokens, so a step costs about half a full-length one.
"""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bd3_pycode.py"))
  c.data.update(kind="chat", chat_template="chatml", corpus="data/pycode_instructions", fim_rate=0.5,
                length_buckets="256,512")
  # A tenth of pretraining's rate, warmed up briefly: the weights are trained.
  c.optim.update(learning_rate=1e-4, warmup_steps=20)
  c.train.update(num_steps=600, eval_every=200, checkpoint_every=100)
  return c
