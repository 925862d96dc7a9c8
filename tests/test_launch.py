"""launch/local.py: a real 2-process JAX job over 127.0.0.1, and its dry run."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

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


def test_a_failing_process_stops_the_job(tmp_path):
  r = subprocess.run([sys.executable, LAUNCH, "--num-processes", "2", "--", sys.executable, "-c",
                      "import os, sys, time; i = int(os.environ['MDLM_PROCESS_ID']);"
                      " sys.exit(3) if i == 1 else time.sleep(60)"],
                     capture_output=True, text=True, timeout=50)
  assert r.returncode == 3
  assert "process 1 exited with 3" in r.stdout
