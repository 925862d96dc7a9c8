"""The autoregressive twin of code_small: same network, data and budget."""

import os

from mdlm_jax.config import load_config_file


def get_config():
  c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_small.py"))
  c.objective = "ar"
  c.model.causal = True
  return c
