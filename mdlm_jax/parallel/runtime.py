"""Process-level runtime setup that must happen before JAX starts its backends."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count"


def split_cpu_into_devices(batch_size: int | None = None) -> int:
  """On CPU, expose one JAX device per core so the data-parallel mesh runs the
  cores side by side (XLA:CPU runs most ops of one program on one core).

  Takes the largest core count that divides `batch_size`. Does nothing when
  XLA_FLAGS already sets the device count or a backend is already running;
  only the CPU platform is affected, so GPU/TPU runs are unchanged.
  Returns the device count it asked for (0 if it left things alone)."""
  if _FLAG in os.environ.get("XLA_FLAGS", ""):
    return 0
  import jax
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
  n = max(d for d in range(1, cores + 1) if batch_size is None or batch_size % d == 0)
  if n > 1:
    try:
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # a backend is already running: its device count stands
      return 0
  return n
