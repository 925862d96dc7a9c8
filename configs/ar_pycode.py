"""The autoregressive twin of pycode: same network, data (fill-in-the-middle
included) and budget; trained first, and the start of the BD3 model."""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pycode.py"))
  c.objective = "ar"
  c.model.causal = True
  return c
