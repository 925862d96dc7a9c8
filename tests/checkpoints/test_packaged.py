"""The models shipped in the package: present, consistent, and sampling with no flags."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

from tests.conftest import REPO
from mdlm_jax.checkpoints import packaged, params_only
from mdlm_jax import checkpoints


def test_packaged_pair_loads_and_matches():
  total = 0
  for name in (packaged.DIFFUSION, packaged.AR):
    path = packaged.path(name)
    total += sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
  assert total <= 60 * 2**20
  diffusion, ar = checkpoints.load(packaged.path(packaged.DIFFUSION)), checkpoints.load(packaged.path(packaged.AR))
  assert diffusion.tokenizer.to_bytes() == ar.tokenizer.to_bytes()
  assert diffusion.config.diffusion.block_size > 0 and not diffusion.spec.cfg.causal
  assert ar.spec.cfg.causal and ar.config.objective == "ar"
  # Twins: the same network but for causality and which state scores a token (no parameter differs).
  assert diffusion.spec.cfg.shift_logits
  assert dataclasses.replace(diffusion.spec.cfg, causal=True, shift_logits=False) == ar.spec.cfg
  for loaded in (diffusion, ar):
    for name, leaf in params_only.flatten(loaded.params).items():
      assert np.all(np.isfinite(np.asarray(leaf))), name


def test_sample_cli_defaults_to_the_packaged_model():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.sample", "--prompt=def add(a, b):\n", "--max-new-tokens=32",
                      "--json"], capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  c = out["completions"][0]
  assert c["tokens"] >= 1 and c["text"]
  assert out["forward_passes"] < c["tokens"] or c["finish_reason"] == "stop"
