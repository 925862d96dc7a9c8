"""bench passkey: the rows plant one key where the model must find it; the
command trains, stretches RoPE by each method and reports every run."""

import json

import numpy as np
import pytest

from mdlm_jax.bench import passkey


def test_rows_hold_the_marker_twice_and_the_key_after_the_first():
  rng = np.random.default_rng(0)
  filler = passkey.filler_bytes(0)
  assert not np.isin(filler, [passkey.MARKER, *passkey.KEYS]).any()  # the filler never says the key
  rows, keys = passkey.make_rows(filler, rng, 16, 300)
  for row, key in zip(rows, keys):
    at = np.flatnonzero(row == passkey.MARKER)
    assert len(at) == 2 and at[1] == 299 and row[at[0] + 1] == key
    assert np.isin(row, passkey.KEYS).sum() == 1


def test_scalings_stretch_by_the_length_ratio():
  s = passkey.scaling_for("yarn", 4096, 512)
  assert (s.type, s.factor, s.max_position) == ("yarn", 8.0, 512)
  assert passkey.scaling_for("default", 4096, 512).type == "default"


@pytest.mark.slow  # trains and compiles five scalings
def test_the_command_reports_every_method_and_length(tmp_path):
  out = tmp_path / "p.json"
  passkey.main(["--train-length=64", "--steps=2", "--batch=2", "--lengths=128", "--trials=2", f"--out={out}",
                f"--png={tmp_path / 'p.png'}", "--json"])
  res = json.loads(out.read_text())
  assert [(r["method"], r["length"]) for r in res["runs"]] == [(m, 128) for m in passkey.METHODS]
  assert all(0.0 <= r["accuracy"] <= 1.0 for r in res["runs"]) and len(res["train_losses"]) == 2
  assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
