"""Block diffusion (BD3-LM) twin of code_small: same network, data and budget,
blocks of 8 tokens (48 blocks per 384-token sequence). Each step runs the
network over [x_t ; x_0], twice the length of code_small's input."""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_small.py"))
  c.diffusion.block_size = 8
  return c
