"""Multi-process (multi-host) startup through JAX's own multi-controller runtime.

Each host runs the same command; `initialize` connects them before any JAX
computation. Explicit flags win; otherwise the environment decides:
MDLM_COORDINATOR/MDLM_NUM_PROCESSES/MDLM_PROCESS_ID (set by launch/local.py),
SLURM with more than one task, or a multi-host Cloud TPU slice (both
auto-detected by jax.distributed.initialize itself).
"""

from __future__ import annotations

import os

import jax
import numpy as np


def _env_int(name: str) -> int | None:
  v = os.environ.get(name)
  return int(v) if v not in (None, "") else None


def wanted(coordinator: str | None = None, num_processes: int | None = None) -> bool:
  if coordinator or (num_processes or 0) > 1:
    return True
  if (_env_int("MDLM_NUM_PROCESSES") or 0) > 1:
    return True
  if (_env_int("SLURM_NTASKS") or 0) > 1 and "SLURM_JOB_ID" in os.environ:
    return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Connects the processes of a multi-host job; returns whether it did."""
  if not wanted(coordinator, num_processes):
    return False
  coordinator = coordinator or os.environ.get("MDLM_COORDINATOR") or None
  num_processes = num_processes if num_processes is not None else _env_int("MDLM_NUM_PROCESSES")
  process_id = process_id if process_id is not None else _env_int("MDLM_PROCESS_ID")
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
    # Cross-process collectives on CPU (tests, local launches) go through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = {}
  if coordinator:
    kwargs.update(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    if num_processes is None or process_id is None:
      raise ValueError("--coordinator_address needs --num_processes and --process_id")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} is not in [0, {num_processes})")
  jax.distributed.initialize(**kwargs)
  return True


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's bytes on every process (e.g. a tokenizer trained once)."""
  if jax.process_count() == 1:
    assert data is not None
    return data
  from jax.experimental import multihost_utils
  n = np.int64(len(data) if jax.process_index() == 0 else 0)
  n = int(multihost_utils.broadcast_one_to_all(n))
  buf = np.frombuffer(data, np.uint8) if jax.process_index() == 0 else np.zeros(n, np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf)))
