"""The benchmark commands end to end on the tiny checkpoints (slow: run with -m slow)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, xla_flags

pytestmark = pytest.mark.slow


def _bench(*args, tmp_path):
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.bench", *args, "--json", f"--png={tmp_path / 'b.png'}"],
                     capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "b.png").stat().st_size > 0
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_serve(tiny_checkpoints, tmp_path):
  out = _bench("serve", f"--checkpoint={tiny_checkpoints['mdlm']}", "--concurrency=1,4", "--requests-per-client=2",
               "--max-tokens=16", "--prompt-tokens=16", "--slots=4", "--overhead-pairs=2", "--weight-layout=in_out",
               "--fim-requests=3", "--fim-rounds=2", "--admit-batch=2", tmp_path=tmp_path)
  assert set(out["levels"]) == {"1", "4"} and out["levels"]["4"]["requests"] == 8
  assert out["weight_layouts"] == ["in_out"]
  assert out["throughput_gain"] > 0 and out["http_overhead_c1"] > -1
  assert out["engine_in_process_c1"]["requests"] == out["http_paired_c1"]["requests"] == 2
  for level in out["levels"].values():
    assert level["p50_latency_s"] <= level["p95_latency_s"]
  pc = out["pass_compute"]
  assert set(pc["passes"]) == {f"{n}_slots_{w}_finished_blocks" for n in (1, 4) for w in ("with", "without")}
  for p in pc["passes"].values():
    assert p["gflop_per_s"] == pytest.approx(p["gflop"] / p["ms"] * 1e3)
  passes = lambda n: [p for p in pc["passes"].values() if p["slots"] == n]  # noqa: E731
  four_at_peak_ms = sum(p["gflop"] for p in passes(4)) / pc["matmul_peak_gflop_per_s"] * 1e3
  bound = 4 * sum(p["ms"] for p in passes(1)) / four_at_peak_ms
  assert pc["batching_gain_bound"] == pytest.approx(bound)
  fim = out["fim"]
  assert fim["rounds"] == len(fim["ratio_per_round"]) == 2 and fim["requests"] == 3
  assert fim["concurrent_over_sequential"] == pytest.approx(fim["concurrent_s"] / fim["sequential_s"])
  assert 1 / 3 <= fim["concurrent_prefills_per_request"] <= 1


def test_bench_agent(tiny_checkpoints, tmp_path):
  out = _bench("agent", f"--checkpoint={tiny_checkpoints['mdlm']}", "--seeds=1", "--max-tokens=48",
               "--pass-repeats=2", "--timed-runs=1", tmp_path=tmp_path)
  assert set(out["modes"]) == {"unconstrained", "confident", "bridge", "valid"}
  for mode in ("confident", "bridge", "valid"):
    m = out["modes"][mode]
    assert m["valid"] == m["valid_of_stopped"] == m["finished_stop"]  # every finished output validates
    assert m["finished_stop"] + m["finished_length"] == m["requests"] == 5
    assert m["tokens_per_request_pass"] >= 1  # never less than a token a pass
    assert m["grammar_host_s_per_pass"] > 0 and set(m["pass_time_added"]) == {"with_head=False", "with_head=True"}
    added = sorted(m["pass_time_added"].values())
    assert 0 < m["with_head_share"] < 1 and added[0] <= m["pass_time_added_over_passes"] <= added[1]


def test_bench_sample(tiny_checkpoints, tmp_path):
  out = _bench("sample", f"--mdlm={tiny_checkpoints['mdlm']}", f"--ar={tiny_checkpoints['ar']}", "--skip-100m",
               "--num-prompts=1", "--batch-sizes=1", "--efforts=medium", "--repeats=2", "--new-tokens=16",
               "--prompt-tokens=16", "--cached-blocks", tmp_path=tmp_path)
  rows = out["batches"]["1"]
  assert out["repeats"] == 2
  assert out["reference"]["gen_ppl"] > 1 and 0 <= out["reference"]["parse_rate"] <= 1
  assert set(rows) == {"medium", "medium_cached", "ar", "ar_in_out", "ar_out_in"}
  assert rows["ar"]["tokens_per_forward"] <= 1.0
  # A whole-sequence model: exact full-canvas passes, and the cached approximation beside them.
  assert "kv_cache=False" in rows["medium"]["sampler"] and "kv_cache=True" in rows["medium_cached"]["sampler"]
  # The baseline is the AR twin's faster layout, and both layouts write the same text.
  layout = rows["ar"]["weight_layout"]
  assert rows["ar"]["tokens_per_s"] == max(rows["ar_in_out"]["tokens_per_s"], rows["ar_out_in"]["tokens_per_s"])
  assert rows["ar"]["tokens_per_s"] == rows[f"ar_{layout}"]["tokens_per_s"]
  assert rows["ar_in_out"]["gen_ppl"] == pytest.approx(rows["ar_out_in"]["gen_ppl"], rel=1e-4)


def test_bench_kernels_on_cpu_checks_numerics():
  env = dict(os.environ, XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.bench", "kernels", "--json", "--chunked-tiles=8,16",
                      "--lengths=32,48", "--heads=2", "--head-dim=8", "--repeats=1"], capture_output=True, text=True,
                     env=env, timeout=900, cwd=REPO)
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["timed"] is False and "GPU or TPU" in out["note"]
  for name, check in out["numerics"].items():
    if name.startswith("attention/"):
      assert check["loss_rel_err"] < 1e-5 and check["grad_max_abs_err"] < 1e-4, name
  assert out["numerics"]["confidence_head"]["tokens_equal"]
  # --chunked-tiles times the chunked attention on any backend: every mask, length and tile.
  timed = out["chunked_attention"]
  assert set(timed) == {f"{m}/L={n}" for m in ("bidirectional", "causal", "block_diffusion") for n in (32, 48)}
  assert all(set(row) == {"tile=8", "tile=16"} and all(v["fwd_bwd_ms"] > 0 for v in row.values())
             for row in timed.values())


def test_bench_kernels_times_the_int8_products_at_each_row_count():
  from mdlm_jax.bench import kernels as bench_kernels
  out = bench_kernels.time_int8_products([1, 3], repeats=2, layers=1)
  shapes = [*bench_kernels.SMOLLM2_LAYER.values()]
  assert out["weights"] == sum(n * k for n, k, _ in shapes) + 49152 * 576 and out["layers"] == 1
  for kind in ("plain", "adapted"):
    for m in (1, 3):
      row = out[f"{kind}_rows{m}"]
      assert 0 < row["ms"] <= row["median_ms"]
      assert row["gmac_per_s"] == pytest.approx(out["weights"] * m / row["ms"] / 1e6)


def test_bench_kernels_times_the_cache_attention_at_each_fill_and_rejects_one_past_the_buffer():
  from mdlm_jax.bench import kernels as bench_kernels
  out = bench_kernels.time_cache_attention([8, 100], repeats=2, layers=2)
  assert (out["layers"], out["rows"], out["slots"]) == (2, 8, 512)
  for filled in (8, 100):
    assert 0 < out[f"filled{filled}"]["ms"] <= out[f"filled{filled}"]["median_ms"]
    assert 0 < out[f"filled{filled}"]["xla"]["ms"] <= out[f"filled{filled}"]["xla"]["median_ms"]
  with pytest.raises(ValueError, match="in \\[8, 512\\], got 513"):
    bench_kernels.time_cache_attention([513], repeats=1, layers=1)


def test_bench_longctx(tiny_checkpoints, tmp_path):
  out = _bench("longctx", f"--checkpoint={tiny_checkpoints['mdlm']}", "--lengths=256,1024", "--time-up-to=256",
               "--beside-length=200", "--prefill-chunks=0,64", "--short-requests=2", "--short-tokens=16",
               tmp_path=tmp_path)
  scenes = {r["prefill_chunk"]: r for r in out["beside"]}
  assert set(scenes) == {0, 64}
  assert scenes[64]["prefill_chunks_run"] == 2 * 4 and scenes[0]["prefill_chunks_run"] == 0  # 4 chunks, twice
  for r in scenes.values():
    assert r["added_s"] == pytest.approx(r["short_latency_beside_s"] - r["short_latency_alone_s"])
    assert r["long_first_block_s"] > 0
  runs = {(r["attention"], r["length"]): r for r in out["runs"]}
  assert set(runs) == {(a, n) for a in ("xla", "reference") for n in (256, 1024)}
  for (attention, n), r in runs.items():
    assert r["fits"] and r["bytes_per_token"] == pytest.approx(r["gib"] * 2**30 / n)
    assert (r["seconds"] is not None) == (n <= 256)
  # Four times the length: the reference's [L, L] scores grow 16x, the chunked attention's tiles not at all.
  grow = lambda a: runs[(a, 1024)]["temp_gib"] / runs[(a, 256)]["temp_gib"]  # noqa: E731
  assert grow("reference") > 8 and grow("xla") < 5


def test_bench_layouts(tiny_checkpoints, tmp_path):
  out = _bench("layouts", f"--checkpoint={tiny_checkpoints['mdlm']}", "--limit=10", "--max-tokens=12",
               tmp_path=tmp_path)
  assert set(out["layouts"]) == {"model", "compact"} and out["tasks"] == 10 and out["object_tasks"] == 8
  assert out["decode_dtype"] in ("w8a8", "float32")  # "auto", resolved as the server resolves it
  for row in out["layouts"].values():
    assert row["finished_stop"] + row["finished_length"] == 10 and len(row["answers"]) == 10
    assert row["valid"] == row["valid_object_mode"] + row["valid_schema_mode"] <= 10
    assert row["valid_named_keys"] <= row["valid"]
    assert row["passes"] >= 10 and row["tokens_per_pass"] == pytest.approx(row["completion_tokens"] / row["passes"])


def test_bench_tools(tiny_checkpoints, tmp_path):
  out = _bench("tools", f"--checkpoint={tiny_checkpoints['mdlm']}", "--limit=2", "--max-tokens=12", tmp_path=tmp_path)
  assert set(out["sides"]) == {"tools", "no_tools"} and out["prompts"] == 2
  for side in out["sides"].values():
    assert side["answers"] == 2 and sum(side["finish_reasons"].values()) == 2
    assert side["passes"] >= 2 and 0 < side["completion_tokens"] <= 24
  assert out["tokens_per_s_with_tools_vs_without"] > 0
