"""The autoregressive twin of code_small: same network, data and budget."""

import importlib.util
import os


def get_config():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_small.py")
  spec = importlib.util.spec_from_file_location("code_small", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.objective = "ar"
  c.model.causal = True
  return c
