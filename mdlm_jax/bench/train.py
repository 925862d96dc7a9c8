"""Training throughput and MFU of a config on this machine, with peak RSS.

The peak is measured in the same run (a large float32 matmul, the best of
three sizes), so MFU is against what this machine actually delivers.
Runs the real training loop (data pipeline included) in a scratch workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench train")
  p.add_argument("--config", default=None, help="config file (default: configs/code_small.py of the package)")
  p.add_argument("--steps", type=int, default=20, help="training steps to time (after the first)")
  p.add_argument("--log-every", type=int, default=5)
  p.add_argument("--batch-size", type=int, default=None, help="override config.data.batch_size")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--out", default=None, help="also write the JSON to this file")
  a = p.parse_args(argv)
  if a.steps < 2:
    p.error("--steps must be >= 2")
  return a


def default_config_path() -> str:
  here = os.path.dirname(os.path.abspath(__file__))
  return os.path.join(here, "..", "..", "configs", "code_small.py")


def load_config(path: str):
  from mdlm_jax.config import load_config_file
  return load_config_file(path)


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  from mdlm_jax.parallel import runtime

  path = a.config or default_config_path()
  try:
    c = load_config(path)
  except FileNotFoundError as e:
    print(f"bench train: error: {e}", file=sys.stderr)
    sys.exit(2)
  if a.batch_size:
    c.data.batch_size = a.batch_size
  runtime.split_cpu_into_devices(c.data.batch_size // c.optim.grad_accum_steps)
  import jax
  from mdlm_jax.training import flops, trainer
  peaks = {n: flops.measure_matmul_peak(n) for n in (512, 1024, 2048)}
  peak = max(peaks.values())
  c.train.update(num_steps=a.steps + 1, log_every=a.log_every, checkpoint_every=10 ** 9, eval_every=0,
                 eval_batches=1, peak_flops_per_device=peak / jax.device_count())
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.time()
    out = trainer.train(c, workdir)
    wall = time.time() - t0
  tp = out["throughput"]
  result = {
      "bench": "train", "config": os.path.relpath(path), "backend": jax.default_backend(),
      "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
      "params": tp["params"], "batch_size": c.data.batch_size, "seq_len": c.data.seq_len,
      "timed_steps": tp["timed_steps"], "tokens_per_s": tp["tokens_per_s"], "mfu": tp["mfu"],
      "train_flops_per_token": tp["train_flops_per_token"],
      "matmul_peak_flops": peak, "matmul_peak_by_size": {str(k): v for k, v in peaks.items()},
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "wall_s": wall,
      "final_loss": out["train"].get("loss"),
  }
  text = json.dumps(result, indent=None if a.json else 2)
  if a.out:
    with open(a.out, "w") as f:
      f.write(json.dumps(result, indent=2) + "\n")
  if a.json:
    print(text)
  else:
    print(f"{result['config']}: {result['params'] / 1e6:.1f}M params, {result['tokens_per_s']:,.0f} tokens/s,"
          f" MFU {100 * result['mfu']:.1f}% of a measured {peak / 1e9:.0f} GFLOP/s float32 matmul peak,"
          f" peak RSS {result['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
  main(sys.argv[1:])
