"""Block diffusion (BD3-LM) twin of code_small: same network, data and budget,
blocks of 16 tokens (16 blocks per 256-token sequence). Each step runs the
network over [x_t ; x_0], twice the length of code_small's input."""

import importlib.util
import os


def get_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_small.py")
  spec = importlib.util.spec_from_file_location("code_small", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.diffusion.block_size = 16
  return c
