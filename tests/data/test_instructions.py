"""Instructions mined from code: write-the-function and tool-call conversations."""

import json
import random

import jsonschema

from mdlm_jax.data import chat_template
from mdlm_jax.data import instructions

MODULE = '''"""A module."""

import os


def scale(values: list, factor: float = 2.0) -> list:
    """Multiply every value by factor.

    Returns a new list.
    """
    out = [v * factor for v in values]
    return out


def greet(name: str, loud: bool = False):
    """Say hello to name."""
    text = f"hello {name}"
    return text.upper() if loud else text


def untyped(a, b):
    """No annotations: written about, never a tool."""
    return a + b


def _private(x: int):
    """Skipped."""
    return x


def no_doc(x: int):
    return x
'''


def test_functions_and_their_schemas():
  fns = {f.name: f for f in instructions.functions(MODULE)}
  assert set(fns) == {"scale", "greet", "untyped"}
  assert fns["scale"].header.startswith("def scale(values: list, factor: float = 2.0) -> list:\n")
  assert fns["scale"].header.rstrip().endswith('"""') and "return out" in fns["scale"].source
  schema = instructions.tool_schema(fns["scale"])
  assert schema["function"]["parameters"] == {
      "type": "object", "properties": {"values": {"type": "array"}, "factor": {"type": "number"}},
      "required": ["values"], "additionalProperties": False}
  assert schema["function"]["description"] == "Multiply every value by factor."
  assert instructions.tool_schema(fns["untyped"]) is None
  assert list(instructions.functions("def broken(:\n")) == []


def test_write_requests_are_put_in_several_phrasings():
  """The header as code or the task in words, each naming the function; the
  answer is always the whole function."""
  src = MODULE + """

def join_all(
    parts: list,
    sep: str = ",",
):
    \"\"\"Join parts with sep.

    Empty parts are kept.
    \"\"\"
    text = sep.join(parts)
    return text
"""
  fns = {f.name: f for f in instructions.functions(src)}
  assert instructions.signature(fns["join_all"]) == 'def join_all(\n    parts: list,\n    sep: str = ",",\n):'
  assert instructions.summary(fns["join_all"].doc) == "Join parts with sep."
  seen = set()
  for seed in range(40):
    e = instructions.write_example(fns["join_all"], random.Random(seed))
    user, answer = e["messages"][0]["content"], e["messages"][1]["content"]
    assert "join_all" in user and answer == "```python\n" + fns["join_all"].source + "```"
    seen.add(user)
  assert len(seen) == len(instructions.REQUESTS)
  assert 'Write a Python function `join_all( parts: list, sep: str = ",", )`. Join parts with sep.' in seen
  assert "Join parts with sep.\n\nWrite this as a Python function named `join_all`." in seen
  assert instructions.write_example(fns["scale"])["messages"][0]["content"].startswith("Complete this Python function.")


def test_mined_conversations_render_and_calls_validate():
  docs = [MODULE, MODULE.replace("scale", "shrink").replace("greet", "wave")]
  examples = instructions.mine(docs, per_file=2, seed=1)
  infills = [e["fim"] for e in examples if "fim" in e]
  writes = [e for e in examples if "tools" not in e and "fim" not in e]
  calls = [e for e in examples if "tools" in e]
  assert len(writes) == 4 and len(calls) == 2 and len(infills) == 4
  for e in writes + calls:
    text = chat_template.render(chat_template.CHATML, e["messages"], tools=e.get("tools"))
    assert text.count("<|im_start|>assistant") == 1 and text.endswith("<|im_end|>\n")
  for e in calls:
    call = e["messages"][1]["tool_calls"][0]["function"]
    schema = next(t for t in e["tools"] if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), schema["function"]["parameters"])
    assert len({t["function"]["name"] for t in e["tools"]}) == len(e["tools"]) >= 2
  for e in writes:
    user, answer = e["messages"][0]["content"], e["messages"][1]["content"]
    assert answer.startswith("```python\ndef ") and answer.split("def ")[1].split("(")[0] in user


def test_build_keeps_held_out_files_apart(tmp_path):
  corpus = tmp_path / "src"
  corpus.mkdir()
  for i in range(30):
    (corpus / f"m{i}.py").write_text(MODULE.replace("scale", f"scale{i}").replace("greet", f"greet{i}")
                                     .replace("untyped", f"untyped{i}"))
  counts = instructions.build(str(corpus), str(tmp_path / "out"), validation_fraction=0.3)
  train = [json.loads(line) for line in open(tmp_path / "out" / "train.jsonl")]
  held = [json.loads(line) for line in open(tmp_path / "out" / "heldout.jsonl")]
  assert counts["train"]["examples"] == len(train) > 0 and counts["heldout"]["examples"] == len(held) > 0
  names = lambda rows: {m["content"].split("def ")[1].split("(")[0] for r in rows for m in r.get("messages", [])
                        if m["role"] == "assistant" and m["content"].startswith("```python\ndef ")}
  infilled = lambda rows: {r["fim"]["prefix"].split("def ")[1].split("(")[0] for r in rows if "fim" in r}
  assert counts["train"]["infills"] == len(infilled(train)) > 0
  assert infilled(held) and not infilled(train) & infilled(held) and not infilled(train) & names(held)
  assert names(train) and names(held) and not names(train) & names(held)


def test_infill_examples_cut_one_body_line_out_of_the_function():
  """prefix + middle + suffix is the file's imports and the function; the
  middle is one whole non-blank line after the docstring, seeded."""
  import random
  fns = {f.name: f for f in instructions.functions(MODULE)}
  seen = set()
  for seed in range(20):
    e = instructions.infill_example(fns["scale"], random.Random(seed))["fim"]
    assert e["prefix"] + e["middle"] + e["suffix"] == "import os\n\n\n" + fns["scale"].source
    assert e["middle"].endswith("\n") and e["middle"].count("\n") == 1 and e["middle"].strip()
    assert '"""' not in e["middle"] and e["prefix"].count('"""') == 2
    seen.add(e["middle"])
  assert seen == {"    out = [v * factor for v in values]\n", "    return out\n"}
  assert instructions.infill_example(fns["scale"], random.Random(0)) == \
      instructions.infill_example(fns["scale"], random.Random(0))
