"""What every command-line entry point shares: one-line errors, not tracebacks."""

from __future__ import annotations

import sys

from mdlm_jax.checkpoint import CheckpointError
from mdlm_jax.config import ConfigError

USER_ERRORS = (ConfigError, CheckpointError, FileNotFoundError, ValueError)


def fail(prog: str, err: BaseException, code: int = 2):
  print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
  sys.exit(code)
