#!/usr/bin/env python3
"""Start N processes of one command on this machine, connected as a multi-process
JAX job over 127.0.0.1 with CPU collectives (gloo): the multi-host code path,
testable on a laptop.

  python launch/local.py --num-processes 2 --devices-per-process 2 -- \\
      python -m mdlm_jax.train --config=configs/tiny.py --workdir=runs/mp

Each process gets MDLM_COORDINATOR, MDLM_NUM_PROCESSES, MDLM_PROCESS_ID,
JAX_PLATFORMS=cpu and XLA_FLAGS with its device count; its output is
prefixed with [pN]. If one process fails the others are stopped.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(i: int, n: int, port: int, devices: int) -> dict[str, str]:
  return {
      "MDLM_COORDINATOR": f"127.0.0.1:{port}",
      "MDLM_NUM_PROCESSES": str(n),
      "MDLM_PROCESS_ID": str(i),
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
  }


def describe(i: int, env: dict[str, str], cmd: list[str]) -> str:
  return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--num-processes", type=int, default=2)
  p.add_argument("--devices-per-process", type=int, default=1)
  p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")
  a = p.parse_args(argv)
  cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
  if not cmd:
    p.error("give the command to run after --")
  if a.num_processes < 1 or a.devices_per_process < 1:
    p.error("--num-processes and --devices-per-process must be >= 1")
  port = a.port or (free_port() if not a.dry_run else 12355)
  envs = [process_env(i, a.num_processes, port, a.devices_per_process) for i in range(a.num_processes)]
  if a.dry_run:
    for i, env in enumerate(envs):
      print(describe(i, env, cmd))
    return 0

  procs = []
  for i, env in enumerate(envs):
    procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, bufsize=1))

  def pump(i, proc):
    for line in proc.stdout:
      sys.stdout.write(f"[p{i}] {line}")
      sys.stdout.flush()

  threads = [threading.Thread(target=pump, args=(i, pr), daemon=True) for i, pr in enumerate(procs)]
  for t in threads:
    t.start()

  def forward(signum, frame):
    for pr in procs:
      if pr.poll() is None:
        pr.send_signal(signum)

  signal.signal(signal.SIGINT, forward)
  signal.signal(signal.SIGTERM, forward)
  code = 0
  remaining = set(range(len(procs)))
  while remaining:
    for i in list(remaining):
      rc = procs[i].poll()
      if rc is None:
        continue
      remaining.discard(i)
      if rc != 0 and code == 0:
        code = rc
        sys.stdout.write(f"[launch] process {i} exited with {rc}; stopping the others\n")
        for j in remaining:
          procs[j].terminate()
    threading.Event().wait(0.1)
  for t in threads:
    t.join(timeout=5)
  return code


if __name__ == "__main__":
  sys.exit(main())
