"""Block diffusion (BD3-LM) on pycode, adapted from its trained AR twin with
a shifted head (as bd3_code_small is):

  python -m mdlm_jax.train --config=configs/bd3_pycode.py --workdir=runs/bd3_pycode \\
      --config.train.init_from=runs/ar_pycode

Blocks of 8 tokens; each step runs the network over [x_t ; x_0], twice the
AR twin's length, so a step costs about twice the twin's: 2,000 steps (16.4M
tokens) after the twin's 4,000.
"""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pycode.py"))
  c.diffusion.block_size = 8
  # Source files average about 2,400 tokens, more than two rows: cut before
  # packing, a file's PSM example seldom fits in one row (the AR twin, trained
  # so, does not infill). Cut after packing, every example is whole.
  c.data.fim_level = "context"
  c.model.shift_logits = True
  c.optim.update(learning_rate=1e-3, warmup_steps=50)
  c.train.update(num_steps=2000, eval_every=250)
  return c
