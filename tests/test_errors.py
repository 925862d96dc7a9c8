"""Bad input gets one clear line naming what is wrong, and a non-zero exit."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, load_config, xla_flags
from mdlm_jax import config as config_lib
from mdlm_jax.checkpoints import checkpointer
from mdlm_jax.training import trainer
from mdlm_jax import checkpoints


def run_module(*args, timeout=240):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env,
                        timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("field,value,message", [
    ("model.num_heads", 5, "model.embed_dim: 64 is not divisible by model.num_heads=5"),
    ("model.mlp", "relu", "model.mlp: must be one of"),
    ("diffusion.schedule", "sqrt", "diffusion.schedule: must be one of"),
    ("optim.learning_rate", -1.0, "optim.learning_rate: must be positive"),
    ("data.tokenizer_vocab_size", 100, "data.tokenizer_vocab_size: must be >= 300"),
    ("mesh.data", 0, "mesh.data: must be -1 or a positive int"),
    ("objective", "gpt", "objective: must be one of"),
    ("data.fim_level", "row", "data.fim_level: must be 'document' or 'context'"),
    ("data.length_buckets", "256", "data.length_buckets: only chat runs"),
    ("data.length_buckets", "a,b", "data.length_buckets must be comma-separated integers"),
])
def test_bad_config_values(field, value, message):
  c = load_config("tiny")
  section, _, name = field.rpartition(".")
  (c[section] if section else c)[name] = value
  with pytest.raises(config_lib.ConfigError, match=message.replace("(", r"\(")):
    config_lib.validate(c)


def test_length_buckets_fit_the_rows_and_the_blocks():
  c = load_config("tiny")
  c.data.update(kind="chat", chat_template="chatml", length_buckets="16,32")
  config_lib.validate(c)
  c.data.length_buckets = "16,32,64"
  with pytest.raises(config_lib.ConfigError, match=r"must be in \[8, seq_len=64\)"):
    config_lib.validate(c)
  c.data.length_buckets = "20"
  c.diffusion.block_size = 8
  c.model.time_conditioning = False
  with pytest.raises(config_lib.ConfigError, match="multiple of diffusion.block_size=8"):
    config_lib.validate(c)


def test_ar_objective_needs_causal_model():
  c = load_config("tiny")
  c.objective = "ar"
  with pytest.raises(config_lib.ConfigError, match="model.causal"):
    config_lib.validate(c)


def test_cli_bad_config_is_one_line(tmp_path):
  r = run_module("mdlm_jax.train", "--config=configs/tiny.py", f"--workdir={tmp_path}",
                 "--config.optim.grad_clip=-1")
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1] == "train: error: config.optim.grad_clip: must be >= 0 (0 disables)"
  assert "Traceback" not in r.stderr


def test_cli_missing_corpus(tmp_path):
  missing = tmp_path / "no_such_corpus"
  r = run_module("mdlm_jax.train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'w'}",
                 f"--config.data.corpus={missing}")
  assert r.returncode != 0
  assert "Traceback" not in r.stderr
  assert str(missing) in r.stderr.strip().splitlines()[-1]


def test_batch_not_divisible_by_mesh(tiny_config, tmp_path):
  tiny_config.data.batch_size = 6
  tiny_config.mesh.update(data=4, fsdp=1, tensor=1)
  import jax
  if jax.device_count() != 4:
    pytest.skip("needs 4 host devices")
  with pytest.raises(config_lib.ConfigError, match="batch_size=6"):
    trainer.train(tiny_config, str(tmp_path))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer_path):
  c = load_config("tiny")
  c.data.tokenizer = tiny_tokenizer_path
  c.train.update(num_steps=3, checkpoint_every=3, log_every=1, eval_batches=1)
  workdir = str(tmp_path_factory.mktemp("trained"))
  trainer.train(c, workdir)
  return workdir


def test_corrupt_checkpoint_is_named(trained, tmp_path):
  import shutil
  bad = tmp_path / "bad"
  shutil.copytree(trained, bad)
  root, step = checkpointer.resolve(str(bad))
  weights = os.path.join(root, str(step), "weights")
  for dirpath, _, files in os.walk(weights):
    for name in files:
      if "ocdbt" in dirpath or name.startswith("manifest") or dirpath.endswith("/d"):
        with open(os.path.join(dirpath, name), "wb") as f:
          f.write(b"garbage")
  with pytest.raises(checkpointer.CheckpointError, match="weights unreadable"):
    checkpoints.load(str(bad))
  r = run_module("mdlm_jax.eval", f"--checkpoint={bad}")
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert "eval: error: checkpoint" in r.stderr and "weights unreadable" in r.stderr

  meta = os.path.join(root, str(step), "meta", "metadata")
  with open(meta, "w") as f:
    f.write("{not json")
  with pytest.raises(checkpointer.CheckpointError, match="metadata unreadable"):
    checkpoints.load(str(bad))


def test_missing_checkpoint(tmp_path):
  r = run_module("mdlm_jax.eval", f"--checkpoint={tmp_path / 'nothing'}")
  assert r.returncode != 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr
  with pytest.raises(checkpointer.CheckpointError, match="no checkpoint found"):
    checkpointer.resolve(str(tmp_path))


@pytest.mark.slow
def test_eval_cli_json_and_data_flag(trained, tmp_path):
  import json
  data_file = tmp_path / "eval.jsonl"
  src = "".join(open(os.path.join(os.path.dirname(os.__file__), "json", name)).read()
                for name in ("decoder.py", "encoder.py"))
  with open(data_file, "w") as f:
    for i in range(8):
      f.write(json.dumps({"body": src[i * 2000:(i + 1) * 2000]}) + "\n")
  r = run_module("mdlm_jax.eval", f"--checkpoint={trained}", f"--data={data_file}", "--text_field=body",
                 "--num_batches=1", "--json")
  assert r.returncode == 0, r.stderr
  res = json.loads(r.stdout.strip().splitlines()[-1])
  assert res["bound"] and res["step"] == 3 and res["tokens"] == 8 * 64
  assert abs(res["bits_per_token"] * 0.6931471805599453 - res["nats_per_token"]) < 1e-9
  r2 = run_module("mdlm_jax.eval", f"--checkpoint={trained}", f"--data={data_file}", "--text_field=body",
                  "--num_batches=1", "--json", "--profile=2")
  again = json.loads(r2.stdout.strip().splitlines()[-1])
  assert again["nats_per_token"] == res["nats_per_token"]  # seeded
  profile = again["profile"]  # MDLM: by noise level only
  assert profile["t"] == [0.25, 0.75] and len(profile["by_t"]) == 2 and "by_t_and_block_position" not in profile
  assert abs(profile["nats_per_token"] - sum(profile["by_t"]) / 2) < 1e-9 and profile["tokens"] == 8 * 64
  r3 = run_module("mdlm_jax.eval", f"--checkpoint={trained}", f"--data={data_file}", "--text_field=nope")
  assert r3.returncode != 0 and "'nope'" in r3.stderr and "Traceback" not in r3.stderr
  # --seq_len: rows of that many tokens (an imported model's config says its whole context)
  r4 = run_module("mdlm_jax.eval", f"--checkpoint={trained}", f"--data={data_file}", "--text_field=body",
                  "--num_batches=1", "--json", "--seq_len=32")
  short = json.loads(r4.stdout.strip().splitlines()[-1])
  assert res["seq_len"] == 64 and short["seq_len"] == 32 and short["tokens"] == 8 * 32
  r5 = run_module("mdlm_jax.eval", f"--checkpoint={trained}", f"--data={data_file}", "--text_field=body",
                  "--seq_len=0")
  assert r5.returncode != 0 and "--seq_len must be >= 1" in r5.stderr and "Traceback" not in r5.stderr
