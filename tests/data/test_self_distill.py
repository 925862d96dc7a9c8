"""Self-distillation data: answers kept in order with their instruction's index, cut answers
dropped, tool calls copied, and a killed run resumed without repeating or losing a record."""

import json
import types

import pytest

from mdlm_jax import distill
from mdlm_jax.data import self_distill

WRITE = [{"messages": [{"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": "x"}]}
         for i in range(5)]
CALL = {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
    {"role": "user", "content": "call f"}, {"role": "assistant", "content": "", "tool_calls": []}]}
INFILL = {"fim": {"prefix": "a", "middle": "b", "suffix": "c"}}


class Echo:
  """An AR generator stub: answers "done: <prompt>", cut (no end of turn) for task 3."""

  def __init__(self):
    self.batches = []

  def generate(self, prompts, *, max_new_tokens, stop, add_bos):
    assert stop == ["<end>"] and add_bos
    self.batches.append(list(prompts))
    return types.SimpleNamespace(completions=[types.SimpleNamespace(
        text=f" done: {p} ", tokens=[1, 2], finish_reason="length" if "task 3" in p else "stop") for p in prompts])


def render(messages):
  return "[" + messages[0]["content"] + "]", ("<end>",), True


def test_answers_calls_and_resume(tmp_path):
  records = self_distill.requests_of(WRITE[:3] + [CALL, INFILL] + WRITE[3:])
  assert len(records) == 6 and INFILL not in records
  out = str(tmp_path / "d.jsonl")
  gen = Echo()
  counts = self_distill.distill(gen, render, records[:4], out, batch_size=3, source="base")
  assert (counts.kept, counts.cut, counts.calls, counts.tokens) == (3, 0, 1, 6)
  assert gen.batches == [["[task 0]", "[task 1]", "[task 2]"]]  # the call needs no answer
  # Killed mid-line after the next batch: the cut line goes, the run resumes after the last whole one.
  with open(out, "a") as f:
    f.write('{"messages": [{"role": "user", "content": "task 3"}, {"role": "assi')
  counts = self_distill.distill(gen, render, records, out, batch_size=3, source="base")
  assert (counts.kept, counts.cut, counts.calls) == (1, 1, 0)
  lines = [json.loads(line) for line in open(out)]
  assert [r["index"] for r in lines] == [0, 1, 2, 3, 5]  # 4 (task 3) was cut: dropped
  assert lines[0]["messages"] == [{"role": "user", "content": "task 0"},
                                  {"role": "assistant", "content": "done: [task 0]"}]
  assert lines[3]["tools"] == CALL["tools"] and lines[3]["messages"] == CALL["messages"]
  assert self_distill.distill(gen, render, records, out, batch_size=3).requests == 0  # nothing left


@pytest.mark.slow  # compiles the tiny AR decoder (about 20 s on 2 cores); the stub test covers the logic
def test_the_cli_answers_with_a_real_ar_model(tiny_checkpoints, tmp_path, capsys):
  src = tmp_path / "train.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in WRITE[:2] + [INFILL]))
  out = tmp_path / "d.jsonl"
  distill.main([f"--instructions={src}", f"--checkpoint={tiny_checkpoints['ar']}", f"--out={out}",
                "--max-new-tokens=4", "--batch-size=2"])
  counts = json.loads(capsys.readouterr().out)
  assert counts["requests"] == 2 and counts["kept"] + counts["cut"] == 2 and counts["tokens"] >= 2
  kept = [json.loads(line) for line in open(out)] if out.exists() else []
  assert len(kept) == counts["kept"] and all(r["messages"][1]["role"] == "assistant" for r in kept)
