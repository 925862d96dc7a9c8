"""launch/local.py: a real 2-process JAX job over 127.0.0.1, and its dry run."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, xla_flags

LAUNCH = os.path.join(REPO, "launch", "local.py")


def test_dry_run_prints_each_process_command():
  r = subprocess.run([sys.executable, LAUNCH, "--dry-run", "--num-processes", "2", "--devices-per-process", "3",
                      "--port", "4321", "--", "python", "-m", "mdlm_jax.train", "--workdir=w x"],
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  lines = r.stdout.strip().splitlines()
  assert lines == [
      f"MDLM_COORDINATOR=127.0.0.1:4321 MDLM_NUM_PROCESSES=2 MDLM_PROCESS_ID={i} JAX_PLATFORMS=cpu"
      f" XLA_FLAGS=--xla_force_host_platform_device_count=3 python -m mdlm_jax.train '--workdir=w x'"
      for i in range(2)]


@pytest.mark.slow
def test_two_process_training_checkpoints_each_process(tmp_path, tiny_tokenizer_path):
  workdir = tmp_path / "mp"
  cmd = [sys.executable, LAUNCH, "--num-processes", "2", "--devices-per-process", "1", "--",
         sys.executable, "-m", "mdlm_jax.train", f"--config={REPO}/configs/tiny.py", f"--workdir={workdir}",
         f"--config.data.tokenizer={tiny_tokenizer_path}", "--config.train.num_steps=6",
         "--config.train.log_every=3", "--config.train.checkpoint_every=6", "--config.train.eval_batches=1"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 0, r.stdout[-3000:]
  assert "mesh {'data': 2" in r.stdout  # one global mesh over both processes
  assert "[p1] step" not in r.stdout  # only process 0 reports progress
  data_dir = workdir / "checkpoints" / "6" / "data"
  states = sorted(os.listdir(data_dir))
  assert "process_0-of-2.json" in states and "process_1-of-2.json" in states
  s0, s1 = (json.loads((data_dir / f"process_{i}-of-2.json").read_text()) for i in range(2))
  assert s0 != s1  # each process reads its own shard of the documents
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  assert [r["step"] for r in records if r["kind"] == "train"] == [3, 6]


def _train_cmd(workdir, tokenizer, steps=6):
  return [sys.executable, "-m", "mdlm_jax.train", f"--config={REPO}/configs/tiny.py", f"--workdir={workdir}",
          f"--config.data.tokenizer={tokenizer}", f"--config.train.num_steps={steps}", "--config.train.log_every=1",
          "--config.train.checkpoint_every=3", "--config.train.eval_batches=1", "--config.data.num_shards=2",
          "--config.mesh.data=4"]


def _records(workdir, kind="train"):
  return [r for r in map(json.loads, open(workdir / "metrics.jsonl")) if r["kind"] == kind]


def _run(cmd, env):
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  return r.stdout


@pytest.mark.slow
def test_two_processes_match_one_process_and_resume(tmp_path, tiny_tokenizer_path):
  """2 processes x 2 devices train exactly as 1 process x 4 devices (same seed,
  same global batches through data.num_shards=2), resume from their collective
  checkpoint onto the same trajectory, and evaluate it as one process does."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  one, two = tmp_path / "one", tmp_path / "two"
  _run(_train_cmd(one, tiny_tokenizer_path),
       {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(4)})
  launch = [sys.executable, LAUNCH, "--num-processes", "2", "--devices-per-process", "2", "--"]
  out = _run(launch + _train_cmd(two, tiny_tokenizer_path), env)
  assert "mesh {'data': 4" in out and "[p1] step" not in out
  ref = _records(one)
  assert [r["step"] for r in ref] == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([r["loss"] for r in _records(two)], [r["loss"] for r in ref], rtol=1e-5)
  np.testing.assert_allclose(_records(two, "eval")[0]["nats_per_token"], _records(one, "eval")[0]["nats_per_token"],
                             rtol=1e-5)

  # Resume: drop the step-6 checkpoint and the records after step 3, train again.
  shutil.rmtree(two / "checkpoints" / "6")
  kept = [line for line in open(two / "metrics.jsonl") if json.loads(line)["step"] <= 3]
  (two / "metrics.jsonl").write_text("".join(kept))
  out = _run(launch + _train_cmd(two, tiny_tokenizer_path), env)
  assert "resumed from" in out and "at step 3" in out
  np.testing.assert_allclose([r["loss"] for r in _records(two)], [r["loss"] for r in ref], rtol=1e-5)

  # Multi-process eval of the final checkpoint = the one-process run's final eval.
  out = _run(launch + [sys.executable, "-m", "mdlm_jax.eval", f"--checkpoint={two}", "--num_batches=1",
                       "--json"], env)
  lines = [line for line in out.splitlines() if "nats_per_token" in line]
  assert len(lines) == 1 and lines[0].startswith("[p0] {")  # only process 0 prints the result
  res = json.loads(lines[0][len("[p0] "):])
  np.testing.assert_allclose(res["nats_per_token"], _records(one, "eval")[0]["nats_per_token"], rtol=1e-5)


def test_a_failing_process_stops_the_job(tmp_path):
  r = subprocess.run([sys.executable, LAUNCH, "--num-processes", "2", "--", sys.executable, "-c",
                      "import os, sys, time; i = int(os.environ['MDLM_PROCESS_ID']);"
                      " sys.exit(3) if i == 1 else time.sleep(60)"],
                     capture_output=True, text=True, timeout=50)
  assert r.returncode == 3
  assert "process 1 exited with 3" in r.stdout


needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts need bash")


@needs_bash
def test_tpu_dry_run_prints_the_gcloud_commands():
  tpu = os.path.join(REPO, "launch", "tpu.sh")
  cmd = ["python", "-m", "mdlm_jax.train", "--config=configs/llada_8b.py", "--workdir=/mnt/runs/a b"]
  r = subprocess.run(["bash", tpu, "--dry-run", "--name", "pod", "--zone", "us-central2-b", "--accelerator-type",
                      "v4-64", "--project", "proj", "--", *cmd], capture_output=True, text=True, timeout=30)
  assert r.returncode == 0, r.stderr
  where = "--zone=us-central2-b --project=proj"
  assert r.stdout.splitlines() == [
      f"gcloud compute tpus tpu-vm describe pod {where} '--format=value(state)'",
      f"gcloud compute tpus tpu-vm create pod {where} --accelerator-type=v4-64 --version=tpu-ubuntu2204-base"
      "  # only if describe finds no such TPU",
      f"gcloud compute tpus tpu-vm ssh pod {where} --worker=all --command 'MDLM_DISTRIBUTED=auto python -m"
      " mdlm_jax.train --config=configs/llada_8b.py '\\''--workdir=/mnt/runs/a b'\\'''"]
  r = subprocess.run(["bash", tpu, "--dry-run", "--create", "--name", "pod", "--zone", "z", "--", "echo", "hi"],
                     capture_output=True, text=True, timeout=30)
  assert r.stdout.splitlines() == [
      "gcloud compute tpus tpu-vm create pod --zone=z --accelerator-type=v4-8 --version=tpu-ubuntu2204-base",
      "gcloud compute tpus tpu-vm ssh pod --zone=z --worker=all --command 'MDLM_DISTRIBUTED=auto echo hi'"]
  r = subprocess.run(["bash", tpu, "--dry-run", "--name", "pod", "--", "echo"], capture_output=True, text=True,
                     timeout=30)
  assert r.returncode == 2 and "--zone is required" in r.stderr


@needs_bash
def test_slurm_dry_run_prints_the_srun_line():
  sbatch = os.path.join(REPO, "launch", "slurm_gpu.sbatch")
  r = subprocess.run(["bash", sbatch, "--dry-run", "--", "python", "-m", "mdlm_jax.train",
                      "--config=configs/llada_8b.py", "--workdir=/shared/a b"], capture_output=True, text=True,
                     timeout=30)
  assert r.returncode == 0, r.stderr
  assert r.stdout == ("srun --ntasks-per-node=1 --kill-on-bad-exit=1 python -m mdlm_jax.train"
                      " --config=configs/llada_8b.py '--workdir=/shared/a b'\n")
  header = open(sbatch).read()
  assert "#SBATCH --nodes=" in header and "#SBATCH --ntasks-per-node=1" in header


@pytest.mark.slow
def test_a_process_with_another_config_stops_the_job(tmp_path, tiny_tokenizer_path):
  train = " ".join(_train_cmd(tmp_path / "w", tiny_tokenizer_path))
  # Process 1 gets another seed: both fail at startup, naming it, before training a step.
  cmd = [sys.executable, LAUNCH, "--num-processes", "2", "--", "bash", "-c",
         f"exec {train} --config.seed=$MDLM_PROCESS_ID"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 2, r.stdout[-2000:]
  assert "process(es) [1] see a different config than process 0" in r.stdout
  assert not (tmp_path / "w" / "metrics.jsonl").exists()
