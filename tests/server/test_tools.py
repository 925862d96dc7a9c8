"""Tool calls read back out of an answer: whole, and streamed in any chunking."""

import json
import random

import pytest

from mdlm_jax.server import tools

ANSWER = ('Checking both.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\u00e1ris"}}\n</tool_call>')


def test_split_reads_content_and_every_complete_call():
  content, calls = tools.split(ANSWER)
  assert content == "Checking both."
  assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": [2, "}"]}),
                                                                ("get_weather", {"city": "Páris"})]
  assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
  cut = ANSWER[:ANSWER.rindex("<tool_call>") + 20]  # the second call cut by max_tokens is dropped
  assert [c.name for c in tools.split(cut)[1]] == ["add"]
  assert tools.split("just text") == ("just text", [])


@pytest.mark.parametrize("seed", range(5))
def test_streamed_deltas_assemble_into_the_same_calls(seed):
  """However the text arrives, the deltas rebuild exactly the content and
  the calls `split` reads, arguments byte for byte."""
  rng = random.Random(seed)
  stream, pos, deltas = tools.CallStream(), 0, []
  while pos < len(ANSWER):
    pos = min(len(ANSWER), pos + rng.randint(1, 9))
    deltas += stream.feed(ANSWER[:pos])
  deltas += stream.feed(ANSWER, final=True)
  content = "".join(d.get("content", "") for d in deltas)
  calls = {}
  for d in deltas:
    for c in d.get("tool_calls", []):
      slot = calls.setdefault(c["index"], {"name": None, "arguments": ""})
      slot["name"] = c.get("function", {}).get("name") or slot["name"]
      slot["arguments"] += c["function"].get("arguments", "")
  want_content, want_calls = tools.split(ANSWER)
  assert content == want_content
  assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == \
      [(c.name, json.loads(c.arguments)) for c in want_calls]


def test_parse_names_the_bad_field():
  ok = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
  for body, param in [({"tools": [ok], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
                      ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
                       "tools[0].function.parameters"),
                      ({"tools": [ok], "parallel_tool_calls": 1}, "parallel_tool_calls")]:
    with pytest.raises(tools.ToolError) as e:
      tools.parse(body)
    assert e.value.param == param
  assert tools.parse({"tools": [ok]}).choice == "auto" and tools.parse({}) is None
