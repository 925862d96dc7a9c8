"""End-to-end training: the loss falls, both objectives train, checkpoints resume exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.conftest import REPO, xla_flags
from mdlm_jax.checkpoints import checkpointer
from mdlm_jax.training import trainer
from mdlm_jax import checkpoints


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("objective", [pytest.param("mdlm", marks=pytest.mark.slow),
                                       pytest.param("ar", marks=pytest.mark.slow)])
def test_loss_falls(tiny_config, tmp_path, objective):
  c = tiny_config
  c.objective = objective
  c.model.causal = objective == "ar"
  c.train.update(num_steps=60, log_every=1, checkpoint_every=1000)
  out = trainer.train(c, str(tmp_path))
  train = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
  assert len(train) == 60
  first = np.mean([r["loss"] for r in train[:5]])
  last = np.mean([r["loss"] for r in train[-5:]])
  # Uniform guessing over 512 pieces is ln 512 = 6.2 nats; 60 steps must learn
  # the unigram statistics of code at least.
  assert first - last > 1.0, (first, last)
  assert np.isfinite(out["eval"]["nats_per_token"])
  assert out["eval"]["bound"] == (objective == "mdlm")
  assert os.path.exists(tmp_path / "loss.png")
  assert checkpointer.resolve(str(tmp_path))[1] == 60


def _final_params(workdir):
  loaded = checkpoints.load(workdir, use_ema=False)
  ema = checkpoints.load(workdir, use_ema=True)
  return jax.tree.leaves(loaded.params), jax.tree.leaves(ema.params)


def _run_cli(workdir, tok, steps, extra=(), wait=True):
  cmd = [sys.executable, "-m", "mdlm_jax.train", f"--config={REPO}/configs/tiny.py", f"--workdir={workdir}",
         f"--config.data.tokenizer={tok}", f"--config.train.num_steps={steps}",
         "--config.train.checkpoint_every=10", "--config.train.log_every=5", *extra]
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  if wait:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_for_checkpoint(workdir, proc, timeout=180):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if checkpointer.saved_steps(os.path.join(workdir, "checkpoints")):
      return
    if proc.poll() is not None:
      raise AssertionError(f"training exited early:\n{proc.stdout.read()}")
    time.sleep(0.2)
  raise AssertionError("no checkpoint appeared")


@pytest.mark.slow  # a minute of training subprocesses; the default run checks the data-iterator resume
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_kill_and_resume_is_exact(tiny_tokenizer_path, tmp_path, how):
  """An interrupted run resumed from its checkpoint ends with bit-identical
  params (raw and EMA) to an uninterrupted one: same batches, same keys."""
  steps = 40
  ref = tmp_path / "ref"
  r = _run_cli(ref, tiny_tokenizer_path, steps)
  assert r.returncode == 0, r.stderr

  run = tmp_path / "run"
  proc = _run_cli(run, tiny_tokenizer_path, steps, wait=False)
  _wait_for_checkpoint(str(run), proc)
  proc.send_signal(how)
  out = proc.communicate(timeout=120)[0]
  saved = checkpointer.saved_steps(os.path.join(run, "checkpoints"))
  if how == signal.SIGINT:
    assert proc.returncode == 0, out
    assert "saved checkpoint at step" in out
  assert saved and saved[-1] <= steps
  r = _run_cli(run, tiny_tokenizer_path, steps)
  assert r.returncode == 0, r.stderr
  if saved[-1] < steps:
    assert f"resumed from {run} at step {saved[-1]}" in r.stdout

  for a, b in zip(_final_params(str(ref)), _final_params(str(run))):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ref_train = {r["step"]: r["loss"] for r in read_metrics(ref) if r["kind"] == "train"}
  run_train = {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}
  for s, loss in run_train.items():
    assert loss == ref_train[s], s


@pytest.mark.slow  # 15 s
def test_a_resumed_run_restores_without_a_random_initialisation(tiny_config, tmp_path, monkeypatch):
  """Resuming fills zeros of the params' shapes from the checkpoint: the whole
  model's random initialisation (minutes of compiling on a GPU) never runs."""
  tiny_config.train.update(num_steps=2, checkpoint_every=2, log_every=1, eval_every=0, eval_batches=1)
  trainer.train(tiny_config, str(tmp_path / "run"))
  saved = _final_params(str(tmp_path / "run"))

  def no_random_init(*args, **kwargs):
    raise AssertionError("a resumed run ran the random initialisation")

  monkeypatch.setattr(trainer, "init_params", no_random_init)
  tiny_config.train.update(num_steps=3)
  out = trainer.train(tiny_config, str(tmp_path / "run"))
  assert out["step"] == 3
  moved = _final_params(str(tmp_path / "run"))
  assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for a, b in zip(saved, moved) for x, y in zip(a, b))


@pytest.mark.slow
def test_resume_rejects_a_different_model(tiny_config, tmp_path):
  c = tiny_config
  c.train.update(num_steps=2, checkpoint_every=1, log_every=1)
  trainer.train(c, str(tmp_path))
  c.model.embed_dim = 96
  c.train.num_steps = 4
  with pytest.raises(checkpointer.CheckpointError, match="model.embed_dim"):
    trainer.train(c, str(tmp_path))


def test_resume_reads_a_model_field_the_checkpoint_predates_as_its_default(tiny_config):
  """A checkpoint written before a model field existed trained with its default."""
  import json
  saved = json.loads(tiny_config.to_json_best_effort())
  del saved["model"]["rope_scaling"]
  trainer.check_same_model(saved, tiny_config)
  tiny_config.model.rope_scaling.update(type="linear", factor=2.0)
  with pytest.raises(checkpointer.CheckpointError, match="model.rope_scaling"):
    trainer.check_same_model(saved, tiny_config)


@pytest.mark.slow  # a training run from AR weights (about 15 s)
def test_init_from_starts_a_diffusion_run_from_ar_weights(tiny_checkpoints, tmp_path):
  """train.init_from: the AR twin's weights (EMA) become step 0 of an MDLM run,
  with its tokenizer; a different network shape is refused by parameter name."""
  from tests.conftest import load_config
  src = checkpoints.load(tiny_checkpoints["ar"])
  c = load_config("tiny")
  c.train.update(num_steps=1, checkpoint_every=1, log_every=1, eval_batches=1,
                 init_from=tiny_checkpoints["ar"])
  c.optim.update(learning_rate=1e-9, warmup_steps=0, ema_decay=0.0)
  trainer.train(c, str(tmp_path / "adapted"))
  got = checkpoints.load(str(tmp_path / "adapted"))
  assert got.tokenizer.to_bytes() == src.tokenizer.to_bytes()
  assert not got.spec.cfg.causal and src.spec.cfg.causal
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(src.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  assert any(np.abs(np.asarray(b)).max() > 1e-3 for b in jax.tree.leaves(src.params))

  c.model.mlp_dim = c.model.mlp_dim * 2
  with pytest.raises(Exception, match="has shape"):
    trainer.train(c, str(tmp_path / "wider"))
  c.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="init_from"):
    trainer.train(c, str(tmp_path / "nothing"))


def _instruction_folder(path, records_of, sizes=(40, 16)):
  """A chat run's folder: train.jsonl and heldout.jsonl with records_of(i) for
  each of their examples."""
  path.mkdir()
  for name, n in zip(("train.jsonl", "heldout.jsonl"), sizes):
    (path / name).write_text("".join(json.dumps(r) + "\n" for i in range(n) for r in records_of(i)))
  return path


def _chat(question: str, answer: str) -> dict:
  return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.mark.slow
def test_instruction_tuning_run_trains_on_responses_and_resumes(tiny_config, tmp_path):
  """data.kind=chat: conversations in the chat template, the loss over the
  answers only; the run evaluates on the held-out file and resumes."""
  # Five held-out conversations, fewer than a batch: the evaluation fills the batch with rows that score nothing.
  folder = _instruction_folder(tmp_path / "instructions", lambda i: [_chat(f"What is {i} + 1?", str(i + 1))],
                               sizes=(40, 5))
  tiny_config.data.update(kind="chat", chat_template="chatml", corpus=str(folder), seq_len=96, batch_size=8)
  tiny_config.train.update(num_steps=4, checkpoint_every=2, log_every=1, eval_every=4, eval_batches=2)
  out = trainer.train(tiny_config, str(tmp_path / "run"))
  assert np.isfinite(out["train"]["loss"]) and out["eval"]["tokens"] > 0
  loaded = checkpoints.load(str(tmp_path / "run"))
  from mdlm_jax.data.chat_template import CHATML
  assert loaded.chat_template == CHATML
  tiny_config.train.update(num_steps=6)
  again = trainer.train(tiny_config, str(tmp_path / "run"))
  assert again["step"] == 6


@pytest.mark.slow  # a chat training run (about 20 s)
def test_instruction_tuning_mixes_infill_records_at_fim_rate(tiny_config, tmp_path):
  """Infill records in the folder: data.fim_rate of the rows are their PSM
  prompts with the middle scored; the tuned checkpoint infills in that format."""
  from mdlm_jax.data import fim
  from mdlm_jax.data.tokenizer import CHAT_AND_FIM_PIECES, train_tokenizer
  docs = [f"def f{i}(x):\n    y = x + {i}\n    return y\n" for i in range(200)]
  tok_path = str(tmp_path / "fim.model")
  train_tokenizer(docs, tok_path, vocab_size=400, user_pieces=CHAT_AND_FIM_PIECES)
  folder = _instruction_folder(tmp_path / "instructions", lambda i: [
      _chat(f"Write f{i}.", docs[i]),
      {"fim": {"prefix": f"def f{i}(x):\n", "middle": f"    y = x + {i}\n", "suffix": "    return y\n"}}],
                               sizes=(24, 16))
  tiny_config.data.update(kind="chat", chat_template="chatml", corpus=str(folder), seq_len=96, batch_size=8,
                          tokenizer=tok_path, fim_rate=0.5, length_buckets="32,64")
  tiny_config.train.update(num_steps=4, checkpoint_every=2, log_every=1, eval_every=4, eval_batches=2)
  out = trainer.train(tiny_config, str(tmp_path / "run"))
  assert np.isfinite(out["train"]["loss"]) and out["eval"]["tokens"] > 0
  loaded = checkpoints.load(str(tmp_path / "run"))
  assert fim.format_for(loaded.config, loaded.tokenizer) == fim.FIMFormat.of(loaded.tokenizer)
  tiny_config.data.update(corpus=str(_instruction_folder(tmp_path / "no_infills", lambda i: [_chat("hi", "hello")])))
  with pytest.raises(ValueError, match="data.fim_rate=0.5 draws rows from the folder's infill records"):
    trainer.train(tiny_config, str(tmp_path / "run2"))


@pytest.mark.slow  # a training run at a longer context
def test_extend_context_fine_tunes_a_trained_model_at_a_longer_context(tiny_checkpoints, tmp_path):
  """configs/extend_context.py:tiny,2,yarn starts from the trained weights at
  twice the context with YaRN scaling; the result loads with that scaling."""
  from mdlm_jax.config import load_config_file
  from mdlm_jax.model.rope import RopeScaling
  src = checkpoints.load(tiny_checkpoints["mdlm"])
  c = load_config_file(os.path.join(REPO, "configs", "extend_context.py"))
  assert c.data.seq_len == 4 * load_config_file(os.path.join(REPO, "configs", "pycode.py")).data.seq_len
  import importlib.util
  spec = importlib.util.spec_from_file_location("extend", os.path.join(REPO, "configs", "extend_context.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("tiny,2,yarn")
  c.train.update(num_steps=2, checkpoint_every=2, log_every=1, eval_batches=1, init_from=tiny_checkpoints["mdlm"])
  trainer.train(c, str(tmp_path / "long"))
  got = checkpoints.load(str(tmp_path / "long"))
  trained = src.config.data.seq_len
  assert got.config.data.seq_len == 2 * trained
  assert got.spec.cfg.rope_scaling == RopeScaling(type="yarn", factor=2.0, max_position=trained)
  with pytest.raises(ValueError, match="FACTOR"):
    module.get_config("tiny,0")


@pytest.mark.slow  # two training runs and an export (about 25 s)
def test_adapters_train_alone_over_a_frozen_base_and_ship_alone(tiny_checkpoints, tmp_path):
  """An AR model adapted with train.trainable=adapters: every base weight stays the AR
  model's bit for bit, the adapters move, and an adapters-only export (the adapters and
  the base's name) loads back as the whole trained model."""
  from mdlm_jax.checkpoints import params_only, safetensors
  from tests.conftest import load_config
  src = checkpoints.load(tiny_checkpoints["ar"])
  c = load_config("tiny")
  c.model.update(shift_logits=True, clean_causal=True, lora_rank=4)
  c.diffusion.block_size = 4
  c.train.update(num_steps=3, checkpoint_every=3, log_every=1, eval_batches=1, init_from=tiny_checkpoints["ar"],
                 trainable="adapters")
  c.optim.update(learning_rate=1e-2, warmup_steps=0, ema_decay=0.0)
  trainer.train(c, str(tmp_path / "a2d"))
  got = checkpoints.load(str(tmp_path / "a2d"))
  named = params_only.flatten(got.params)
  base = params_only.flatten(src.params)
  assert set(base) < set(named) and all(params_only.is_adapter_name(k) for k in set(named) - set(base))
  for k, v in base.items():
    np.testing.assert_array_equal(np.asarray(named[k]), np.asarray(v), err_msg=k)
  assert any(np.abs(np.asarray(v)).max() > 0 for k, v in named.items() if k.endswith(".b"))  # B starts at 0
  out = tmp_path / "adaptation"
  from mdlm_jax import export
  export.main([f"--checkpoint={tmp_path / 'a2d'}", f"--out={out}", "--adapters-only", "--dtype=float32"])
  shipped, _ = safetensors.load_folder(str(out))
  assert shipped and all(params_only.is_adapter_name(k) for k in shipped)
  again = checkpoints.load(str(out))
  for k, v in params_only.flatten(again.params).items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(named[k]), err_msg=k)
  with pytest.raises(ValueError, match="--adapters-only exports a run that trained adapters"):
    export.export_folder(export.parse([f"--checkpoint={tiny_checkpoints['mdlm']}", f"--out={tmp_path / 'no'}",
                                 "--adapters-only"]), 2**30)
  # A later stage over this one (a run, or its shipped adapters) keeps the same frozen weights: its
  # adapters-only export names the first base, not the stage it started from.
  from mdlm_jax.checkpoints.loading import frozen_base
  assert json.load(open(out / "config.json"))["base"] == tiny_checkpoints["ar"]
  for earlier in (str(tmp_path / "a2d"), str(out)):
    c.train.init_from = earlier
    assert frozen_base(c) == tiny_checkpoints["ar"]
  c.train.init_from = tiny_checkpoints["mdlm"]  # a full checkpoint is a base itself
  assert frozen_base(c) == tiny_checkpoints["mdlm"]
  c.train.init_from = "smollm2-135m-instruct"
  assert frozen_base(c) == "smollm2-135m-instruct"
