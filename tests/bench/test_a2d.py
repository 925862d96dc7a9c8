"""bench a2d: an adapted model and its base, side by side on the same prompts."""

import json
import os

import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.bench import a2d
from mdlm_jax.checkpoints import params_only
from mdlm_jax.sampling import draft_table
from tests.bench.test_humaneval import cache  # noqa: F401  pylint: disable=unused-import (a fixture)
from tests.conftest import adapted_from


def adapters_over(base_path: str, out: str) -> str:
  """An adapters-only folder over the tiny AR run `base_path`, its adapters random."""
  adapted = adapted_from(checkpoints.load(base_path))
  adapted.config.train.update(init_from=base_path, trainable="adapters")
  return params_only.save(out, adapted.params, adapted.config, adapted.tokenizer, step=0, dtype="float32",
                          base=base_path)


@pytest.mark.slow  # engines, a generator and an AR decoder compile (about two minutes on 2 cores)
def test_the_adapted_model_is_set_beside_its_base(tiny_checkpoints, cache, tmp_path, capsys):  # noqa: F811
  folder = adapters_over(tiny_checkpoints["ar"], str(tmp_path / "adapted"))
  assert a2d.base_of(folder, checkpoints.load(folder)) == tiny_checkpoints["ar"]
  rng = np.random.default_rng()
  vocab = checkpoints.load(folder).spec.cfg.vocab_size
  table = draft_table.build([rng.integers(0, 20, 200).tolist()], vocab)  # drafts that rarely hold
  draft_table.save(table, os.path.join(folder, draft_table.FILE_NAME))
  a2d.main([f"--checkpoint={folder}", f"--cache={cache}", "--limit=2", "--answer-tokens=8", "--efforts=medium",
            "--code-prompts=2", "--prompt-tokens=16", "--new-tokens=8", "--lookups=0,2", "--draft-tables=on,off",
            "--first-token", "--json", f"--png={tmp_path / 'a2d.png'}"])
  res = json.loads(capsys.readouterr().out)
  he = res["humaneval_chat"]
  revising = ("0.3+revise", "0.3+revise+lookup2", "0.3+revise+lookup2+table")
  settings = {"medium", *revising}
  assert set(he) == {"base", *settings, *(n + a2d.ENGINE for n in settings)}
  assert set(res["code"]) == {"base", *settings}
  assert he["base"]["tasks"] == he["medium"]["tasks"] == 2
  assert he["base"]["tokens_per_pass"] == 1.0 and he["medium"]["tokens_per_pass"] > 0.5  # (+1 pass: the last block)
  assert he["medium"]["speed_vs_base"] > 0
  # Every side's time to its first tokens, and the speed past them.
  assert all(row["first_token_s"] > 0 and row["first_token_share"] > 0 for row in he.values())
  assert he["medium"]["speed_vs_base_past_first_token"] > 0
  # Revision writes the base's greedy text, whatever drafts it, through either path: its answers are the base's.
  for name in revising + tuple(n + a2d.ENGINE for n in revising):
    assert he[name]["passed"] == he["base"]["passed"] and he[name]["answer_tokens"] == he["base"]["answer_tokens"]
    assert he[name]["same_as_base"] == 1.0
  # The generator and the engine decode one request alike.
  assert he["medium"]["answer_tokens"] == he["medium" + a2d.ENGINE]["answer_tokens"]
  assert os.path.getsize(res["png"]) > 0
  assert 0 <= res["code"]["medium"]["parse_rate"] <= 1 and res["code"]["medium"]["speed_vs_base"] > 0
  b = res["bound"]
  for name in ("base", "medium", "0.3+revise", "0.3+revise" + a2d.ENGINE):
    assert b[name]["pass_s"] == pytest.approx(he[name]["generation_s"] / he[name]["forward_passes"])
    assert 0 < b[name]["fraction_of_bound"] and b[name]["bytes_per_pass"] > b[name]["weight_bytes"] > 0
  assert 0 <= he["medium" + a2d.ENGINE]["host_share"] < 1
  assert "host_share" not in he["base"] and "host_share" not in he["medium"]


class _Timed:
  """A chat backend that records the order it answers in and takes `delay` s an answer."""

  def __init__(self, name, log, delay):
    self.name, self.log, self.delay = name, log, delay

  def chat(self, requests, *, max_tokens, seed):
    import time
    self.log.append(self.name if max_tokens > 1 else self.name + "1")
    time.sleep(self.delay if max_tokens > 1 else self.delay / 5)
    return [f"```python\ndef f():\n  return {len(self.log)}\n```"], {"tokens": 4, "passes": 2}


def test_interleaved_chat_rotates_the_order_and_times_each_side_alone():
  from mdlm_jax.bench import humaneval
  tasks = [humaneval.Task(f"t/{i}", "", "", "", "assert f() > 0\n", request="r", prompt="def f():\n", entry_point="f")
           for i in range(3)]
  log = []
  sides = {"a": _Timed("a", log, 0.0), "b": _Timed("b", log, 0.05), "c": _Timed("c", log, 0.0)}
  rows = humaneval.run_chat_interleaved(sides, tasks, max_tokens=8, jobs=1, timeout_s=5.0, memory_mb=1024)
  assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
  assert rows["b"]["generation_s"] >= 0.15 > rows["a"]["generation_s"]
  assert rows["a"]["tokens_per_pass"] == 2.0 and rows["a"]["answer_tokens"] == 12
  assert rows["c"]["tokens_per_s"] > rows["b"]["tokens_per_s"]
  assert all(len(r["passed"]) == 3 and r["pass@1"] == 1.0 and len(r["answers"]) == 3 for r in rows.values())


def test_bad_agreements_are_refused(capsys):
  for bad in ("0", "1.5", "x", ""):
    with pytest.raises(SystemExit):
      a2d.parse([f"--agreements={bad}"])
    assert "--agreements" in capsys.readouterr().err


def test_revision_alone_is_a_setting_and_nothing_at_all_is_refused(capsys):
  a = a2d.parse(["--efforts=", "--revise-thresholds=0.3"])
  assert a.efforts == [] and a.revise_thresholds == [0.3]
  with pytest.raises(SystemExit):
    a2d.parse(["--efforts=", "--revise-thresholds="])
  assert "nothing to measure" in capsys.readouterr().err


def test_chat_paths_are_the_generator_or_the_engine(capsys):
  assert a2d.parse([]).chat_paths == ["generator", "engine"]
  assert a2d.parse(["--chat-paths=engine"]).chat_paths == ["engine"]
  for bad in ("server", ""):
    with pytest.raises(SystemExit):
      a2d.parse([f"--chat-paths={bad}"])
    assert "--chat-paths" in capsys.readouterr().err


def test_draft_tables_are_on_or_off(capsys):
  assert a2d.parse(["--draft-tables=on,off"]).draft_tables == ["on", "off"]
  assert a2d.revision_name(0.3, 1.0, 2, True) == "0.3+revise+lookup2+table"
  assert a2d.revision_name(0.3, 1.0, 2, True, False) == "0.3+revise+lookup2+table+no-model-drafts"
  with pytest.raises(SystemExit):
    a2d.parse(["--draft-tables=yes"])
  assert "--draft-tables" in capsys.readouterr().err
  assert a2d.parse(["--model-drafts=auto,off"]).model_drafts == ["auto", "off"]
  with pytest.raises(SystemExit):
    a2d.parse(["--model-drafts=sometimes"])
  assert "--model-drafts" in capsys.readouterr().err


def test_narrow_passes_are_off_or_on(capsys):
  assert a2d.parse([]).narrow_passes == ["off"]
  a = a2d.parse(["--narrow-passes=off,on", "--table-floor=0.2"])
  assert a.narrow_passes == ["off", "on"] and a.table_floor == 0.2
  assert a2d.revision_name(0.3, 1.0, 2, True, None, True) == "0.3+revise+lookup2+table+narrow"
  for bad in (["--narrow-passes=auto"], ["--table-floor=2"]):
    with pytest.raises(SystemExit):
      a2d.parse(bad)
    assert bad[0].split("=")[0] in capsys.readouterr().err


def test_head_widths_are_positive_integers_and_name_their_rows(capsys):
  assert a2d.parse([]).head_widths == []
  assert a2d.parse(["--head-widths=6,8"]).head_widths == [6, 8]
  assert a2d.revision_name(0.3, 1.0, 2, True, None, False, 8) == "0.3+revise+lookup2+table+head8"
  assert a2d.revision_name(0.3, 1.0, 2, True, None, False, None) == "0.3+revise+lookup2+table"
  for bad in (["--head-widths=six"], ["--head-widths=0"]):
    with pytest.raises(SystemExit):
      a2d.parse(bad)
    assert "--head-widths" in capsys.readouterr().err


def test_generator_backends_sharing_a_generator_each_decode_with_their_own_draft_table(monkeypatch):
  from types import SimpleNamespace
  from mdlm_jax.bench import humaneval
  monkeypatch.setattr(humaneval, "_rendered", lambda gen, requests: [(r, (), True) for r in requests])
  seen = []

  def generate(prompts, **kw):
    seen.append(gen.draft_table)
    c = SimpleNamespace(text=prompts[0], tokens=[1, 2, 3])
    return SimpleNamespace(completions=[c], forward_passes=2)

  gen = SimpleNamespace(draft_table="shared", generate=generate)
  with_table, without = humaneval.GeneratorBackend(gen, "s", "table"), humaneval.GeneratorBackend(gen, "s")
  for backend in (with_table, without, with_table):
    out, stats = backend.chat(["r"], max_tokens=4, seed=0)
    assert out == ["r"] and stats == {"tokens": 3, "passes": 2}
  assert seen == ["table", None, "table"]


def test_interleaved_chat_times_each_sides_first_token_right_after_its_answer():
  from mdlm_jax.bench import humaneval
  tasks = [humaneval.Task(f"t/{i}", "", "", "", "assert f() > 0\n", request="r", prompt="def f():\n", entry_point="f")
           for i in range(2)]
  log = []
  sides = {"a": _Timed("a", log, 0.0), "b": _Timed("b", log, 0.1)}
  rows = humaneval.run_chat_interleaved(sides, tasks, max_tokens=8, jobs=1, timeout_s=5.0, memory_mb=1024,
                                        first_token=True)
  assert log == ["a", "a1", "b", "b1", "b", "b1", "a", "a1"]
  assert 0.04 <= rows["b"]["first_token_s"] < 0.2 <= rows["b"]["generation_s"]
  assert rows["a"]["first_token_s"] < 0.04
  # 2 answers of 4 tokens: 3 tokens each after the first, over the time past the first tokens.
  row = {"answer_tokens": 8, "generation_s": 2.0, "first_token_s": 0.5}
  assert a2d.past_first_token(row, 2) == pytest.approx(6 / 1.5)
