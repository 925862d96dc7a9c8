"""Self-distilled code: windows drawn from long enough training files, reproducibly; the base's
continuations written in order with their window's index; a killed run resumed without
repeating or losing a window; and the draft table reading them."""

import json
import types

import numpy as np
import pytest

from mdlm_jax import distill
from mdlm_jax.data import code_windows
from mdlm_jax.sampling import draft_table


class Chars:
  """A tokenizer of one id per character."""

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


class Echo:
  """An AR generator stub: continues a prompt with its reverse, nothing for a prompt that starts with 'z'."""

  def __init__(self):
    self.batches = []

  def generate(self, prompts, *, max_new_tokens, sampler):
    assert sampler.temperature == 0.0 and max_new_tokens == 3
    self.batches.append(list(prompts))
    text = lambda p: "" if p.startswith("z") else p[::-1][:max_new_tokens]
    return types.SimpleNamespace(completions=[types.SimpleNamespace(text=text(p), tokens=list(text(p)))
                                              for p in prompts])


def test_windows_come_from_long_enough_files_and_repeat_for_a_seed():
  rng = np.random.default_rng()
  docs = ["".join(rng.choice(list("abcdefgh"), int(rng.integers(1, 40)))) for _ in range(30)] + ["x" * 7]
  got = code_windows.windows(docs, Chars(), 50, 4, seed=3)
  assert len(got) == 50 and got == code_windows.windows(docs, Chars(), 50, 4, seed=3)
  for w in got:
    assert len(w) == 4
    # from a file of at least 8 characters, with at least 4 after the window
    assert any(len(d) >= 8 and any(d[i:i + 4] == w for i in range(len(d) - 7)) for d in docs)
  assert code_windows.windows(docs, Chars(), 50, 4, seed=4) != got
  with pytest.raises(ValueError, match="no document holds 200 tokens"):
    code_windows.windows(docs, Chars(), 1, 100)


def test_continuations_in_order_and_resume(tmp_path):
  prompts = ["abc", "zz", "def", "ghi", "jkl"]
  out = str(tmp_path / "c.jsonl")
  gen = Echo()
  counts = code_windows.continue_windows(gen, prompts[:3], out, new_tokens=3, batch_size=2, source="base")
  assert (counts.requests, counts.kept, counts.cut) == (3, 2, 1)
  assert gen.batches == [["abc", "zz"], ["def"]]
  with open(out, "a") as f:  # killed mid-line
    f.write('{"prompt": "ghi", "compl')
  counts = code_windows.continue_windows(gen, prompts, out, new_tokens=3, batch_size=2)
  assert counts.requests == 2 and gen.batches[-1] == ["ghi", "jkl"]
  lines = [json.loads(line) for line in open(out)]
  assert [r["index"] for r in lines] == [0, 2, 3, 4]
  assert lines[0] == {"prompt": "abc", "completion": "cba", "index": 0, "source": "base"}
  assert code_windows.continue_windows(gen, prompts, out, new_tokens=3).requests == 0
  # The draft table reads each line as the window and its continuation.
  assert draft_table.answers_of(out) == ["abccba", "deffed", "ghiihg", "jkllkj"]


def test_the_cli_takes_instructions_or_a_corpus(capsys):
  a = distill.parse(["--corpus=stdlib", "--checkpoint=m", "--out=o"])
  assert a.corpus == "stdlib" and a.max_new_tokens == 64 and a.windows == 1000 and a.decode_dtype == "float32"
  assert distill.parse(["--instructions=i", "--checkpoint=m", "--out=o"]).max_new_tokens == 320
  for bad in (["--instructions=i", "--corpus=stdlib"], [], ["--corpus=stdlib", "--windows=-1"],
              ["--corpus=stdlib", "--validation-fraction=1"]):
    with pytest.raises(SystemExit):
      distill.parse(bad + ["--checkpoint=m", "--out=o"])
    capsys.readouterr()


@pytest.mark.slow  # compiles the tiny AR decoder (about 20 s on 2 cores); the stub test covers the logic
def test_the_cli_continues_windows_of_a_corpus_with_a_real_ar_model(tiny_checkpoints, tmp_path, capsys):
  src = tmp_path / "code"
  src.mkdir()
  for i in range(6):
    (src / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(20)))
  out = tmp_path / "c.jsonl"
  distill.main([f"--corpus={src}", f"--checkpoint={tiny_checkpoints['ar']}", f"--out={out}", "--windows=3",
                "--prompt-tokens=8", "--max-new-tokens=4", "--batch-size=2", "--validation-fraction=0"])
  counts = json.loads(capsys.readouterr().out)
  assert counts["requests"] == 3 and counts["kept"] + counts["cut"] == 3
  lines = [json.loads(line) for line in open(out)] if out.exists() else []
  assert len(lines) == counts["kept"] and all(r["prompt"] and r["completion"] for r in lines)
