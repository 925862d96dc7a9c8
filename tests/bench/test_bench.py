"""Pieces of the benchmarks that compute numbers: checked against references."""

import ast

import jax
import ml_collections
import numpy as np
import pytest

from mdlm_jax.parallel import sharding
from mdlm_jax.bench import sample as bench_sample
from mdlm_jax.bench import train as bench_train
from mdlm_jax.checkpoints.loading import LoadedModel
from mdlm_jax.model.spec import bind, init_params, model_spec
from mdlm_jax.model import ModelConfig


def test_parse_rate_truncates_at_the_last_complete_line():
  assert bench_sample.truncate_to_complete_lines("a = 1\nb = (") == "a = 1\n"
  assert bench_sample.parses("import os\nx = [1,\ny = \"unfinished")  # the unfinished last line is cut away
  assert not bench_sample.parses("def f(:\n    pass\n")
  assert not bench_sample.parses("x = = 1\n")
  assert bench_sample.parses("no newline at all (")  # nothing complete: the empty module


def test_parse_rate_accepts_code_cut_inside_a_block_or_docstring():
  """Code cut at a token budget is valid so far inside an open block, bracket
  or docstring, which a whole-module parse rejects; code that no later lines
  could mend is not."""
  for cut in ('"""Module docstring,\nstill open\n', "def f(x):\n", "class A:\n    def g(self):\n",
              "x = [1,\n", "if x:\n    y = {\n        'a': 1,\n"):
    assert bench_sample.parses(cut), cut
    try:
      ast.parse(cut)
      raise AssertionError(f"ast parses {cut!r}: not a cut the old check failed")
    except SyntaxError:
      pass
  for bad in ("x = 1\n    y = 2\n", "if x:\n    y = 1\n  z = 2\n", "return = = file.((config)\n", "x = (]\n"):
    assert not bench_sample.parses(bad), bad


def test_repeated_lines_count_lines_written_again():
  assert bench_sample.repeated_lines("a = 1\n  a = 1\n\nb = 2\na = 1\nc = (") == (2, 4)
  assert bench_sample.repeated_lines("x\n") == (0, 1)
  assert bench_sample.repeated_lines("unfinished") == (0, 0)
  rng = np.random.default_rng()
  lines = [f"v{i} = {i}" for i in rng.permutation(50)[:int(rng.integers(2, 10))]]
  k = int(rng.integers(1, 5))
  text = "\n".join(lines + [lines[0]] * k) + "\n"
  assert bench_sample.repeated_lines(text) == (k, len(lines) + k)
  pooled = bench_sample.Repeats()
  for t in ("a\na\n", "b\nc\n", ""):
    pooled.add(t)
  assert pooled.rate == 1 / 4
  assert np.isnan(bench_sample.Repeats().rate)


def test_gen_ppl_is_the_ar_nll_of_the_completion_only():
  cfg = ModelConfig(vocab_size=29, num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32, causal=True)
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])
  spec = model_spec(cfg, mesh)
  params = init_params(spec, 1)

  class Tok:
    pad_id = 0

  scorer = bench_sample.GenPPL(LoadedModel(spec, params, Tok(), None, 0, False))
  rng = np.random.default_rng(0)
  prompt, completion = rng.integers(1, 29, 7).tolist(), rng.integers(1, 29, 5).tolist()
  total, n = scorer(prompt, completion)
  ids = np.asarray([prompt + completion], np.int32)
  logits = np.asarray(bind(spec, params)(ids), np.float64)[0]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
      -1, keepdims=True)
  want = -sum(logp[i - 1, ids[0, i]] for i in range(len(prompt), ids.shape[1]))
  assert n == 5
  np.testing.assert_allclose(total, want, rtol=1e-5)


def test_reference_quality_scores_the_true_continuations():
  """Each held-out continuation is scored given BOS + its prompt, like a
  completion; gen-PPL pools the NLL over all their tokens."""

  class Tok:  # one id per character
    bos_id = 1

    def encode(self, text):
      return [ord(ch) for ch in text]

    def decode(self, ids):
      return "".join(map(chr, ids))

  calls = []

  def scorer(prompt_ids, completion_ids):  # NLL: 0.01 per id value of the completion
    calls.append((prompt_ids, completion_ids))
    return 0.01 * sum(completion_ids), len(completion_ids)

  tok = Tok()
  examples = [("x = [1,", tok.encode(" 2]\ny = 3\n")), ("def f(:", tok.encode("\n  pass\n")), ("a", [])]
  got = bench_sample.reference_quality(examples, tok, scorer)
  assert calls[0] == ([1] + tok.encode("x = [1,"), tok.encode(" 2]\ny = 3\n"))
  ids = [i for _, c in examples for i in c]
  np.testing.assert_allclose(got["gen_ppl"], np.exp(0.01 * sum(ids) / len(ids)), rtol=1e-12)
  assert got["parse_rate"] == 2 / 3  # "def f(:" never parses; "a" alone does
  assert got["repeated_line_rate"] == 0.0  # "y = 3", "pass": no line written twice
  assert got["new_tokens_mean"] == len(ids) / 3


def test_run_setting_times_each_batch_and_pools_quality():
  """Fake generator and scorer: every figure follows from what they return,
  and each batch is generated `repeats` times after one untimed run for each
  distinct set of prompt lengths (the diffusion generator compiles for each)."""
  from types import SimpleNamespace

  calls = []

  class Gen:
    def generate(self, batch, *, max_new_tokens, sampler):
      calls.append(list(batch))
      done = [SimpleNamespace(text="x = 1\nx = 1\n", tokens=[5, 6, 7]) for _ in batch]
      return SimpleNamespace(forward_passes=2, completions=done)

    def encode_prompt(self, p):
      return [1] * len(p)

  prompts = ["a = (", "b = 2\n", "c", "d", "e", "f"]  # batches of lengths (5, 6), (1, 1), (1, 1)
  got = bench_sample.run_setting(Gen(), prompts[:4], 2, 3, None,
                                 lambda prompt, completion: (0.5 * len(completion), len(completion)), repeats=3)
  assert calls[:2] == [prompts[:2], prompts[2:4]]  # compiled: each set of lengths once, before any timed run
  assert len(calls) == 2 + 2 * 3
  calls.clear()
  bench_sample.run_setting(Gen(), prompts, 2, 3, None, lambda prompt, completion: (0.0, 1), repeats=1)
  assert len(calls) == 2 + 3  # (1, 1) twice: compiled once
  assert got["tokens_per_forward"] == 6 / 2 / 2  # 6 tokens a batch, 2 passes, 2 rows
  assert got["forward_passes_mean"] == 2 and got["new_tokens_mean"] == 3
  np.testing.assert_allclose(got["gen_ppl"], np.exp(0.5), rtol=1e-12)
  assert got["parse_rate"] == 3 / 4  # "a = (x = 1" ... does not parse
  assert got["repeated_line_rate"] == 0.5  # of each completion's two lines, one repeats


def test_bench_train_finds_the_default_config():
  c = bench_train.load_config(bench_train.default_config_path())
  assert c.data.seq_len == 384 and c.objective == "mdlm"


def test_matmul_peak_is_the_best_timing_window(monkeypatch):
  """A window slowed by other work sharing the machine must not lower the
  peak (a low peak reports an MFU above 100%): the fastest window counts."""
  from mdlm_jax.training import flops
  now = [0.0]
  # The first window's 5 clock readings advance 10 ms each, later ones 1 ms.
  steps = iter([0.01] * 5 + [0.001] * 10_000)

  def clock():
    now[0] += next(steps)
    return now[0]

  monkeypatch.setattr(flops.time, "perf_counter", clock)
  n = 64
  got = flops.measure_matmul_peak(n, seconds=0.004, windows=2)
  # Each window: a start reading, checks at +1 and +2 (fewer than 2 reps: run
  # on), at +3 (2 reps, past 2 ms: stop), and the end at +4: 2 reps in 4
  # readings, 40 ms in the slow window and 4 ms in the fast one.
  np.testing.assert_allclose(got, 2.0 * n ** 3 * 2 / 0.004, rtol=1e-9)


def test_matmul_peak_runs_on_one_device_inside_a_mesh():
  """Inside a training mesh, new arrays are replicated over every device and
  each would compute the whole product: the peak must time one device's."""
  from mdlm_jax.training import flops
  assert len(jax.devices()) >= 2
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": len(jax.devices()), "fsdp": 1, "tensor": 1}))
  with jax.set_mesh(mesh):
    a, b = flops.matmul_operands(16)
    assert a.devices() == b.devices() == {jax.local_devices()[0]}
    assert flops.measure_matmul_peak(32, seconds=0.01, windows=1) > 0


def test_progress_reports_about_every_tenth_and_the_end(capsys):
  import threading
  from mdlm_jax.bench.common import Progress
  p = Progress("items", 95)
  threads = [threading.Thread(target=lambda: [p.advance() for _ in range(19)]) for _ in range(5)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  lines = capsys.readouterr().err.splitlines()
  assert p.done == 95 and len(lines) == 11  # 9, 18, ..., 90, then 95
  assert lines[0].startswith("items: 9/95, ") and lines[-1].startswith("items: 95/95, ") and "ETA 0s" in lines[-1]


@pytest.mark.slow  # a benchmark shape end to end
def test_the_memory_bound_shape_runs_end_to_end():
  """bench sample's memory-bound comparison on a tiny shape: both decoders run and every
  diffusion setting commits its 4 tokens a pass (the 100M shape crashed on its configless model)."""
  shape = dict(vocab_size=1100, num_layers=1, embed_dim=32, num_heads=2, mlp_dim=64)
  out = bench_sample.memory_bound_shape(new_tokens=8, prompt_tokens=8, shape=shape)
  for name in ("diffusion_block8_2steps", "diffusion_block4_1step"):
    assert out[name]["forward_passes"] * 4 <= out[name]["tokens"] + 8
    assert out[name]["speedup_vs_ar"] > 0
  assert out["ar"]["tokens"] == 8


def test_a_runtime_run_in_a_child_returns_its_result_or_names_its_crash():
  """llama.cpp runs in a process of its own: a crash (here SIGABRT) is its row's error, not the benchmark's end."""
  import math
  import os
  from mdlm_jax.bench.ardecode import in_child
  x = float(np.random.default_rng().uniform(1, 100))
  assert in_child(math.sqrt, x) == math.sqrt(x)
  got = in_child(os.abort)
  assert "crashed" in got["error"] and "exit code -6" in got["error"]


def test_layouts_bench_referees_objects_and_schemas():
  from mdlm_jax.bench import layouts
  schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
  assert layouts.valid('{\n  "a": [1, 2]\n}', None)
  assert not layouts.valid("[1, 2]", None)  # JSON, but not an object
  assert not layouts.valid('{"a": 1', None)  # cut short
  assert layouts.valid('{"n": 3, "extra": true}', schema)
  assert not layouts.valid('{"n": "3"}', schema) and not layouts.valid("{}", schema)
  assert layouts.named_keys({"user name": [{"id_2": 1, "x-y": None}], "Z": "?"}) and layouts.named_keys([1, "a"])
  assert not layouts.named_keys({",": 1}) and not layouts.named_keys({"a": [{"\n": 2}]})
  assert not layouts.named_keys({"2nd": 1}) and not layouts.named_keys({"": 0})
  # Every task's schema is one jsonschema accepts, and both modes are covered.
  import jsonschema
  for _, _, s in layouts.TASKS:
    if s is not None:
      jsonschema.Draft202012Validator.check_schema(s)
  assert {s is None for _, _, s in layouts.TASKS} == {True, False}
  with pytest.raises(SystemExit):
    layouts.parse(["--layouts=model,pretty"])
  assert layouts.parse(["--layouts=compact"]).layouts == ["compact"]


def test_tools_bench_totals_each_side():
  from mdlm_jax.bench import tools
  rows = [{"tokens": 10, "passes": 4, "seconds": 0.5, "calls": 0, "finish": "stop"},
          {"tokens": 6, "passes": 4, "seconds": 0.3, "calls": 2, "finish": "tool_calls"},
          {"tokens": 9, "passes": 2, "seconds": 0.2, "calls": 0, "finish": "length"}]
  got = tools.summarize(rows)
  assert got["completion_tokens"] == 25 and got["passes"] == 10 and got["tokens_per_pass"] == pytest.approx(2.5)
  assert got["tokens_per_s"] == pytest.approx(25.0) and got["answers_with_calls"] == 1
  assert got["finish_reasons"] == {"stop": 1, "tool_calls": 1, "length": 1}
  with pytest.raises(SystemExit):
    tools.parse(["--limit=0"])
