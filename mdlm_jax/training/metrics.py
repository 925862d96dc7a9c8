"""Progress lines, a JSONL metrics log and a loss-curve PNG in the workdir."""

from __future__ import annotations

import json
import os
import time


def format_duration(seconds: float) -> str:
  seconds = max(0, int(seconds))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsLog:
  """Appends one JSON object per line; safe to reopen after a resume."""

  def __init__(self, path: str, enabled: bool = True):
    self.path, self.enabled = path, enabled

  def write(self, record: dict):
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps({"time": time.time(), **record}) + "\n")

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(records: list[dict], png_path: str, title: str = "") -> None:
  """Train (and eval, when present) loss against step, written atomically."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train = [r for r in records if r.get("kind") == "train"]
  evals = [r for r in records if r.get("kind") == "eval"]
  if not train and not evals:
    return
  fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
  if train:
    ax.plot([r["step"] for r in train], [r["bits_per_token"] for r in train], label="train", lw=1.2)
  if evals:
    ax.plot([r["step"] for r in evals], [r["bits_per_token"] for r in evals], "o-", label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("bits / token (NELBO or NLL)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  tmp = png_path + ".tmp.png"
  fig.savefig(tmp)
  plt.close(fig)
  os.replace(tmp, png_path)
