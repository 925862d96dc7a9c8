"""The lm-evaluation-harness adapter on tasks these tests define over local
jsonl files: exact AR log-likelihoods against a float64 log-softmax, the
diffusion Monte Carlo bound, generation, rolling perplexity, end to end."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from lm_eval.api.instance import Instance  # noqa: E402

from mdlm_jax import harness  # noqa: E402
from mdlm_jax.model.spec import bind  # noqa: E402
from tests.conftest import REPO  # noqa: E402

CHOICES = [("def add(a, b):\n    return", [" a + b", " a - b"], 0), ("import os\nimport", [" sys", " 42"], 0),
           ("for i in range(10):\n   ", [" print(i)", " )))"], 0)]


def _instance(kind, args):
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def ar_lm(tiny_checkpoints):
  return harness.MDLMJaxLM(checkpoint=tiny_checkpoints["ar"], batch_size=2)


@pytest.fixture(scope="module")
def mdlm_lm(tiny_checkpoints):
  lm = harness.MDLMJaxLM(checkpoint=tiny_checkpoints["mdlm"], mc_samples=4, seed=1, max_gen_toks=16, slots=2)
  yield lm
  lm.close()


def test_ar_loglikelihood_is_exact(ar_lm):
  """Against a float64 log-softmax of the model's logits over the whole row."""
  reqs = [_instance("loglikelihood", (ctx, c)) for ctx, cs, _ in CHOICES for c in cs]
  got = ar_lm.loglikelihood(reqs)
  model = bind(ar_lm.loaded.spec, ar_lm.loaded.params)
  pairs = [ar_lm.encode_pair(*r.args) for r in reqs]
  # One batch, right-padded: a causal model's logits at a position do not read what follows.
  width = max(len(ctx) + len(cont) for ctx, cont in pairs)
  batch = np.zeros((len(pairs), width), np.int32)
  for i, (ctx, cont) in enumerate(pairs):
    batch[i, :len(ctx) + len(cont)] = ctx + cont
  all_logits = np.asarray(model(jax.numpy.asarray(batch)), np.float64)
  for (ll, greedy), (ctx, cont), logits in zip(got, pairs, all_logits):
    row = np.asarray([ctx + cont], np.int32)
    logits = logits[:row.shape[1]]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    pos = np.arange(len(ctx) - 1, row.shape[1] - 1)
    want = logp[pos, row[0, pos + 1]].sum()
    np.testing.assert_allclose(ll, want, rtol=1e-4, atol=1e-4)
    assert greedy == bool((logits[pos].argmax(-1) == row[0, pos + 1]).all())
  # Context and continuation split as lm_eval's HF models split them: the
  # context's trailing space goes with the continuation.
  assert ar_lm.encode_pair("x = ", "1") == ar_lm.encode_pair("x =", " 1")


@pytest.mark.slow  # two scorers' compiles; the e2e test scores through the same path
def test_diffusion_loglikelihood_is_a_seeded_bound(mdlm_lm, tiny_checkpoints):
  reqs = [_instance("loglikelihood", (ctx, c)) for ctx, cs, _ in CHOICES for c in cs]
  first = mdlm_lm.loglikelihood(reqs)
  assert first == mdlm_lm.loglikelihood(reqs)  # the same seed, the same numbers
  assert all(ll < 0 and isinstance(g, bool) for ll, g in first)
  other = harness.MDLMJaxLM(checkpoint=tiny_checkpoints["mdlm"], mc_samples=4, seed=2)
  assert [ll for ll, _ in other.loglikelihood(reqs)] != [ll for ll, _ in first]
  # The context conditions: the same continuation after another context scores differently.
  a, b = mdlm_lm.loglikelihood([_instance("loglikelihood", ("import os\nimport", " sys")),
                                _instance("loglikelihood", ("x = [1, 2", " sys"))])
  assert a[0] != b[0]


@pytest.mark.slow  # engine and generator compiles; the e2e test generates through the engine
def test_diffusion_greedy_flag_follows_the_engine(mdlm_lm):
  """is_greedy holds for the engine's own greedy tokens and fails when one differs."""
  from mdlm_jax.engine.engine import Request
  ctx = [mdlm_lm.tok.bos_id] + mdlm_lm.tok.encode("def f(x):\n")
  engine = mdlm_lm.engine_for(len(ctx), 8)
  h = engine.submit(Request(ctx, 8, engine.sampler_for(mdlm_lm.effort, temperature=0.0), seed=mdlm_lm.seed,
                            logprobs=0))
  ids = [e[0] for ev in h.events(timeout=120) for e in (ev.logprobs or [])]
  assert ids
  other = list(ids)
  other[-1] = other[-1] - 1 if other[-1] > 0 else 1
  assert mdlm_lm.greedy_diffusion([(ctx, ids), (ctx, other), (ctx, ids[:3])]) == [True, False, True]


@pytest.mark.slow  # engine and generator compiles; the e2e test generates through the engine
def test_generate_until_honours_its_arguments_and_refuses_others(mdlm_lm, ar_lm):
  for lm in (mdlm_lm, ar_lm):
    outs = lm.generate_until([_instance("generate_until", ("def f(x):\n", {"until": ["\n"], "max_gen_toks": 12})),
                              _instance("generate_until", ("import", {"until": [], "max_gen_toks": 4}))])
    assert "\n" not in outs[0]
    assert len(lm.tok.encode(outs[1])) <= 4 + 1
  with pytest.raises(ValueError, match="unsupported generation arguments \\['top_k'\\]"):
    ar_lm.generate_until([_instance("generate_until", ("x", {"top_k": 5}))])


def test_rolling_loglikelihood_sums_disjoint_windows(ar_lm):
  """A text longer than max_length is scored window by window: the AR sum is
  the exact log-likelihood of each window given the one before."""
  text = "def add(a, b):\n    return a + b\n" * 40
  (total,) = ar_lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))])
  ids = ar_lm.tok.encode(text)
  assert len(ids) > ar_lm.max_length
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
  windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, ar_lm.tok.bos_id, ar_lm.max_length, 1)]
  assert sum(len(c) for _, c in windows) == len(ids)
  np.testing.assert_allclose(total, ar_lm.score_pairs([(list(c), list(x)) for c, x in windows]).sum(), rtol=1e-6)
  assert total < 0


def _tasks(tmp_path):
  """Three tasks over jsonl files: multiple choice, generation, perplexity."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  mc = tmp_path / "mc.jsonl"
  mc.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in CHOICES))
  gen = tmp_path / "gen.jsonl"
  gen.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                         for p, t in (("def f(x):\n    return", " x"), ("import", " os"))))
  (tmp_path / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
  (tmp_path / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
  (tmp_path / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{prompt}}}}{{{{target}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""")
  return tmp_path


@pytest.mark.slow  # lm-eval's whole run over local tasks (about 30 s on 2 cores)
def test_simple_evaluate_runs_local_tasks_end_to_end(mdlm_lm, tmp_path):
  import lm_eval
  from lm_eval.tasks import TaskManager
  out = lm_eval.simple_evaluate(model=mdlm_lm, tasks=["tiny_mc", "tiny_gen", "tiny_ppl"],
                                task_manager=TaskManager(include_path=str(_tasks(tmp_path))), log_samples=False)
  res = out["results"]
  assert 0.0 <= res["tiny_mc"]["acc,none"] <= 1.0
  assert 0.0 <= res["tiny_gen"]["exact_match,none"] <= 1.0
  assert res["tiny_ppl"]["word_perplexity,none"] > 1.0 and res["tiny_ppl"]["bits_per_byte,none"] > 0


def test_the_packaged_offline_tasks_hold_out_their_answers():
  """pycode_next_line: the true next line among three from other files, on
  held-out standard-library files."""
  from mdlm_jax.harness_tasks import pycode
  rows = pycode.next_line_docs()["test"]
  assert len(rows) >= 20
  for r in rows:
    truth = r["choices"][r["answer"]]
    assert len(set(r["choices"])) == 4 and truth.strip()
  docs = pycode.held_out_documents()
  first = rows[0]
  assert any(first["context"] + first["choices"][first["answer"]] in d for d in docs)  # the line that follows


@pytest.mark.slow
def test_the_packaged_offline_tasks_run(mdlm_lm):
  import lm_eval
  from lm_eval.tasks import TaskManager
  out = lm_eval.simple_evaluate(model=mdlm_lm, tasks=["pycode_next_line", "pycode_ppl"], limit=2,
                                task_manager=TaskManager(include_path=harness.TASKS_DIR))
  assert 0.0 <= out["results"]["pycode_next_line"]["acc,none"] <= 1.0
  assert out["results"]["pycode_ppl"]["bits_per_byte,none"] > 0


@pytest.mark.slow
def test_the_command_line_registers_the_model(tiny_checkpoints, tmp_path):
  tasks = _tasks(tmp_path / "tasks")
  r = subprocess.run([sys.executable, "-m", "mdlm_jax.harness", "--model", "mdlm_jax", "--model_args",
                      f"checkpoint={tiny_checkpoints['ar']}", "--batch_size", "4", "--tasks", "tiny_mc", "--include_path",
                      str(tasks), "--output_path", str(tmp_path / "out")],
                     capture_output=True, text=True, timeout=600, cwd=REPO,
                     env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "tiny_mc" in r.stdout and "acc" in r.stdout
