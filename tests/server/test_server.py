"""python -m mdlm_jax.serve against the official openai client, on 127.0.0.1."""

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import REPO, xla_flags

KEY = "sk-test-key"
MASK = "\u2591"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(checkpoint, *args, devices=1):
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
  env.pop("MDLM_API_KEY", None)
  chosen = [f"--checkpoint={checkpoint}"] if checkpoint else []  # None: the packaged default
  proc = subprocess.Popen([sys.executable, "-m", "mdlm_jax.serve", *chosen, f"--port={port}",
                           "--max-tokens=48", "--max-prompt-tokens=64", *args],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 180
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"server exited: {proc.stderr.read()}")
    try:
      if httpx.get(base + "/health", timeout=1).status_code == 200:
        return proc, base
    except httpx.HTTPError:
      pass
    time.sleep(0.2)
  proc.kill()
  raise RuntimeError("server did not come up")


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
  proc, base = start_server(tiny_checkpoints["mdlm"], f"--api-key={KEY}", "--slots=4", "--model-id=tiny",
                            "--admit-batch=1", "--no-warmup")  # batched prefills: tests/engine; compiles on first use
  yield proc, base
  if proc.poll() is None:
    proc.kill()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, **kw):
  args = dict(model="tiny", messages=[{"role": "user", "content": "Write a loop."}], max_tokens=24)
  args.update(kw)
  return client.chat.completions.create(**args)


def test_models(client):
  assert [m.id for m in client.models.list().data] == ["tiny"]
  card = client.models.retrieve("tiny").model_dump()
  assert card["context_length"] == card["max_model_len"] == 64 + 48  # --max-prompt-tokens + --max-tokens
  assert (card["max_prompt_tokens"], card["max_completion_tokens"]) == (64, 48)
  assert client.models.retrieve("tiny").id == "tiny"
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("gpt-9")


def test_chat_and_streaming_agree(client):
  full = _chat(client, temperature=0.8, seed=11)
  text = full.choices[0].message.content
  assert full.usage.completion_tokens >= 1 and full.usage.total_tokens == full.usage.prompt_tokens + \
      full.usage.completion_tokens
  chunks = list(_chat(client, temperature=0.8, seed=11, stream=True, stream_options={"include_usage": True}))
  streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert streamed == text
  assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_diffusing_stream_sends_whole_drafts(client):
  final = _chat(client, seed=3, reasoning_effort="high").choices[0].message.content
  chunks = list(_chat(client, seed=3, reasoning_effort="high", stream=True, extra_body={"diffusing": True}))
  drafts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content is not None]
  drafts = [d for d in drafts if d != ""]
  assert drafts[-1] == final and drafts[0].count(MASK) >= 1
  masks = [d.count(MASK) for d in drafts]
  assert all(a >= b for a, b in zip(masks, masks[1:])) and masks[-1] == 0


def test_completions_infill_and_fim(client, server):
  r = client.completions.create(model="tiny", prompt="def add(a, b):\n    return", max_tokens=8, seed=0)
  assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= 8
  r = client.completions.create(model="tiny", prompt="x = [", suffix="]\n", max_tokens=6, seed=0)
  assert isinstance(r.choices[0].text, str)
  out = httpx.post(server[1] + "/v1/fim/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "prompt": "x = [", "suffix": "]\n", "max_tokens": 6}, timeout=120).json()
  assert isinstance(out["choices"][0]["text"], str) and out["object"] == "text_completion"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
  from mdlm_jax import checkpoints
  return checkpoints.load(tiny_checkpoints["mdlm"]).tokenizer


def test_completions_take_prompt_lists_token_ids_and_echo(client, tokenizer):
  args = dict(model="tiny", max_tokens=8, seed=3, temperature=1.0)
  prompts = ["a = 1\n", "def f():\n"]
  both = client.completions.create(prompt=prompts, n=2, **args)
  assert [c.index for c in both.choices] == [0, 1, 2, 3]  # prompt by prompt, n choices each
  alone = [client.completions.create(prompt=p, n=2, **args) for p in prompts]
  assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
  # Prompt tokens are counted once per prompt, not once per choice.
  assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
  assert alone[0].usage.prompt_tokens == client.completions.create(prompt=prompts[0], **args).usage.prompt_tokens
  assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
  ids = [tokenizer.bos_id] + tokenizer.encode(prompts[1])
  by_ids = client.completions.create(prompt=ids, **args)
  assert by_ids.choices[0].text == alone[1].choices[0].text and by_ids.usage.prompt_tokens == len(ids)
  assert client.completions.create(prompt=[ids, ids], **args).choices[1].text == by_ids.choices[0].text
  echoed = client.completions.create(prompt=prompts[1], echo=True, **args)
  assert echoed.choices[0].text == prompts[1] + alone[1].choices[0].text
  chunks = list(client.completions.create(prompt=prompts[1], echo=True, stream=True, **args))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
  assert client.completions.create(prompt=ids, echo=True, **args).choices[0].text.startswith(prompts[1])


def test_usage_counts_the_returned_tokens(client, tokenizer):
  free = client.completions.create(model="tiny", prompt="x = [", max_tokens=16, seed=4)
  text = free.choices[0].text
  assert free.usage.completion_tokens <= 16
  if free.choices[0].finish_reason == "length":
    assert free.usage.completion_tokens == 16
  if len(text) >= 6:
    stop = text[3:5]
    cut = client.completions.create(model="tiny", prompt="x = [", max_tokens=16, seed=4, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.usage.completion_tokens < free.usage.completion_tokens  # not the tokens past the stop string
  # Fill-in-the-middle: the suffix is read too, so it is counted.
  suffix = "]\nprint(x)\n"
  fim = client.completions.create(model="tiny", prompt="x = [", suffix=suffix, max_tokens=5, seed=4)
  assert fim.usage.prompt_tokens == free.usage.prompt_tokens + len(tokenizer.encode(suffix))
  assert fim.usage.completion_tokens <= 5 and len(tokenizer.encode(fim.choices[0].text)) <= 5 + 1


def test_efforts_n_and_stop(client):
  for effort in ("instant", "low", "medium", "high"):
    assert _chat(client, reasoning_effort=effort).choices[0].finish_reason in ("stop", "length")
  r = _chat(client, n=3, temperature=1.0, seed=5)
  assert [c.index for c in r.choices] == [0, 1, 2]
  free = _chat(client, seed=2).choices[0].message.content
  if len(free) >= 4:
    cut = _chat(client, seed=2, stop=[free[2:4]]).choices[0]
    assert cut.message.content == free[:free.find(free[2:4])] and cut.finish_reason == "stop"


def _error(base, method, path, status, *, key=KEY, **kw):
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  r = httpx.request(method, base + path, headers=headers, timeout=60, **kw)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"} and err["message"]
  return err


def test_errors_have_the_openai_shape(server, client):
  base = server[1]
  ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
  assert _error(base, "POST", "/v1/chat/completions", 401, key="wrong", json=ok)["type"] == "authentication_error"
  _error(base, "GET", "/v1/models", 401, key=None)
  assert _error(base, "POST", "/v1/chat/completions", 400, json={**ok, "temperature": "hot"})["param"] == "temperature"
  assert _error(base, "POST", "/v1/chat/completions", 400, json={**ok, "n": 99})["param"] == "n"
  assert _error(base, "POST", "/v1/chat/completions", 400,
                json={**ok, "reasoning_effort": "max"})["param"] == "reasoning_effort"
  _error(base, "POST", "/v1/chat/completions", 400, json={**ok, "stop": ["a", "b", "c", "d", "e"]})
  _error(base, "POST", "/v1/chat/completions", 400, json={"model": "tiny"})
  _error(base, "POST", "/v1/chat/completions", 400, content=b"{not json")
  assert _error(base, "POST", "/v1/chat/completions", 404, json={**ok, "model": "other"})["param"] == "model"
  _error(base, "GET", "/v1/nothing", 404)
  _error(base, "POST", "/v1/chat/completions", 413, content=b"x" * (1 << 21))
  long = {**ok, "messages": [{"role": "user", "content": "word " * 400}]}
  err = _error(base, "POST", "/v1/chat/completions", 400, json=long)  # as OpenAI and vLLM answer it
  assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
  fim = {"model": "tiny", "prompt": "def f():\n", "suffix": "word " * 400, "max_tokens": 8}
  assert _error(base, "POST", "/v1/fim/completions", 400, json=fim)["code"] == "context_length_exceeded"
  with pytest.raises(openai.BadRequestError):
    _chat(client, max_tokens=10_000)
  assert httpx.get(base + "/health").json()["status"] == "ok"  # none of it hurt the server


NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "top_logprobs": 0, "logit_bias": {},
           "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
           "user": "alice"}
REFUSED = [  # (field, value, code): well formed but not implemented, or malformed
    ("presence_penalty", 2.5, "invalid_value"), ("frequency_penalty", 3, "invalid_value"),
    ("presence_penalty", "high", "invalid_value"),
    ("logprobs", "yes", "invalid_value"), ("top_logprobs", 99, "invalid_value"), ("logit_bias", [1], "invalid_value"),
    ("logit_bias.5", {"5": 101}, "invalid_value"), ("logit_bias.-5", {"-5": 1}, "invalid_value"),
    ("logit_bias.1000000", {"1000000": 1}, "invalid_value"), ("tools", "f", "invalid_value"),
    ("tool_choice", "sometimes", "invalid_value"),
    ("response_format", {"type": "xml"}, "invalid_value"), ("user", 7, "invalid_value"),
    ("functions", [], "unsupported_parameter"), ("frobnicate", 1, "unsupported_parameter"),
    ("revise", "yes", "invalid_value"),
    ("revise", True, "invalid_value"),  # this model has no base to check drafts against
    ("agreement", 0.5, "invalid_value"),  # revision's setting, and revise is not asked for
    ("agreement", 0, "invalid_value"), ("agreement", "near", "invalid_value"),
    ("sampler", "ancestral", "invalid_value"), ("sampler", 3, "invalid_value"),
    ("steps", 4, "invalid_value"),  # steps belong to sampler=low_confidence
]


def test_every_field_is_implemented_or_refused_by_name(server):
  base = server[1]
  ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
  r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={**ok, **NEUTRAL},
                 timeout=60)
  assert r.status_code == 200, r.text
  for field, value, code in REFUSED:
    err = _error(base, "POST", "/v1/chat/completions", 400, json={**ok, field.split(".")[0]: value})
    param = "response_format.type" if value == {"type": "xml"} else field
    assert (err["param"], err["code"]) == (param, code), (field, value, err)
  err = _error(base, "POST", "/v1/chat/completions", 400,
               json={**ok, "messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}]})
  assert err["param"] == "messages[0].audio"
  done = {"model": "tiny", "prompt": "x", "max_tokens": 4}
  for field, value in (("logprobs", 7), ("best_of", 3), ("suffix", 5), ("echo", "yes"), ("prompt", [[1], "a", 3]),
                       ("messages", [])):
    assert _error(base, "POST", "/v1/completions", 400, json={**done, field: value})["param"].startswith(field)
  assert _error(base, "POST", "/v1/completions", 400, json={**done, "echo": True, "suffix": "y"})["param"] == "echo"
  assert _error(base, "POST", "/v1/completions", 400, json={**done, "prompt": [10 ** 6]})["param"] == "prompt[0]"
  assert _error(base, "POST", "/v1/fim/completions", 400, json={**done, "echo": True})["param"] == "echo"
  for field, value in (("best_of", 1), ("logprobs", None), ("presence_penalty", 0)):
    r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={**done, field: value}, timeout=60)
    assert r.status_code == 200, (field, r.text)


def test_the_low_confidence_rule_is_served_as_the_generator_decodes_it(server, tiny_checkpoints):
  """sampler=low_confidence with steps: the one-shot LLaDA sampler's text, in steps passes a block."""
  from mdlm_jax import checkpoints
  from mdlm_jax.sampling import presets
  from mdlm_jax.sampling.generate import Generator
  from mdlm_jax.sampling.samplers import LowConfidenceSampler
  loaded = checkpoints.load(tiny_checkpoints["mdlm"])
  bs = presets.block_size_for(loaded.config.diffusion.block_size)
  seed = int(np.random.default_rng().integers(0, 2 ** 30))
  body = {"model": "tiny", "prompt": "def f(x):\n", "max_tokens": 12, "sampler": "low_confidence", "steps": 2,
          "temperature": 0.7, "seed": seed}
  r = httpx.post(server[1] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
  assert r.status_code == 200, r.text
  # the weights the server decodes from: its default, "auto", resolves here as there (the same machine)
  sampler = LowConfidenceSampler(steps=2, temperature=0.7, block_size=bs, kv_cache=True)
  want = Generator(loaded, decode_dtype="auto").generate(["def f(x):\n"], max_new_tokens=12, seed=seed,
                                                         sampler=sampler).completions[0]
  got = r.json()
  assert got["choices"][0]["text"] == want.text
  assert got["usage"]["forward_passes"] == 1 + 2 * -(-max(got["usage"]["completion_tokens"], 1) // bs)
  for extra, param in (({"reasoning_effort": "high"}, "reasoning_effort"), ({"revise": True}, "revise"),
                       ({"steps": 0}, "steps")):
    assert _error(server[1], "POST", "/v1/completions", 400, json={**body, **extra})["param"] == param


def test_logit_bias_and_penalties_reach_the_decoder(server, tiny_checkpoints):
  """A +100 bias makes every token the biased one; penalties are taken."""
  from mdlm_jax import checkpoints
  tok = checkpoints.load(tiny_checkpoints["mdlm"]).tokenizer
  piece = tok.encode("x")[-1]
  body = {"model": "tiny", "prompt": "def f(x):\n", "max_tokens": 8, "logit_bias": {str(piece): 100}}
  r = httpx.post(server[1] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
  assert r.status_code == 200, r.text
  assert r.json()["choices"][0]["text"] == tok.decode([piece] * 8)
  body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
          "presence_penalty": 1.5, "frequency_penalty": -0.5}
  r = httpx.post(server[1] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                 timeout=60)
  assert r.status_code == 200, r.text


def _finished(base: str, reason: str) -> int:
  for line in httpx.get(base + "/metrics").text.splitlines():
    if line.startswith(f'mdlm_finished_total{{reason="{reason}"}}'):
      return int(line.split()[-1])
  return 0


def test_a_non_streaming_client_that_leaves_is_cancelled(server):
  """Eight clients ask for eight completions each and hang up after 0.3 s:
  their 64 requests are cancelled, not decoded to the end."""
  base = server[1]
  body = {"model": "tiny", "prompt": "def f(x):\n", "max_tokens": 48, "n": 8, "reasoning_effort": "high",
          "temperature": 1.0}
  cancelled = _finished(base, "cancelled")

  def leave(_):
    try:  # the first clients in line may be served within the 0.3 s
      httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                 timeout=httpx.Timeout(60, read=0.3))
      return False
    except httpx.ReadTimeout:
      return True

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    assert sum(pool.map(leave, range(8))) >= 4
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and (h := httpx.get(base + "/health").json())["active"] + h["queue_depth"]:
    time.sleep(0.05)
  assert _finished(base, "cancelled") - cancelled >= 32  # most never got a slot before their client left


def test_sixteen_concurrent_streams(client):
  def one(seed):
    chunks = list(_chat(client, seed=seed, temperature=1.0, stream=True))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].choices[0].finish_reason

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    results = list(pool.map(one, [i % 4 for i in range(16)]))
  for i, (text, finish) in enumerate(results):
    assert finish in ("stop", "length")
    assert text == results[i % 4][0]  # the same seed, the same answer, whoever shared the batch


def test_disconnect_frees_the_slot(server):
  base = server[1]
  body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 48, "stream": True,
          "reasoning_effort": "high"}
  with httpx.stream("POST", base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                    timeout=60) as r:
    next(r.iter_lines())
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and httpx.get(base + "/health").json()["active"]:
    time.sleep(0.1)
  assert httpx.get(base + "/health").json()["active"] == 0
  metrics = httpx.get(base + "/metrics").text
  assert "mdlm_requests_total" in metrics and "mdlm_request_latency_seconds_bucket" in metrics


@pytest.mark.slow
def test_mesh_server_matches_one_device_and_sigterm_exits_cleanly(tiny_checkpoints, client):
  proc, base = start_server(tiny_checkpoints["mdlm"], "--slots=4", "--model-id=tiny", "--mesh=data=2,tensor=2",
                            devices=4)
  try:
    assert httpx.get(base + "/v1/models").status_code == 200  # no --api-key: no Authorization needed
    mesh_client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in (0, 1):
      want = _chat(client, seed=seed, temperature=1.0).choices[0].message.content
      assert _chat(mesh_client, seed=seed, temperature=1.0).choices[0].message.content == want
  finally:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


@pytest.mark.slow
def test_two_process_server_matches_one_device_and_stops_on_sigterm(tiny_checkpoints, client):
  """One server process per host: 2 processes x 2 CPU devices (gloo) with the
  mesh over all 4; process 0 serves HTTP, process 1 decodes in lockstep. Same
  completions as one device for the same seeds; SIGTERM stops both, exit 0."""
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MDLM_API_KEY")}
  proc = subprocess.Popen([sys.executable, os.path.join(REPO, "launch", "local.py"), "--num-processes", "2",
                           "--devices-per-process", "2", "--", sys.executable, "-m", "mdlm_jax.serve",
                           f"--checkpoint={tiny_checkpoints['mdlm']}", f"--port={port}", "--max-tokens=48",
                           "--max-prompt-tokens=64", "--slots=4", "--model-id=tiny", "--mesh=data=2,tensor=2"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  base = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 240
    while True:
      assert proc.poll() is None, proc.stdout.read()
      assert time.monotonic() < deadline, "the two-process server did not come up"
      try:
        if httpx.get(base + "/health", timeout=1).status_code == 200:
          break
      except httpx.HTTPError:
        time.sleep(0.3)
    two = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # requests share passes across both processes
      got = list(pool.map(lambda kw: _chat(two, **kw).choices[0].message.content,
                          [dict(seed=0), dict(seed=1, temperature=1.0), dict(seed=2, temperature=1.0, top_p=0.9)]))
    want = [_chat(client, **kw).choices[0].message.content
            for kw in (dict(seed=0), dict(seed=1, temperature=1.0), dict(seed=2, temperature=1.0, top_p=0.9))]
    assert got == want
  finally:
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=90)[0]
  assert proc.returncode == 0, out[-3000:]
  assert "[p1] process 1: following process 0" in out and "[p1] process 1: shut down" in out


def test_engine_flags_reach_the_engine(tiny_checkpoints):
  from mdlm_jax import serve
  for flag, layout in ((None, "out_in"), ("in_out", "in_out")):  # out_in: the CPU default
    a = serve.parse([f"--checkpoint={tiny_checkpoints['mdlm']}", "--slots=2", "--max-tokens=16"] +
                    ([f"--weight-layout={flag}"] if flag else []))
    engine, _ = serve.build(a)
    assert engine.loaded.spec.cfg.weight_layout == layout
    assert engine.grammar_policy == "bridge"
  engine, _ = serve.build(serve.parse([f"--checkpoint={tiny_checkpoints['mdlm']}", "--slots=2", "--max-tokens=16",
                                       "--grammar-policy=valid", "--admit-batch=8", "--prefill-chunk=64",
                                       "--passes-per-turn=3"]))
  assert engine.grammar_policy == "valid"
  assert engine.admit_batch == 2  # no more than the slots
  assert engine.prefill_chunk == 64
  assert engine.passes_per_turn == 3
  for bad in ("--weight-layout=rows", "--admit-batch=0", "--max-context=0", "--kv-cache-memory=lots",
              "--slots=2 --kv-cache-memory=1GiB", "--prefill-chunk=8", "--prefill-chunk=-1", "--passes-per-turn=0"):
    with pytest.raises(SystemExit):
      serve.parse(bad.split())


def test_kv_cache_memory_sizes_the_slots_and_the_context_bounds_requests(tiny_checkpoints):
  """--kv-cache-memory buys as many slots of --max-context tokens as fit; a
  request past the context is 400 context_length_exceeded, /health and
  /metrics account the cache."""
  from fastapi.testclient import TestClient
  from mdlm_jax import serve
  from mdlm_jax.model.kv_cache import KVCache
  base = [f"--checkpoint={tiny_checkpoints['mdlm']}", "--max-tokens=64", "--max-context=80", "--admit-batch=1"]
  engine, _ = serve.build(serve.parse(base + ["--slots=1"]))
  per_slot = (80 + engine.sc.block_size) * KVCache.bytes_per_token(engine.loaded.spec.cfg)
  engine, app = serve.build(serve.parse(base + [f"--kv-cache-memory={3 * per_slot + per_slot // 2}"]))
  assert engine.num_slots == 3 and engine.kv_cache_bytes == 3 * per_slot and engine.sc.context == 80
  with pytest.raises(ValueError, match="holds no slot"):
    serve.build(serve.parse(base + [f"--kv-cache-memory={per_slot - 1}"]))
  engine.start()
  try:
    http = TestClient(app)
    prompt = " ".join(["x"] * 12)  # ~24 tokens: fits the prompt bound alone, not with 64 more
    r = http.post("/v1/completions", json={"model": app.state.server.model_id, "prompt": prompt, "max_tokens": 64})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "context is 80" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": app.state.server.model_id, "prompt": "def f", "max_tokens": 8})
    assert r.status_code == 200, r.text
    health = http.get("/health").json()
    assert (health["context"], health["kv_cache_bytes"], health["kv_cache_tokens"]) == (80, 3 * per_slot, 3 * 80)
    assert f"mdlm_kv_cache_bytes {3 * per_slot}" in http.get("/metrics").text
    assert http.get("/v1/models").json()["data"][0]["context_length"] == 80
  finally:
    engine.close(deadline_s=1)


def test_queue_full_is_429_and_shutdown_is_503(tiny_checkpoints):
  from fastapi.testclient import TestClient

  from mdlm_jax import checkpoints
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import create_app
  engine = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=1, max_prompt=64, max_new_tokens=48, block_size=8,
                  max_queue=0)
  app = create_app(engine, model_id="tiny")
  http = TestClient(app)
  body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
  r = http.post("/v1/chat/completions", json=body)
  assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
  app.state.server.shutting_down = True
  r = http.post("/v1/chat/completions", json=body)
  assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
  assert http.get("/health").status_code == 503


def test_cors_is_opt_in(tiny_checkpoints):
  from fastapi.testclient import TestClient

  from mdlm_jax import checkpoints
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import create_app
  engine = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=1, max_prompt=64, max_new_tokens=48,
                  block_size=8)
  preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization,content-type"}
  closed = TestClient(create_app(engine, model_id="tiny")).options("/v1/chat/completions", headers=preflight)
  assert "access-control-allow-origin" not in closed.headers
  app = TestClient(create_app(engine, model_id="tiny", cors_origins=["https://app.example"]))
  r = app.options("/v1/chat/completions", headers=preflight)
  assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
  assert "access-control-allow-origin" not in app.options(
      "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}).headers
  assert app.get("/v1/models", headers={"Origin": "https://app.example"}).headers[
      "access-control-allow-origin"] == "https://app.example"


def test_requests_ended_by_the_server_say_so(tiny_checkpoints):
  """A shutdown that cancels a request is an error, streamed or not, never
  finish_reason "stop" (the engine is never started: requests wait until cancelled)."""
  import json
  import threading

  from fastapi.testclient import TestClient

  from mdlm_jax import checkpoints
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import create_app
  engine = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=1, max_prompt=64, max_new_tokens=48,
                  block_size=8)
  http = TestClient(create_app(engine, model_id="tiny"))
  body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
  threading.Timer(1.0, engine.close, kwargs={"deadline_s": 0}).start()
  r = http.post("/v1/chat/completions", json=body)
  assert r.status_code == 503 and r.json()["error"]["code"] == "cancelled"
  engine = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=1, max_prompt=64, max_new_tokens=48,
                  block_size=8)
  http = TestClient(create_app(engine, model_id="tiny"))
  threading.Timer(1.0, engine.close, kwargs={"deadline_s": 0}).start()
  with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
  events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
  assert events[0]["choices"][0]["delta"]["role"] == "assistant"
  assert events[-1]["error"]["code"] == "cancelled"
  assert not any(c["finish_reason"] for e in events for c in e.get("choices", []))


def test_chat_renders_the_checkpoints_template(tiny_checkpoints, tmp_path):
  """A checkpoint with a chat template is prompted through it (its BOS and
  end-of-turn marker respected); one without keeps the plain labels."""
  from fastapi.testclient import TestClient

  from mdlm_jax import checkpoints
  from mdlm_jax.checkpoints import params_only
  from mdlm_jax.data import chat_template
  from mdlm_jax.engine.engine import Engine
  from mdlm_jax.server.app import create_app
  loaded = checkpoints.load(tiny_checkpoints["mdlm"])
  folder = params_only.save(str(tmp_path / "chat"), loaded.params, loaded.config, loaded.tokenizer, step=2,
                            chat_template=chat_template.CHATML)
  engine = Engine(checkpoints.load(folder), num_slots=1, max_prompt=128, max_new_tokens=16, block_size=8).start()
  try:
    http = TestClient(create_app(engine, model_id="tiny"))
    messages = [{"role": "system", "content": "Terse."}, {"role": "user", "content": "hi"}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 8})
    assert r.status_code == 200, r.text
    want = chat_template.render(chat_template.CHATML, messages, add_generation_prompt=True)
    assert r.json()["usage"]["prompt_tokens"] == 1 + len(loaded.tokenizer.encode(want))
    assert "<|im_end|>" not in r.json()["choices"][0]["message"]["content"]
    bad = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages[::-1], "max_tokens": 8})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
  finally:
    engine.close(deadline_s=0)


SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]},
                                                 "size": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}},
                "required": ["ok", "kind", "size"], "additionalProperties": False,
                "$defs": {"n": {"type": "integer", "enum": [1, 2, 3]}}}


def test_structured_outputs_parse_and_validate(client):
  """json_schema (greedy, sampled, streamed), json_object and vLLM's guided_*
  fields through the official client: jsonschema and re are the referees."""
  import json
  import re

  import jsonschema
  # A random model spends its tokens on whitespace wherever the layout allows
  # some: held to none (the schema's own x-guidance), its keys are forced and it finishes.
  compact = {**SMALL_SCHEMA, "x-guidance": {"whitespace_pattern": ""}}
  fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": compact, "strict": True}}
  for kw in (dict(), dict(temperature=1.0, seed=3, n=2)):
    r = _chat(client, response_format=fmt, max_tokens=48, **kw)
    for c in r.choices:
      assert c.finish_reason == "stop", c
      jsonschema.validate(json.loads(c.message.content), SMALL_SCHEMA)
  stream = _chat(client, response_format=fmt, max_tokens=48, temperature=1.0, seed=5, stream=True)
  chunks = list(stream)
  text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
  assert chunks[-1].choices[0].finish_reason == "stop"
  jsonschema.validate(json.loads(text), SMALL_SCHEMA)
  r = _chat(client, response_format={"type": "json_object"}, max_tokens=48, temperature=1.0, seed=1)
  if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict)
  else:  # a random model may write a long object: cut, but on the way to one
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
  r = _chat(client, max_tokens=16, extra_body={"guided_regex": "(yes|no)-[0-9]{2}"})
  assert re.fullmatch("(yes|no)-[0-9]{2}", r.choices[0].message.content)
  r = _chat(client, max_tokens=16, temperature=1.0, extra_body={"guided_choice": ["red", "green", "blue"]})
  assert r.choices[0].message.content in ("red", "green", "blue")
  r = _chat(client, max_tokens=16, extra_body={"guided_grammar": 'root ::= "x" op [0-9]\nop ::= "+" | "-"'})
  assert re.fullmatch(r"x[+-][0-9]", r.choices[0].message.content)
  c = client.completions.create(model="tiny", prompt="config = ", max_tokens=48, extra_body={"guided_json": compact})
  assert c.choices[0].finish_reason == "stop"
  jsonschema.validate(json.loads(c.choices[0].text), SMALL_SCHEMA)


def test_bad_constraints_are_400s_naming_the_field(server):
  base = server[1]
  ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
  schema = lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}  # noqa: E731
  cases = [
      ({"guided_regex": "[a-"}, "guided_regex"),
      ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
      ({"guided_choice": []}, "guided_choice"),
      ({"guided_json": "{not json"}, "guided_json"),
      ({"response_format": schema({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
      ({"response_format": schema([1])}, "response_format.json_schema.schema"),
      ({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces"}}},
       "response_format.json_schema.name"),
      ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
      ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
      ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
  ]
  for extra, param in cases:
    err = _error(base, "POST", "/v1/chat/completions", 400, json={**ok, **extra})
    assert err["param"] == param, (extra, err)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "celsius": {"type": "boolean"}},
                   "required": ["city", "celsius"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]


@pytest.fixture(scope="module")
def tool_server(tiny_checkpoints):
  """A server whose prompts fit a tools preamble (the tiny tokenizer spends
  some 600 tokens on two tool signatures), without warmup: (base URL, its
  /metrics when it came up)."""
  proc, base = start_server(tiny_checkpoints["mdlm"], "--slots=4", "--model-id=tiny", "--max-prompt-tokens=1024",
                            "--admit-batch=1", "--max-tokens=128", "--no-warmup")
  yield base, httpx.get(base + "/metrics").text
  proc.kill()


@pytest.fixture(scope="module")
def tool_client(tool_server):
  return openai.OpenAI(base_url=tool_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _compiled(metrics: str) -> dict[str, int]:
  return {kind: int(n) for kind, n in re.findall(r'mdlm_compiled_programs\{kind="(\w+)"\} (\d+)', metrics)}


def test_without_warmup_programs_compile_on_first_use(tool_server, tool_client):
  base, at_start = tool_server
  assert _compiled(at_start) == {"pass": 0, "prefill": 0}
  _chat(tool_client, max_tokens=8)
  # One short request: its prompt's prefill, and passes over one slot (with
  # and without a finished block at most), of the 2 x 4 pass sizes and the
  # prefill buckets a warmup would compile.
  used = _compiled(httpx.get(base + "/metrics").text)
  assert used["prefill"] == 1 and 1 <= used["pass"] <= 2


def _check_calls(calls, names=("get_weather", "get_time")):
  """Every call names a tool and its arguments validate against that tool's parameters."""
  import json

  import jsonschema
  specs = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  assert calls
  for c in calls:
    assert c.id.startswith("call_") and c.type == "function" and c.function.name in names
    jsonschema.validate(json.loads(c.function.arguments), specs[c.function.name])


def test_tool_calls_validate_streamed_or_not(tool_client):
  """tool_choice required and named, parallel or not, greedy and sampled,
  through the official client; a streamed call assembles into the same shape."""
  r = _chat(tool_client, tools=TOOLS, tool_choice="required", max_tokens=128)
  c = r.choices[0]
  # Parallel calls: a random model may go on calling until max_tokens; every
  # complete call is returned and validates either way.
  assert c.finish_reason in ("tool_calls", "length") and not c.message.content
  _check_calls(c.message.tool_calls)
  r = _chat(tool_client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=96,
            temperature=1.0, seed=4)
  assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
  _check_calls(r.choices[0].message.tool_calls, names=("get_time",))
  r = _chat(tool_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=1.0,
            seed=2, n=2)
  for c in r.choices:
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    _check_calls(c.message.tool_calls)
  calls, finish = {}, None
  for chunk in _chat(tool_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                     temperature=1.0, seed=7, stream=True):
    for d in chunk.choices[0].delta.tool_calls or []:  # as agent frameworks assemble them
      slot = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
      slot["arguments"] += d.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
  assert finish == "tool_calls"
  from openai.types.chat import ChatCompletionMessageToolCall
  _check_calls([ChatCompletionMessageToolCall(id=v["id"], type="function",
                                              function={"name": v["name"], "arguments": v["arguments"]})
                for _, v in sorted(calls.items())])


@pytest.mark.slow  # CI: the tool-call round trips above, streamed and not
def test_an_agent_loop_runs_unchanged(tool_client):
  """The loop agent frameworks run: ask with tools (auto), execute the calls,
  append the assistant message object and the tool results, ask again."""
  messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
  first = _chat(tool_client, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=96)
  message = first.choices[0].message
  messages.append(message)  # the client's own message object goes back as is
  for call in message.tool_calls:
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'})
  second = _chat(tool_client, messages=messages, tools=TOOLS, max_tokens=64)
  c = second.choices[0]
  assert c.finish_reason in ("stop", "length", "tool_calls")
  if c.message.tool_calls:  # auto: a call, if the model makes one, validates too
    _check_calls(c.message.tool_calls)
  none = _chat(tool_client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=64)
  assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
  assert "<tool_call>" not in none.choices[0].message.content


def test_bad_tool_requests_are_400s_naming_the_field(server):
  base = server[1]
  ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
  call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
  history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
  cases = [
      ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
      ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
      ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
      ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
      ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
      ({"tool_choice": "required"}, "tool_choice"),
      ({"messages": history + [{"role": "tool", "content": "3"}]}, "messages[2].tool_call_id"),
      ({"messages": history + [{"role": "tool", "tool_call_id": "call_9", "content": "3"}]},
       "messages[2].tool_call_id"),
      ({"messages": [{"role": "user", "content": "hi", "tool_calls": [call]}]}, "messages[0].tool_calls"),
      ({"messages": [history[0], {"role": "assistant", "tool_calls": [{**call, "function": {
          "name": "get_time", "arguments": "{oops"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
      ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
  ]
  for extra, param in cases:
    err = _error(base, "POST", "/v1/chat/completions", 400, json={**ok, **extra})
    assert err["param"] == param, (extra, err)


def test_logprobs_on_chat_and_completions(client):
  """Each returned token comes with its log-probability and the top
  alternatives of the pass that committed it: greedy tokens are the top
  alternative, the tokens spell the text, streamed or not."""
  import math
  r = _chat(client, logprobs=True, top_logprobs=3, max_tokens=24, seed=1)
  c = r.choices[0]
  content = c.logprobs.content
  assert b"".join(bytes(t.bytes) for t in content).decode() == c.message.content
  assert len(content) == r.usage.completion_tokens
  for t in content:
    assert t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 3
    assert t.top_logprobs[0].token == t.token and math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-5)
    assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
  streamed = [t for ch in _chat(client, logprobs=True, top_logprobs=3, max_tokens=24, seed=1, stream=True)
              if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
  assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]
  sampled = _chat(client, logprobs=True, max_tokens=24, temperature=1.0, seed=3).choices[0].logprobs.content
  assert all(t.logprob <= 0 and t.top_logprobs == [] for t in sampled)
  comp = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=16, logprobs=2, seed=0)
  lp = comp.choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == comp.usage.completion_tokens
  assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
  assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_logprobs_requests_it_cannot_serve_are_refused(server):
  base = server[1]
  chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
  done = {"model": "tiny", "prompt": "x", "max_tokens": 4}
  for path, body, param in [
      ("/v1/chat/completions", {**chat, "top_logprobs": 3}, "top_logprobs"),
      ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
      ("/v1/chat/completions", {**chat, "logprobs": True, "stream": True, "diffusing": True}, "logprobs"),
      ("/v1/completions", {**done, "logprobs": 6}, "logprobs"),
      ("/v1/completions", {**done, "logprobs": 1, "echo": True}, "logprobs"),
  ]:
    assert _error(base, "POST", path, 400, json=body)["param"] == param


# Last: it stops the module's server.
def test_sigterm_drains_and_exits_zero(server):
  """Runs last in this module: it stops the shared server."""
  proc, base = server
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=60) == 0


def test_agreement_reaches_the_requests_sampler():
  """The field, parsed once, is the sampler's setting (and a turn carries every sampler field:
  tests/engine/test_turns.py; the slots decode it as one-shot: tests/engine/test_revise.py)."""
  from mdlm_jax.sampling.presets import for_model
  from mdlm_jax.server.protocol import Limits, parse_sampling
  agreement = float(np.random.default_rng().uniform(0.01, 0.99))
  s = parse_sampling({"prompt": "x", "revise": True, "agreement": agreement}, Limits(), default_max_tokens=8)
  assert s.agreement == agreement
  sampler = for_model("medium", 4, in_order=True, **s.rule())
  assert sampler.revise and sampler.agreement == agreement
