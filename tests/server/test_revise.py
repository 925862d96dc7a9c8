"""`revise` through the server: an adapted model's revising answer is its base's greedy text, streamed or not."""

import json

import pytest

from mdlm_jax import checkpoints
from mdlm_jax.sampling.ar import ARSampler
from mdlm_jax.sampling.generate import ARGenerator
from tests.bench.test_a2d import adapters_over

# A server of its own (about 30 s on 2 cores). CI reaches the field through tests/server/test_server.py (a 400
# naming it) and the decoding through tests/engine/test_revise.py.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
  from fastapi.testclient import TestClient
  from mdlm_jax import serve
  folder = adapters_over(tiny_checkpoints["ar"], str(tmp_path_factory.mktemp("served") / "adapted"))
  engine, app = serve.build(serve.parse([f"--checkpoint={folder}", "--max-tokens=16", "--slots=2"]))
  engine.start()
  yield TestClient(app), app.state.server.model_id, engine.decode_dtype
  engine.close(deadline_s=1)


def test_a_revising_completion_is_the_bases_greedy_text(served, tiny_checkpoints):
  http, model, decode_dtype = served
  prompt = "def add(a, b):\n"
  want = ARGenerator(checkpoints.load(tiny_checkpoints["ar"]), decode_dtype=decode_dtype).generate(
      [prompt], max_new_tokens=12, sampler=ARSampler(12, temperature=0.0)).completions[0].text
  body = {"model": model, "prompt": prompt, "max_tokens": 12, "revise": True, "temperature": 0}
  r = http.post("/v1/completions", json=body)
  assert r.status_code == 200, r.text
  assert r.json()["choices"][0]["text"] == want
  with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
    chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
  assert "".join(c["choices"][0]["text"] for c in chunks) == want


def test_revise_where_it_cannot_work_is_a_400_naming_it(served):
  http, model, _ = served
  for path, body in (("/v1/fim/completions", {"prompt": "def f(", "suffix": ")\n"}),
                     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                               "response_format": {"type": "json_object"}})):
    r = http.post(path, json={"model": model, "max_tokens": 8, "revise": True, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "revise", r.text


def test_lookup_copies_drafts_for_revision_and_is_refused_without_it(served, tiny_checkpoints):
  http, model, decode_dtype = served
  prompt = "x = 1\n" * 6
  want = ARGenerator(checkpoints.load(tiny_checkpoints["ar"]), decode_dtype=decode_dtype).generate(
      [prompt], max_new_tokens=12, sampler=ARSampler(12, temperature=0.0)).completions[0].text
  body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
  r = http.post("/v1/completions", json={**body, "revise": True, "lookup": 1})
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
  for bad in ({"revise": True, "lookup": 5}, {"lookup": 2}, {"revise": False, "lookup": 1},
              {"revise": True, "lookup": 1.5}):
    r = http.post("/v1/completions", json={**body, **bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lookup", (bad, r.text)
