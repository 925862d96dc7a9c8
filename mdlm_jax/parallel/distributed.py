"""Multi-process (multi-host) startup through JAX's own multi-controller runtime.

Each host runs the same command; `initialize` connects them before any JAX
computation. Explicit flags win; otherwise the environment decides:
MDLM_COORDINATOR/MDLM_NUM_PROCESSES/MDLM_PROCESS_ID (set by launch/local.py),
SLURM with more than one task, a multi-host Cloud TPU slice, or
MDLM_DISTRIBUTED=auto (set by launch/tpu.sh); in the last three cases
jax.distributed.initialize finds the other processes itself.
"""

from __future__ import annotations

import hashlib
import os

import jax
import numpy as np


def _env_int(name: str) -> int | None:
  v = os.environ.get(name)
  return int(v) if v not in (None, "") else None


def wanted(coordinator: str | None = None, num_processes: int | None = None) -> bool:
  if coordinator or (num_processes or 0) > 1:
    return True
  if (_env_int("MDLM_NUM_PROCESSES") or 0) > 1 or os.environ.get("MDLM_DISTRIBUTED") == "auto":
    return True
  if (_env_int("SLURM_NTASKS") or 0) > 1 and "SLURM_JOB_ID" in os.environ:
    return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def define_flags():
  """The absl flags every multi-process entry point takes (train, eval)."""
  from absl import flags
  return (flags.DEFINE_string("coordinator_address", None,
                              "host:port of process 0 for a multi-process run (else auto-detected)"),
          flags.DEFINE_integer("num_processes", None, "processes in a multi-process run"),
          flags.DEFINE_integer("process_id", None, "this process's index in a multi-process run"))


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


def _allgather(x: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x))


def check_same(what: str, text: str) -> None:
  """Raises ValueError on every process unless all processes hold the same
  `text` (e.g. the config): a host started with other flags or another
  checkout would otherwise train a different model in lockstep."""
  if jax.process_count() == 1:
    return
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  digests = _allgather(digest)
  differ = [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]
  if differ:
    raise ValueError(f"process(es) {differ} see a different {what} than process 0;"
                     " every process must run the same command with the same files")


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (e.g. a stop request that
  reached only some hosts); a collective, so call it at the same step everywhere."""
  if jax.process_count() == 1:
    return flag
  return bool(_allgather(np.int32(flag)).any())
