"""launch/a2d_gpu.sh: its time budget, with a stand-in `python` whose training runs
wait to be stopped (a stopped run saves checkpoints, as the trainer does)."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

SCRIPT = os.path.join(REPO, "launch", "a2d_gpu.sh")

# Training waits for SIGTERM, then leaves checkpoints (stage B's with two held-out
# evaluations, the first the better); export and everything else is logged or run by Python.
FAKE_PYTHON = """#!/usr/bin/env bash
now() { python3 -c 'import time; print(f"{time.time():.2f}")'; }
if [ "$1" = -m ] && [ "$2" = mdlm_jax.train ]; then
  for a in "$@"; do case $a in --workdir=*) wd=${a#--workdir=};; --config.train.init_from=*) from=${a#*=};; esac; done
  echo "start $(basename "$wd") $from $(now)" >> "$FAKE_LOG"
  stop() {
    mkdir -p "$wd/checkpoints/100" "$wd/checkpoints/200"
    printf '%s\\n' '{"kind": "eval", "step": 100, "nats_per_token": 0.7}' \\
      '{"kind": "eval", "step": 200, "nats_per_token": 0.8}' > "$wd/metrics.jsonl"
    echo "stop $(basename "$wd") $(now)" >> "$FAKE_LOG"
    exit 143
  }
  trap stop TERM
  while :; do sleep 0.05; done
fi
if [ "$1" = -m ] && [ "$2" = mdlm_jax.export ]; then
  echo "export $* $(now)" >> "$FAKE_LOG"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def _launch(tmp_path, budget, **env):
  bin_dir, chat = tmp_path / "bin", tmp_path / "chat"
  bin_dir.mkdir(exist_ok=True)
  chat.mkdir(exist_ok=True)
  (chat / "train.jsonl").write_text("{}\n")
  fake = bin_dir / "python"
  fake.write_text(FAKE_PYTHON)
  fake.chmod(0o755)
  log = tmp_path / "calls.log"
  log.unlink(missing_ok=True)
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REAL_PYTHON": sys.executable,
         "FAKE_LOG": str(log), "A2D_RUNS": str(tmp_path / "runs"), "A2D_CHAT": str(chat), **env}
  t0 = time.time()
  r = subprocess.run(["bash", SCRIPT, str(budget), str(tmp_path / "out"), "INIT"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=60)
  calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
  return r, calls, t0


def test_each_stage_stops_at_its_share_and_the_best_chat_checkpoint_is_exported(tmp_path):
  # 121 s: stage A ends at (121 - 110) * 45% = 4 s in, stage B at 121 - 115 = 6 s.
  r, calls, t0 = _launch(tmp_path, 121)
  assert r.returncode == 0, r.stderr
  assert [c[:-1] for c in calls[:4]] == [["start", "a", "INIT"], ["stop", "a"],
                                         ["start", "b", str(tmp_path / "runs/a")], ["stop", "b"]]
  stop_a, stop_b = float(calls[1][2]) - t0, float(calls[3][2]) - t0  # the script counts whole seconds
  assert 2.5 < stop_a < 8 and 4.5 < stop_b < 11 and stop_b - stop_a > 1, (stop_a, stop_b)
  export = calls[4]
  assert export[:3] == ["export", "-m", "mdlm_jax.export"]
  assert f"--checkpoint={tmp_path / 'runs/b/checkpoints/100'}" in export  # the lower held-out NELBO
  assert f"--out={tmp_path / 'out/adapters'}" in export


def test_a_stage_whose_time_has_passed_does_not_start(tmp_path):
  # With no share for stage A its mark is 0 s: `timeout 0` would let it run forever.
  r, calls, _ = _launch(tmp_path, 121, A2D_SHARE_A="0")
  assert r.returncode == 0, r.stderr
  assert "no time left in the budget for: python -m mdlm_jax.train" in r.stdout  # stage A logs it
  assert [c[:-1] for c in calls[:2]] == [["start", "b", "INIT"], ["stop", "b"]]  # from INIT: stage A left nothing
  assert f"--checkpoint={tmp_path / 'runs/b/checkpoints/100'}" in calls[2]


@pytest.mark.parametrize("budget", ["120", "ten", "-5"])
def test_a_budget_too_short_to_export_is_refused(tmp_path, budget):
  r, calls, _ = _launch(tmp_path, budget)
  assert r.returncode == 2 and "SECONDS must be a whole number above 120" in r.stderr and calls == []
