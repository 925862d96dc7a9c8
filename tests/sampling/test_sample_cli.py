"""python -m mdlm_jax.sample: runs in seconds on CPU; bad flags and checkpoints fail clearly."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, xla_flags


def run(*args, timeout=240):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  return subprocess.run([sys.executable, "-m", "mdlm_jax.sample", *args], capture_output=True, text=True,
                        env=env, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints):
  return tiny_checkpoints


@pytest.fixture
def in_process(monkeypatch, capsys):
  """`sample.main` in this process, for errors (no interpreter start each): its exit code and stderr. An
  exception other than the CLI's own exit escapes and fails the test."""
  from absl import logging
  from mdlm_jax import sample

  def exit_(code):
    raise SystemExit(code)
  monkeypatch.setattr(os, "_exit", exit_)  # cli.fail's exit
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored after
  verbosity = logging.get_verbosity()

  def call(*args):
    try:
      with pytest.raises(SystemExit) as e:
        sample.main(list(args))
    finally:
      logging.set_verbosity(verbosity)
    return e.value.code, capsys.readouterr().err
  return call


def test_diffusion_cli_json(checkpoints):
  r = run(f"--checkpoint={checkpoints['mdlm']}", "--prompt=def f(x):\n", "--max-new-tokens=12", "--effort=low",
          "--num-samples=2", "--json")
  assert r.returncode == 0, r.stderr
  res = json.loads(r.stdout)
  assert len(res["completions"]) == 2 and res["forward_passes"] >= 1
  assert all(c["tokens"] <= 12 for c in res["completions"])
  from mdlm_jax import kernels
  # by default the weights this machine decodes fastest in: w8a8 on a CPU the int8 kernels have vector paths for
  assert res["decode_dtype"] == ("w8a8" if kernels.int8.kernels_vectorized() else "float32")


@pytest.mark.slow
def test_show_steps_and_infill(checkpoints):
  r = run(f"--checkpoint={checkpoints['mdlm']}", "--prompt=x = ", "--suffix=\n", "--max-new-tokens=6",
          "--sampler=low_confidence", "--steps=3", "--block-size=0", "--show-steps")
  assert r.returncode == 0, r.stderr
  steps = [line for line in r.stderr.splitlines() if line.startswith("[step ")]
  assert [s for s in steps] == [f"[step {i}]" for i in range(4)]  # the empty canvas, then 3 steps
  assert "\u2591" * 6 in r.stderr  # the first draft is all [MASK]
  r = run(f"--checkpoint={checkpoints['mdlm']}", "--prompt=x = ", "--suffix=\n", "--infill-lengths=2,4")
  assert r.returncode == 0, r.stderr
  assert "infill NELBO nats/token by middle length: 2:" in r.stderr


def test_ar_checkpoint(checkpoints):
  r = run(f"--checkpoint={checkpoints['ar']}", "--prompt=import ", "--max-new-tokens=5", "--temperature=1",
          "--top-p=0.9", "--frequency-penalty=1", "--logit-bias=5=-100", "--decode-dtype=float32", "--json")
  assert r.returncode == 0, r.stderr
  res = json.loads(r.stdout)
  assert res["forward_passes"] <= 5 and res["decode_dtype"] == "float32"


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens=0"], "--max-new-tokens must be >= 1"),
    (["--effort=extreme"], "invalid choice: 'extreme'"),
    (["--threshold=1.5"], "--threshold must be in [0, 1]"),
    (["--effort=high", "--steps=4"], "--steps does not apply to the ThresholdSampler"),
    (["--min-tokens=0"], "--min-tokens must be >= 1"),
    (["--infill-lengths=4,8"], "--infill-lengths needs --suffix"),
    (["--suffix=x", "--infill-lengths=a,b"], "comma-separated integers"),
    (["--presence-penalty=3"], "--presence-penalty must be in [-2, 2]"),
    (["--logit-bias=5"], "--logit-bias takes ID=BIAS"),
    (["--logit-bias=99999=1"], "token id 99999 is outside the vocabulary"),
    (["--sampler=ancestral", "--frequency-penalty=1"], "--frequency-penalty does not apply to the AncestralSampler"),
    (["--lookup=2"], "lookup=2 offers copied drafts for revision to verify: it needs revise=True"),
    (["--head-width=8"], "head_width=8 is the width of revision's verified head: it needs revise=True"),
    (["--no-model-drafts"], "model_drafts=False leaves revision's drafts to copies and the draft table"),
    (["--table-floor=0.3"], "table_floor=0.3 stops the draft table's chains: it needs lookup > 0"),
    (["--pass-widths=1,x"], "expected comma-separated integers"),
    (["--pass-widths=1,8"], "pass_widths=(1, 8) narrows passes of the head alone: it needs model_drafts=False"),
])
def test_bad_flags(checkpoints, args, message, in_process):
  code, err = in_process(f"--checkpoint={checkpoints['mdlm']}", "--prompt=x", *args)
  assert code != 0 and message in err


def test_unusable_checkpoints(checkpoints, tmp_path, in_process):
  code, err = in_process(f"--checkpoint={tmp_path / 'missing'}", "--prompt=x")
  assert code != 0 and "does not exist" in err
  (tmp_path / "empty").mkdir()
  code, err = in_process(f"--checkpoint={tmp_path / 'empty'}", "--prompt=x")
  assert code != 0 and "no checkpoint found" in err
  code, err = in_process(f"--checkpoint={checkpoints['ar']}", "--prompt=x", "--suffix=y")
  assert code != 0 and "cannot infill" in err


def test_a_whole_sequence_model_samples_exactly_by_default(checkpoints):
  """The tiny MDLM (trained on whole sequences) decodes in full-canvas passes unless --kv-cache."""
  r = run(f"--checkpoint={checkpoints['mdlm']}", "--prompt=def f(x):\n", "--max-new-tokens=8",
          "--sampler=low_confidence", "--steps=4", "--json")
  assert r.returncode == 0, r.stderr
  assert "kv_cache=False" in json.loads(r.stdout)["sampler"]
