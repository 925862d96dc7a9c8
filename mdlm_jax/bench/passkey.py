"""Passkey retrieval: a key planted in filler code, asked for at the end.

  python -m mdlm_jax.bench passkey [--train-length 512] [--steps 600] [--lengths 4096,16384,32768]
      [--trials 8] [--json] [--out F.json] [--png F.png]

A small causal model (bytes as tokens) is trained from scratch for --steps
on rows of --train-length: real standard-library source as filler, with a
marker byte followed by a key byte (one of KEYS) somewhere in it and the
marker again at the end; the loss is on the byte after that last marker,
so the model learns to find the earlier marker and copy what follows it.
It is then asked at each of --lengths, much longer than it trained on, with
RoPE as trained and stretched by each scaling method (`model/rope.py`:
linear, dynamic NTK, YaRN, Llama 3, factor = length / trained length), with
no further training. Reported: accuracy at the trained length and per
method and length over --trials rows, the key at a random depth in each.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from mdlm_jax.bench.common import add_output_flags, finish, positive_ints, save_figure

MARKER = 1  # a byte no source file holds
KEYS = np.arange(2, 10)  # control bytes, equally absent from the filler
METHODS = ("default", "linear", "dynamic", "yarn", "llama3")


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench passkey")
  p.add_argument("--train-length", type=int, default=512)
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--lengths", default="4096,16384,32768")
  p.add_argument("--trials", type=int, default=8, help="rows per method and length")
  p.add_argument("--seed", type=int, default=0)
  add_output_flags(p, "bench_passkey.png", "accuracy per scaling method and length")
  a = p.parse_args(argv)
  a.lengths = positive_ints(p, "--lengths", a.lengths)
  if min(a.train_length, a.steps, a.batch, a.trials) < 1 or a.train_length < 64:
    p.error("--train-length >= 64, and --steps, --batch and --trials >= 1")
  return a


def filler_bytes(seed: int) -> np.ndarray:
  """Standard-library source as bytes, without the marker and key bytes."""
  from mdlm_jax import data
  docs = data.load_documents("stdlib", "train", 0.05)
  rng = np.random.default_rng(seed)
  text = "\n".join(docs[i] for i in rng.permutation(len(docs))[:400]).encode("utf-8", "replace")
  arr = np.frombuffer(text, np.uint8).astype(np.int32)
  return arr[arr >= 10]


def make_rows(filler: np.ndarray, rng: np.random.Generator, n: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """(rows [n, length], keys [n]): filler, MARKER key at a random depth,
  MARKER as the last token (the answer is the key, to follow it)."""
  rows = np.empty((n, length), np.int32)
  keys = rng.choice(KEYS, n)
  for i in range(n):
    start = rng.integers(0, len(filler) - length)
    rows[i] = filler[start:start + length]
    at = rng.integers(0, length - 3)
    rows[i, at:at + 2] = (MARKER, keys[i])
    rows[i, -1] = MARKER
  return rows, keys


def model_config(scaling=None):
  from mdlm_jax.model import ModelConfig
  from mdlm_jax.model.rope import RopeScaling
  return ModelConfig(vocab_size=256, num_layers=2, embed_dim=128, num_heads=4, mlp_dim=256, causal=True,
                     rope_scaling=scaling or RopeScaling())


def train(a, filler) -> tuple[dict, list[float]]:
  import jax
  import jax.numpy as jnp
  import optax
  from mdlm_jax.model.spec import bind, init_params, model_spec
  spec = model_spec(model_config(), None)
  params = init_params(spec, a.seed)
  warmup = min(50, a.steps // 4)
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, max(a.steps, warmup + 1)),
                    weight_decay=0.01)
  state = opt.init(params)

  @jax.jit
  def step(params, state, rows, keys):
    def loss(p):
      logits = bind(spec, p)(rows)[:, -1].astype(jnp.float32)
      return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, keys[:, None], -1)[:, 0])
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  rng = np.random.default_rng(a.seed)
  losses, t0 = [], time.perf_counter()
  for i in range(a.steps):
    rows, keys = make_rows(filler, rng, a.batch, a.train_length)
    params, state, value = step(params, state, jnp.asarray(rows), jnp.asarray(keys))
    losses.append(float(value))
    if (i + 1) % 50 == 0 or i + 1 == a.steps:
      rate = (i + 1) / (time.perf_counter() - t0)
      print(f"step {i + 1:>5}/{a.steps}  loss {np.mean(losses[-50:]):.4f}  {rate:.1f} steps/s"
            f"  ETA {(a.steps - i - 1) / rate:.0f}s", file=sys.stderr, flush=True)
  return params, losses


def accuracy(params, scaling, rows: np.ndarray, keys: np.ndarray) -> float:
  import jax
  import jax.numpy as jnp
  from mdlm_jax.model.spec import bind, model_spec
  spec = model_spec(model_config(scaling), None)

  @jax.jit
  def answer(params, row):
    return jnp.argmax(bind(spec, params)(row[None])[0, -1])

  return float(np.mean([int(answer(params, jnp.asarray(r))) == k for r, k in zip(rows, keys)]))


def scaling_for(method: str, length: int, trained: int):
  from mdlm_jax.model.rope import RopeScaling
  if method == "default":
    return RopeScaling()
  return RopeScaling(type=method, factor=max(length / trained, 1.0), max_position=trained)


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
  ax_l.plot(result["train_losses"])
  ax_l.set_xlabel("step")
  ax_l.set_ylabel("loss on the key (nats)")
  ax_l.set_title(f"training at {result['train_length']} tokens")
  for method in METHODS:
    rows = [r for r in result["runs"] if r["method"] == method]
    ax_a.plot([r["length"] for r in rows], [r["accuracy"] for r in rows], "o-", label=method)
  ax_a.axhline(1 / len(KEYS), color="gray", ls="--", label="chance")
  ax_a.set_xscale("log", base=2)
  ax_a.set_xlabel("context tokens")
  ax_a.set_ylabel("retrieval accuracy")
  ax_a.set_ylim(-0.05, 1.05)
  ax_a.legend()
  fig.tight_layout()
  save_figure(fig, path)


def main(argv):
  a = parse(argv)
  from absl import logging
  logging.set_verbosity(logging.ERROR)
  filler = filler_bytes(a.seed)
  t0 = time.perf_counter()
  params, losses = train(a, filler)
  rng = np.random.default_rng(a.seed + 1)
  rows, keys = make_rows(filler, rng, 4 * a.trials, a.train_length)
  result = {"bench": "passkey", "train_length": a.train_length, "steps": a.steps, "batch": a.batch,
            "model": dataclasses.asdict(model_config()) | {"rope_scaling": None},
            "train_seconds": time.perf_counter() - t0, "train_losses": losses,
            "accuracy_at_train_length": accuracy(params, scaling_for("default", a.train_length, a.train_length),
                                                 rows, keys),
            "chance": 1 / len(KEYS), "trials": a.trials, "runs": []}
  print(f"accuracy at {a.train_length}: {result['accuracy_at_train_length']:.3f}", file=sys.stderr, flush=True)
  for length in a.lengths:
    rows, keys = make_rows(filler, rng, a.trials, length)
    for method in METHODS:
      t1 = time.perf_counter()
      acc = accuracy(params, scaling_for(method, length, a.train_length), rows, keys)
      result["runs"].append({"method": method, "length": length, "accuracy": acc,
                             "seconds": time.perf_counter() - t1})
      print(f"{method:>8} L={length:>6}: accuracy {acc:.3f}", file=sys.stderr, flush=True)
  finish(result, a, plot)


if __name__ == "__main__":
  main(sys.argv[1:])
