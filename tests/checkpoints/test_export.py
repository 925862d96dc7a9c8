"""safetensors files, params-only folders and `python -m mdlm_jax.export`."""

import json
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.conftest import REPO, xla_flags
from mdlm_jax.checkpoints import params_only, safetensors
from mdlm_jax import checkpoints


def _random_tensors(rng):
  return {
      "w.f32": rng.standard_normal((3, 5)).astype(np.float32),
      "w.bf16": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
      "ids": rng.integers(-50, 50, (2, 2, 2)).astype(np.int32),
      "flags": rng.random(4) > 0.5,
      "scalar": np.array(rng.standard_normal(), np.float64),
  }


def test_safetensors_layout_by_hand(tmp_path):
  """The bytes follow the published layout, read here with struct and json alone."""
  rng = np.random.default_rng()
  tensors = _random_tensors(rng)
  path = str(tmp_path / "m.safetensors")
  safetensors.save(path, tensors, {"note": "x"})
  raw = open(path, "rb").read()
  (n,) = struct.unpack("<Q", raw[:8])
  assert (8 + n) % 8 == 0
  header = json.loads(raw[8:8 + n])
  assert header.pop("__metadata__") == {"note": "x"}
  names = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "BOOL": "|b1"}
  end = 0
  for name, t in tensors.items():
    info = header[name]
    begin, stop = info["data_offsets"]
    assert info["shape"] == list(t.shape)
    chunk = raw[8 + n + begin:8 + n + stop]
    if info["dtype"] == "BF16":  # the top 16 bits of the float32 value
      got = (np.frombuffer(chunk, "<u2").astype(np.uint32) << 16).view(np.float32)
      np.testing.assert_array_equal(got, t.astype(np.float32))
    else:
      np.testing.assert_array_equal(np.frombuffer(chunk, names[info["dtype"]]).reshape(t.shape), t)
    end = max(end, stop)
  assert 8 + n + end == len(raw)


def test_safetensors_round_trip_and_errors(tmp_path):
  rng = np.random.default_rng()
  tensors = _random_tensors(rng)
  path = str(tmp_path / "m.safetensors")
  safetensors.save(path, tensors)
  back, meta = safetensors.load(path)
  assert meta == {} and set(back) == set(tensors)
  for k in tensors:
    assert back[k].dtype == tensors[k].dtype
    np.testing.assert_array_equal(back[k], tensors[k])
  raw = open(path, "rb").read()
  for bad, message in [(raw[:5], "too short"), (struct.pack("<Q", 10**12) + raw[8:], "exceeds the file"),
                       (raw[:8] + b"x" + raw[9:], "not JSON"), (raw[:-4], "does not fit")]:
    open(path, "wb").write(bad)
    with pytest.raises(safetensors.SafetensorsError, match=message):
      safetensors.load(path)
  with pytest.raises(safetensors.SafetensorsError, match="no safetensors name"):
    safetensors.save(path, {"c": np.zeros(2, np.complex64)})
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]  # nothing half-written left


def export_folder(*args):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  return subprocess.run([sys.executable, "-m", "mdlm_jax.export", *args], capture_output=True, text=True,
                        env=env, timeout=240, cwd=REPO)


def _logits(loaded, tokens):
  model = loaded.model
  t = jnp.full((tokens.shape[0],), 0.5)
  return np.asarray(model(tokens, t if model.cfg.time_conditioning else None))


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_export_cli_bfloat16_and_float32(tiny_checkpoints, tmp_path, capsys):
  from mdlm_jax import export
  src = checkpoints.load(tiny_checkpoints["mdlm"])
  export.main([f"--checkpoint={tiny_checkpoints['mdlm']}", f"--out={tmp_path / 'bf16'}"])
  assert "bfloat16" in capsys.readouterr().out
  bf = checkpoints.load(str(tmp_path / "bf16"))
  assert bf.step == src.step and bf.tokenizer.to_bytes() == src.tokenizer.to_bytes()
  for k, want in params_only.flatten(src.params).items():  # exactly the bfloat16 rounding of the EMA
    got = params_only.flatten(bf.params)[k]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(ml_dtypes.bfloat16).astype(np.float32))
  export.main([f"--checkpoint={tiny_checkpoints['mdlm']}", f"--out={tmp_path / 'f32'}", "--dtype=float32"])
  f32 = checkpoints.load(str(tmp_path / "f32"))
  tokens = jnp.asarray(np.random.default_rng().integers(0, src.tokenizer.vocab_size, (2, 16)))
  np.testing.assert_array_equal(_logits(f32, tokens), _logits(src, tokens))
  meta = json.load(open(tmp_path / "f32" / "config.json"))
  assert meta["weights"] == "ema" and meta["num_params"] == sum(x.size for x in jax.tree.leaves(src.params))


def test_export_errors(tiny_checkpoints, tmp_path):
  from mdlm_jax import export
  out = tmp_path / "m"
  export.main([f"--checkpoint={tiny_checkpoints['ar']}", f"--out={out}"])
  r = export_folder(f"--checkpoint={tiny_checkpoints['ar']}", f"--out={out}")
  assert r.returncode != 0 and "already exists" in r.stderr and "Traceback" not in r.stderr
  export.main([f"--checkpoint={tiny_checkpoints['ar']}", f"--out={out}", "--overwrite"])
  r = export_folder(f"--checkpoint={tmp_path / 'nope'}", f"--out={tmp_path / 'x'}")
  assert r.returncode != 0 and "does not exist" in r.stderr and not (tmp_path / "x").exists()
  meta = json.load(open(out / "config.json"))
  meta["config"]["model"]["embed_dim"] *= 2
  json.dump(meta, open(out / "config.json", "w"))
  with pytest.raises(params_only.ParamsFileError, match="has shape"):
    checkpoints.load(str(out))
  os.remove(out / "tokenizer.model")
  with pytest.raises(params_only.ParamsFileError, match="lacks tokenizer.model"):
    checkpoints.load(str(out))


def test_frozen_base_raises_naming_a_missing_stage(tmp_path):
  """An adapter stage whose origin is gone is an error that names the chain, not a base: an
  adapters-only export would otherwise record a folder that no longer exists."""
  import ml_collections
  from mdlm_jax.checkpoints.loading import frozen_base
  stage = tmp_path / "stage"  # an adapters-only folder: config.json naming its base, and weights
  stage.mkdir()
  (stage / "config.json").write_text(json.dumps({"base": str(tmp_path / "gone")}))
  safetensors.save_folder(str(stage), {"w": np.zeros(2, np.float32)}, max_shard_bytes=2**20)
  config = ml_collections.ConfigDict({"train": {"init_from": str(stage)}})
  with pytest.raises(FileNotFoundError, match=f"'{tmp_path / 'gone'}'.*followed {stage} -> {tmp_path / 'gone'}"):
    frozen_base(config)
  config.train.init_from = str(tmp_path / "never")
  with pytest.raises(FileNotFoundError, match="never"):
    frozen_base(config)
  (tmp_path / "gone").mkdir()  # a folder with no checkpoint in it is read whole by `load`, which says what is wrong
  config.train.init_from = str(stage)
  assert frozen_base(config) == str(tmp_path / "gone")
