"""What every command-line entry point shares: one-line errors, not tracebacks."""

from __future__ import annotations

import os
import sys

from mdlm_jax.checkpoints.checkpointer import CheckpointError
from mdlm_jax.checkpoints.registry import FetchError
from mdlm_jax.config import ConfigError

USER_ERRORS = (ConfigError, CheckpointError, FetchError, FileNotFoundError, ValueError)


def fail(prog: str, err: BaseException, code: int = 2):
  """Prints `prog: error: message` and exits at once: after a failed read,
  orbax's background threads would otherwise print tracebacks at shutdown."""
  print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(code)


def drop_closed_loop_noise() -> None:
  """After a failed orbax read, its worker threads report 'Event loop is
  closed' through sys.unraisablehook; that says nothing to the user, whose
  error we print ourselves. Every other unraisable exception still shows."""
  previous = sys.unraisablehook

  def hook(unraisable):
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc):
      return
    previous(unraisable)

  sys.unraisablehook = hook
