"""The models that ship inside the package (params-only, bfloat16).

DIFFUSION is the default of every command that takes --checkpoint; AR is its
autoregressive twin (same network, data, tokenizer and budget), the baseline
the sampling benchmark compares against. configs/ has the configs they were
trained with and the README the exact commands.
"""

from __future__ import annotations

import os

DIFFUSION = "bd3_code_small"
AR = "ar_code_small"
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def path(name: str = DIFFUSION) -> str:
  p = os.path.join(ASSETS, name)
  if not os.path.isdir(p):
    raise FileNotFoundError(f"this installation has no packaged model {name!r} (looked in {ASSETS});"
                            " pass --checkpoint=DIR")
  return p
