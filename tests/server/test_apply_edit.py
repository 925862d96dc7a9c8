"""Apply-edit: alignment decides what it can, byte for byte; the model places
only what alignment cannot, among placements that keep every original line."""

import json

import pytest

from mdlm_jax.server import apply_edit

ORIGINAL = '''import os

def area(w, h):
    """Area of a rectangle."""
    return w * h

def main():
    print(area(2, 3))
    return 0
'''


def _never(*_):
  raise AssertionError("alignment should have decided this edit")


def test_anchored_segments_replace_exactly_their_span():
  snippet = '''# ... existing code ...
def area(w, h):
    """Area of a rectangle, rounded."""
    return round(w * h)
# ... existing code ...
'''
  merged = apply_edit.merge(ORIGINAL, snippet, _never)
  assert merged == ORIGINAL.replace('rectangle."""', 'rectangle, rounded."""').replace(
      "return w * h", "return round(w * h)")


def test_a_changed_line_next_to_an_anchor_replaces_its_original():
  snippet = '''# ... existing code ...
def main():
    print(area(4, 5))
# ... existing code ...
'''
  merged = apply_edit.merge(ORIGINAL, snippet, _never)
  assert merged == ORIGINAL.replace("area(2, 3)", "area(4, 5)")


def test_new_lines_are_inserted_and_elided_code_kept():
  snippet = '''import os
import sys
# ... existing code ...
def main():
    print(area(2, 3), file=sys.stderr)
    return 0
'''
  merged = apply_edit.merge(ORIGINAL, snippet, _never)
  assert merged == ORIGINAL.replace("import os\n", "import os\nimport sys\n").replace(
      "print(area(2, 3))", "print(area(2, 3), file=sys.stderr)")


def test_an_unplaceable_segment_goes_where_the_model_says_among_order_keeping_candidates():
  snippet = '''# ... existing code ...
    assert w >= 0 and h >= 0
# ... existing code ...
def main():
    print(area(2, 3))
    return 0
'''
  seen = []

  def decide(before, candidates, after):
    seen.append((before, candidates, after))
    return 4  # after the docstring line

  merged = apply_edit.merge(ORIGINAL, snippet, decide)
  (before, candidates, after), = seen
  original_lines = ORIGINAL.split("\n")
  for c in candidates:  # every candidate keeps every original line of the region, in order
    lines = c.split("\n")
    lines.remove("    assert w >= 0 and h >= 0")
    assert lines == original_lines[:len(lines)]
  assert merged == ORIGINAL.replace('rectangle."""\n', 'rectangle."""\n    assert w >= 0 and h >= 0\n')
  assert before == "" and after.startswith("\ndef main():")


@pytest.mark.parametrize("content", ["no tags at all", "<|original_code|>x<|/original_code|>"])
def test_requests_without_both_parts_are_refused(content):
  with pytest.raises(apply_edit.EditError):
    apply_edit.parse(content)


def test_the_endpoint_merges_through_the_engine(tiny_checkpoints):
  """The endpoint, in the Mercury Edit shape, with a tiny model: decided lines
  byte-identical, the model's placement one of the candidates."""
  from fastapi.testclient import TestClient

  from mdlm_jax import checkpoints
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import create_app
  engine = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=2, max_prompt=128, max_new_tokens=128,
                  block_size=8)
  http = TestClient(create_app(engine, model_id="tiny"))
  original = "x = 1\ny = 2\nz = 3\n"
  snippet = "# ... existing code ...\nprint('between')\n# ... existing code ...\n"
  content = f"<|original_code|>\n{original}<|/original_code|>\n<|update_snippet|>\n{snippet}<|/update_snippet|>"
  with http:
    engine.start()
    r = http.post("/v1/apply/completions", json={"model": "tiny", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    out = r.json()
    merged = out["choices"][0]["message"]["content"]
    assert out["object"] == "chat.completion" and out["model_decisions"] == 1
    lines = merged.split("\n")
    assert "print('between')" in lines
    lines.remove("print('between')")
    assert "\n".join(lines) == original.rstrip("\n")  # every original line, in order
    bad = http.post("/v1/apply/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content"
    # The chat fields that make sense for a merged file: a token cap, stop strings, streaming.
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, "seed": 3}
    cut = http.post("/v1/apply/completions", json={**body, "max_tokens": 2}).json()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 2
    assert merged.startswith(cut["choices"][0]["message"]["content"])
    stopped = http.post("/v1/apply/completions", json={**body, "stop": ["z ="]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == merged[:merged.index("z =")]
    with http.stream("POST", "/v1/apply/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
      assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
      events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == merged
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]
    bad = http.post("/v1/apply/completions", json={**body, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    bad = http.post("/v1/apply/completions", json={**body, "tools": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
  engine.close(deadline_s=1)
