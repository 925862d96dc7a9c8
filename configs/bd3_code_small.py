"""Block diffusion (BD3-LM) twin of code_small: same network and data, blocks
of 8 tokens (48 blocks per 384-token sequence). Each step runs the network
over [x_t ; x_0], twice the length of code_small's input.

The head is shifted (hidden state i - 1 scores token i, as in Dream), so the
model can start from its trained AR twin instead of from scratch: masked
diffusion from scratch spends its first few million tokens on unigram
statistics, while the AR twin already knows the context. The packaged model
was trained this way (see the README):

  python -m mdlm_jax.train --config=configs/bd3_code_small.py --workdir=runs/bd3_code_small \\
      --config.train.init_from=runs/ar_code_small

The learning rate and warm-up are those of a fine-tune from that start.
"""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_small.py"))
  c.diffusion.block_size = 8
  c.model.shift_logits = True
  c.optim.update(learning_rate=1e-3, warmup_steps=20)
  c.train.update(num_steps=500, eval_every=100)
  return c
