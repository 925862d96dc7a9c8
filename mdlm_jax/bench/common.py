"""What the benchmark commands share: output flags, list flags, result files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time


class Progress:
  """`what: done/total, per second, ETA` on stderr about every tenth of the
  work (and at its end): long benchmarks show they are moving."""

  def __init__(self, what: str, total: int):
    self.what, self.total, self.t0, self.done = what, total, time.perf_counter(), 0
    self.every = max(1, total // 10)
    self._lock = threading.Lock()  # worker threads advance it

  def advance(self, n: int = 1) -> None:
    with self._lock:
      before, self.done = self.done, self.done + n
      if self.total <= 1:  # one item: its end says nothing a caller's own progress does not
        return
      if self.done // self.every == before // self.every and self.done < self.total:
        return
      rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
      eta = (self.total - self.done) / rate if rate > 0 else float("nan")
      print(f"{self.what}: {self.done}/{self.total}, {rate:.2f}/s, ETA {eta:.0f}s", file=sys.stderr, flush=True)


def rotation(names: list, i: int) -> list:
  """`names` started at item i (mod their count): the order of round i of an
  interleaved comparison, so that no side always runs first."""
  k = i % len(names)
  return names[k:] + names[:k]


def add_output_flags(p: argparse.ArgumentParser, png: str | None = None, png_help: str = "plot") -> None:
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--out", default=None, help="also write the JSON to this file")
  if png is not None:
    p.add_argument("--png", default=png, help=f"{png_help} ('' to skip)")


def positive_ints(p: argparse.ArgumentParser, flag: str, value: str) -> list[int]:
  """'1,4,16' -> [1, 4, 16], or a parser error naming the flag."""
  try:
    out = [int(x) for x in value.split(",")]
  except ValueError:
    p.error(f"{flag} must be comma-separated integers, got {value!r}")
  if min(out) < 1:
    p.error(f"{flag} must be positive, got {value!r}")
  return out


def save_figure(fig, path: str) -> None:
  """Written under a temporary name and renamed: never half a PNG."""
  import matplotlib.pyplot as plt
  tmp = path + ".tmp.png"
  fig.savefig(tmp)
  plt.close(fig)
  os.replace(tmp, path)


def emit(result: dict, a: argparse.Namespace) -> None:
  if a.out:
    with open(a.out, "w") as f:
      f.write(json.dumps(result, indent=2) + "\n")
  print(json.dumps(result, indent=None if a.json else 2))


def finish(result: dict, a: argparse.Namespace, plot) -> None:
  """The plot (when --png is set, its path recorded in the result), then the JSON."""
  if a.png:
    plot(result, a.png)
    result["png"] = a.png
  emit(result, a)


def load_checkpoint(path: str | None, command: str):
  """(path, loaded) of `path`, or of the packaged model when None; a bad
  path ends the command with its error, as the CLIs do."""
  from mdlm_jax import checkpoints, cli
  from mdlm_jax.checkpoints import packaged
  try:
    path = path or packaged.path()
    return path, checkpoints.load(path)
  except cli.USER_ERRORS as e:
    cli.fail(command, e)


def free_port() -> int:
  """A port on 127.0.0.1 that nothing listens on now (for a server in this process)."""
  import socket
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]
