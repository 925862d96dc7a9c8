"""The OpenAI-compatible HTTP layer: routes, auth, limits, errors, streaming.

No model logic lives here: every generation, fill-in-the-middle included,
is an engine request sharing the engine's slots and passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mdlm_jax.engine.engine import ContextLengthExceeded, Engine, EngineClosed, QueueFull
from mdlm_jax.engine.engine import Request as EngineRequest
from mdlm_jax.server import chat_template
from mdlm_jax.server.prometheus import Metrics
from mdlm_jax.server.protocol import (APIError, Limits, Sampling, parse_messages, parse_model, parse_prompt,
                                      parse_sampling, parse_suffix, require_object)


class ServerState:
  def __init__(self, engine: Engine, model_id: str, api_key: str | None, limits: Limits):
    self.engine, self.model_id, self.api_key, self.limits = engine, model_id, api_key, limits
    self.tok = engine.tok
    self.metrics = Metrics()
    self.created = int(time.time())
    self.shutting_down = False


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None, limits: Limits = Limits()) -> FastAPI:
  # The engine's shapes bound what a request may ask for.
  limits = dataclasses.replace(limits, max_tokens=min(limits.max_tokens, engine.sc.max_new_tokens),
                               max_prompt_tokens=min(limits.max_prompt_tokens, engine.sc.max_prompt))
  state = ServerState(engine, model_id, api_key, limits)
  app = FastAPI(title="mdlm_jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.server = state

  @app.exception_handler(APIError)
  async def api_error(request: Request, e: APIError):
    state.metrics.request(_endpoint(request), e.status)
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(request: Request, e: StarletteHTTPException):
    message = "unknown route" if e.status_code == 404 else str(e.detail)
    err = APIError(e.status_code, f"{message}: {request.method} {request.url.path}", code="not_found"
                   if e.status_code == 404 else None)
    return await api_error(request, err)

  @app.exception_handler(Exception)
  async def internal_error(request: Request, e: Exception):
    return await api_error(request, APIError(500, f"internal error: {type(e).__name__}: {e}"))

  @app.get("/health")
  async def health():
    if state.shutting_down:
      raise APIError(503, "the server is shutting down", code="shutting_down")
    if engine.error is not None:
      raise APIError(503, f"the engine stopped: {engine.error!r}", code="engine_error")
    return {"status": "ok", "slots": engine.num_slots, "active": engine.active_requests(),
            "queue_depth": engine.queue_depth()}

  @app.get("/metrics")
  async def metrics():
    return PlainTextResponse(state.metrics.render(engine.queue_depth(), engine.active_requests(), engine.num_slots),
                             media_type="text/plain; version=0.0.4")

  @app.get("/v1/models")
  async def list_models(request: Request):
    _auth(state, request)
    state.metrics.request("models", 200)
    return {"object": "list", "data": [_model_card(state)]}

  @app.get("/v1/models/{model:path}")
  async def get_model(model: str, request: Request):
    _auth(state, request)
    if model != state.model_id:
      raise APIError(404, f"The model {model!r} does not exist", param="model", code="model_not_found")
    state.metrics.request("models", 200)
    return _model_card(state)

  @app.post("/v1/chat/completions")
  async def chat(request: Request):
    body = await _read_body(state, request)
    parse_model(body, state.model_id)
    messages = parse_messages(body)
    s = parse_sampling(body, state.limits, default_max_tokens=state.limits.max_tokens)
    prompt = chat_template.render(messages)
    s.stop = tuple(dict.fromkeys(s.stop + (chat_template.TURN_STOP,)))
    return await _generate(state, request, "chat", prompt, s)

  async def prompt_request(request: Request):
    body = await _read_body(state, request)
    parse_model(body, state.model_id)
    return body, parse_prompt(body), parse_suffix(body)

  @app.post("/v1/completions")
  async def completions(request: Request):
    body, prompt, suffix = await prompt_request(request)
    s = parse_sampling(body, state.limits, default_max_tokens=16)
    return await _generate(state, request, "completions", prompt, s, suffix=suffix or "")

  @app.post("/v1/fim/completions")
  async def fim(request: Request):
    body, prompt, suffix = await prompt_request(request)
    s = parse_sampling(body, state.limits, default_max_tokens=64)
    return await _generate(state, request, "fim", prompt, s, suffix=suffix or "")

  return app


# -- helpers ----------------------------------------------------------------------


def _endpoint(request: Request) -> str:
  path = request.url.path
  for name, prefix in (("chat", "/v1/chat/completions"), ("fim", "/v1/fim/completions"),
                       ("completions", "/v1/completions"), ("models", "/v1/models")):
    if path.startswith(prefix):
      return name
  return "other"


def _model_card(state: ServerState) -> dict:
  return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mdlm_jax"}


def _auth(state: ServerState, request: Request) -> None:
  if state.shutting_down:
    raise APIError(503, "the server is shutting down", code="shutting_down")
  if state.api_key is None:
    return
  header = request.headers.get("authorization", "")
  scheme, _, token = header.partition(" ")
  if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
    raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")


async def _read_body(state: ServerState, request: Request) -> dict:
  _auth(state, request)
  limit = state.limits.max_body_bytes
  declared = request.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > limit:
    raise APIError(413, f"the request body is {declared} bytes; the limit is {limit}", code="body_too_large")
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limit:
      raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
    chunks.append(chunk)
  try:
    body = json.loads(b"".join(chunks) or b"null")
  except (ValueError, UnicodeDecodeError) as e:
    raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from e
  return require_object(body)


def _engine_requests(state: ServerState, prompt: str, s: Sampling, suffix: str = "") -> list[EngineRequest]:
  """One engine request per choice (seeds base, base + 1, ...), as one effort decodes everywhere."""
  sampler = state.engine.sampler_for(s.effort, temperature=s.temperature, top_p=s.top_p)
  ids = state.engine.encode(prompt)
  suffix_ids = state.engine.encode(suffix, add_bos=False) if suffix else []
  base_seed = s.seed if s.seed is not None else secrets.randbits(31)
  return [EngineRequest(ids, s.max_tokens, sampler, seed=base_seed + i, stop=s.stop, suffix_ids=suffix_ids)
          for i in range(s.n)]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def _submit_all(state: ServerState, reqs: list[EngineRequest], want_drafts: bool):
  handles = []
  try:
    for r in reqs:
      handles.append(state.engine.submit(r, want_drafts=want_drafts))
  except QueueFull as e:
    for h in handles:
      h.cancel()
    raise APIError(429, f"the server is busy: {e}; retry later", code="queue_full") from e
  except EngineClosed as e:
    for h in handles:
      h.cancel()
    raise APIError(503, "the server is shutting down", code="shutting_down") from e
  except ContextLengthExceeded as e:
    raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from e
  except ValueError as e:
    raise APIError(400, str(e), code="invalid_value") from e
  return handles


async def _events(handles, request: Request):
  """Yields (choice index, event) from several handles as events arrive; a
  client that disconnects cancels its requests (their slots free at once)."""
  loop = asyncio.get_running_loop()
  wake = asyncio.Event()
  for h in handles:
    h.add_listener(lambda: loop.call_soon_threadsafe(wake.set))
  open_ = set(range(len(handles)))
  while open_:
    try:
      await asyncio.wait_for(wake.wait(), timeout=0.5)
    except asyncio.TimeoutError:
      if await request.is_disconnected():
        for h in handles:
          h.cancel()
      continue
    wake.clear()
    for i in sorted(open_):
      for ev in handles[i].poll():
        yield i, ev
        if ev.kind == "done":
          open_.discard(i)


def _chunk(kind: str, rid: str, state: ServerState, created: int, index: int, text: str | None,
           finish: str | None, role: bool = False) -> dict:
  if kind == "chat":
    delta: dict[str, Any] = {}
    if role:
      delta["role"] = "assistant"
    if text is not None:
      delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
            "choices": [choice]}
  return {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
          "choices": [{"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}]}


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _finish_reason(ev) -> str:
  return "length" if ev.finish_reason == "length" else "stop"


async def _generate(state: ServerState, request: Request, kind: str, prompt: str, s: Sampling, suffix: str = ""):
  reqs = _engine_requests(state, prompt, s, suffix)
  ids = list(reqs[0].prompt_ids) + list(reqs[0].suffix_ids)  # what the model reads: usage's prompt tokens
  t0 = time.perf_counter()
  handles = _submit_all(state, reqs, want_drafts=s.diffusing)
  rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
  created = int(time.time())
  if not s.stream:
    try:
      finals = {}
      async for i, ev in _events(handles, request):
        if ev.kind == "done":
          finals[i] = ev
    finally:
      for h in handles:
        h.cancel()  # a client that went away frees its slots; finished ones ignore this
    if any(ev.finish_reason == "error" for ev in finals.values()):
      raise APIError(500, "the engine failed while generating", code="engine_error")
    completion = sum(ev.completion_tokens for ev in finals.values())
    state.metrics.tokens(len(ids) * s.n, completion)
    state.metrics.latency(time.perf_counter() - t0)
    state.metrics.request(kind, 200)
    choices = []
    for i in range(s.n):
      ev = finals[i]
      if kind == "chat":
        choices.append({"index": i, "message": {"role": "assistant", "content": ev.text}, "logprobs": None,
                        "finish_reason": _finish_reason(ev)})
      else:
        choices.append({"index": i, "text": ev.text, "logprobs": None, "finish_reason": _finish_reason(ev)})
    return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                         "created": created, "model": state.model_id, "choices": choices,
                         "usage": _usage(len(ids) * s.n, completion)})

  async def stream():
    completion = 0
    try:
      if kind == "chat":
        for i in range(s.n):
          yield _sse(_chunk(kind, rid, state, created, i, "", None, role=True))
      async for i, ev in _events(handles, request):
        if ev.kind == "draft" and s.diffusing:
          yield _sse(_chunk(kind, rid, state, created, i, ev.text, None))
        elif ev.kind == "delta" and not s.diffusing:
          yield _sse(_chunk(kind, rid, state, created, i, ev.text, None))
        elif ev.kind == "done":
          completion += ev.completion_tokens
          if s.diffusing:  # the last draft is the answer itself
            yield _sse(_chunk(kind, rid, state, created, i, ev.text, None))
          yield _sse(_chunk(kind, rid, state, created, i, None if kind == "chat" else "", _finish_reason(ev)))
      if s.include_usage:
        yield _sse({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": created, "model": state.model_id, "choices": [],
                    "usage": _usage(len(ids) * s.n, completion)})
      yield "data: [DONE]\n\n"
      state.metrics.tokens(len(ids) * s.n, completion)
      state.metrics.latency(time.perf_counter() - t0)
      state.metrics.request(kind, 200)
    finally:
      for h in handles:
        h.cancel()  # the client went away (or we are done): free the slots

  return StreamingResponse(stream(), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def api_key_from_env(flag: str | None) -> str | None:
  return flag or os.environ.get("MDLM_API_KEY") or None
