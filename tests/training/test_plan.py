"""python -m mdlm_jax.plan: per-device memory on meshes larger than this machine."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, load_config


@pytest.mark.slow  # compiles an 8B model's programs for 256 abstract devices
def test_llada_8b_on_256_abstract_devices():
  """The 8B train step lowers for a 256-device FSDP mesh without allocating a
  single 8B array; params, Adam state and gradients are 1/256 each."""
  from mdlm_jax.training import memory_plan
  c = load_config("llada_8b")
  p = memory_plan.plan_one(c, {"data": 1, "fsdp": 256, "tensor": 1}, batch=1280, accum=1, rules="fsdp", platform="tpu",
                    compile_=False)
  d, m, v, n = 4096, 12288, 126464, 32
  n_params = 2 * v * d + n * (4 * d * d + 3 * d * m + 2 * d) + d
  assert 7.9e9 < n_params < 8.1e9
  assert p.lowered and p.devices == 256 and p.micro_batch_per_device == 5
  assert p.exact["params (f32)"] == n_params * 4 // 256
  assert p.exact["optimizer state"] == pytest.approx(2 * n_params * 4 / 256, rel=1e-6)  # Adam mu and nu
  assert p.exact["gradients (f32)"] == p.exact["params (f32)"]
  assert "EMA params" not in p.exact  # llada_8b trains without an EMA
  assert p.analytic["activations kept for backward"] == n * 5 * 4096 * d * 2  # remat: one bf16 block input per layer
  assert p.total > 50 * 2**30
  # Sequence parallelism over 4 devices: a quarter of the activations each.
  q = memory_plan.plan_one(c, {"fsdp": 64, "sequence": 4}, batch=320, accum=1, rules="fsdp", platform="tpu",
                           compile_=False)
  assert q.lowered and q.mesh["sequence"] == 4
  assert q.analytic["activations kept for backward"] == p.analytic["activations kept for backward"] // 4


def test_cli_json_and_a_clear_failure_when_it_does_not_fit():
  base = [sys.executable, "-m", "mdlm_jax.plan", f"--config={REPO}/configs/tiny.py", "--config.model.vocab_size=512",
          "--mesh=data=2,fsdp=2", "--mesh=fsdp=2,tensor=2", "--rules=fsdp_tp"]
  r = subprocess.run(base + ["--json", "--device-memory=1GiB"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  plans = [json.loads(line) for line in r.stdout.splitlines()]
  assert [p["mesh"] for p in plans] == [{"data": 2, "fsdp": 2, "sequence": 1, "tensor": 1},
                                         {"data": 1, "fsdp": 2, "sequence": 1, "tensor": 2}]
  assert all(p["fits"] and p["lowered"] for p in plans)
  # Tensor parallelism halves the attention/MLP weights each device holds.
  assert plans[1]["exact"]["params (f32)"] < plans[0]["exact"]["params (f32)"]
  # Serving (tiny: 2 layers x 4 heads x 16 dims, f32): keys and values are 2 * 2 * 4 * 16 * 4 bytes a token.
  sv = plans[0]["serving"]
  assert sv["kv_cache_bytes_per_token"] == 1024 and sv["slots"] == 8 and sv["context"] == 64
  assert sv["kv_cache"] == 8 * 64 * 1024
  assert sv["weights"] == 2 * plans[0]["exact"]["params (f32)"]  # all of them (training shards them over fsdp=2)
  assert sv["longest_context_1_slot"] == (2**30 - sv["weights"]) // 1024
  assert sv["longest_context_8_slots"] == (2**30 - sv["weights"]) // (8 * 1024)
  r = subprocess.run(base[:6] + ["--device-memory=1MiB"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 1
  assert "does not fit 1.0 MiB per device: data=2,fsdp=2,sequence=1,tensor=1 needs" in r.stderr
  r = subprocess.run(base[:4] + ["--mesh=fsdp=3"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 2 and "batch 8 does not split" in r.stderr
