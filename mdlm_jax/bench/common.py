"""What the benchmark commands share: output flags, list flags, result files."""

from __future__ import annotations

import argparse
import json
import os


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
