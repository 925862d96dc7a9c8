"""The OpenAI-compatible HTTP layer: routes, auth, limits, errors, streaming.

No model logic lives here: every generation, fill-in-the-middle included,
is an engine request sharing the engine's slots and passes.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
import logging
import os
import secrets
import time
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mdlm_jax.engine.engine import ContextLengthExceeded, Engine, EngineClosed, QueueFull
from mdlm_jax.engine.engine import Request as EngineRequest
from mdlm_jax.server import chat_template
from mdlm_jax.server import apply_edit
from mdlm_jax.server import lazy_calls
from mdlm_jax.server import tools as tools_lib
from mdlm_jax.server.prometheus import Metrics
from mdlm_jax.sampling.grammar import Grammar, GrammarError
from mdlm_jax.server.protocol import (APIError, Limits, Sampling, check_fields, check_logit_bias_ids, guidance_given,
                                      parse_echo, parse_guidance, parse_logprobs, parse_messages, parse_model,
                                      parse_output_cap, parse_prompt, parse_prompts, parse_sampling, parse_suffix,
                                      require_object)

log = logging.getLogger("mdlm_jax.server")


class ServerState:
  @functools.cached_property
  def token_bytes(self) -> list[bytes | None]:
    """Each token's bytes, for logprobs (a Hugging Face tokenizer: its decoded
    text), built by the first request that asks."""
    tok = self.tok
    return tok.token_bytes() if hasattr(tok, "token_bytes") else [tok.decode([i]).encode()
                                                                  for i in range(tok.vocab_size)]

  def __init__(self, engine: Engine, model_id: str, api_key: str | None, limits: Limits):
    self.engine, self.model_id, self.api_key, self.limits = engine, model_id, api_key, limits
    self.tok = engine.tok
    self.metrics = Metrics()
    self.created = int(time.time())
    self.shutting_down = False


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None, limits: Limits = Limits(),
               cors_origins: Sequence[str] = ()) -> FastAPI:
  """`cors_origins`: browser origins allowed to call the API ("*" for any);
  none by default, so only same-origin pages and non-browser clients can."""
  # The engine's shapes bound what a request may ask for.
  limits = dataclasses.replace(limits, max_tokens=min(limits.max_tokens, engine.sc.max_new_tokens),
                               max_prompt_tokens=min(limits.max_prompt_tokens, engine.sc.max_prompt))
  state = ServerState(engine, model_id, api_key, limits)
  app = FastAPI(title="mdlm_jax", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.server = state
  if cors_origins:
    from fastapi.middleware.cors import CORSMiddleware
    app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])

  app.add_middleware(_AnnounceArrivals, engine=engine)

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

  @app.get("/")
  async def playground():
    """The playground page (static, no build step, nothing from a CDN); it
    calls the API below with the key its user enters."""
    return HTMLResponse(_static("playground.html"))

  @app.get("/playground.js")
  async def playground_script():
    return Response(_static("playground.js"), media_type="text/javascript")

  @app.get("/health")
  async def health():
    if state.shutting_down:
      raise APIError(503, "the server is shutting down", code="shutting_down")
    if engine.error is not None:
      raise APIError(503, f"the engine stopped: {engine.error!r}", code="engine_error")
    return {"status": "ok", "slots": engine.num_slots, "active": engine.active_requests(),
            "queue_depth": engine.queue_depth(), "context": engine.sc.context,
            "kv_cache_bytes": engine.kv_cache_bytes, "kv_cache_tokens_in_use": engine.kv_tokens_in_use(),
            "kv_cache_tokens": engine.num_slots * engine.sc.context}

  @app.get("/metrics")
  async def metrics():
    compiled = engine.compiled()
    return PlainTextResponse(state.metrics.render(engine.queue_depth(), engine.active_requests(), engine.num_slots,
                                                  engine.finish_reasons(),
                                                  (engine.kv_cache_bytes, engine.kv_tokens_in_use(),
                                                   engine.num_slots * engine.sc.context),
                                                  {"pass": compiled["passes"], "prefill": compiled["prefills"]}),
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
    return await _chat(state, request)

  @app.post("/v1/completions")
  async def completions(request: Request):
    return await _completions(state, request)

  @app.post("/v1/fim/completions")
  async def fim(request: Request):
    return await _fim(state, request)

  @app.post("/v1/apply/completions")
  async def apply(request: Request):
    return await _apply(state, request)

  return app


# -- the generation endpoints ------------------------------------------------------


async def _chat(state: ServerState, request: Request):
  """OpenAI's chat completions: the conversation through the chat template, tools and structured outputs."""
  body = await _endpoint_body(state, request, "chat")
  messages = parse_messages(body)
  s = parse_sampling(body, state.limits, default_max_tokens=state.limits.max_tokens)
  guide = parse_guidance(body)
  try:
    tools = tools_lib.parse(body)
    tools_lib.check_history(messages)
  except tools_lib.ToolError as e:
    raise APIError(400, str(e), param=e.param, code="invalid_value") from e
  calling = tools is not None and tools.choice != "none"
  s.logprobs = _logprobs_for(body, "chat", s, calls=calling)
  if calling and guide is not None:
    field = guidance_given(body)[0]
    raise APIError(400, f"{field}: cannot be combined with tool calls (tool_choice {tools.choice!r})",
                   param=field, code="invalid_value")
  try:
    prompt, stops, add_bos = chat_template.render(messages, state.engine.loaded.chat_template, state.tok,
                                                  tools=list(tools.specs) if tools else None)
  except ValueError as e:  # the template refused the conversation (raise_exception)
    raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
  if tools is not None and not calling:
    stops += (tools_lib.OPEN,)  # tool_choice none: the answer ends before any call
  s.stop = tuple(dict.fromkeys(s.stop + stops))
  ids = state.engine.encode(prompt, add_bos=add_bos)
  # Each call under the grammar of one call, and after each a free probe says whether another opens
  # (`lazy_calls`); where the answer so far no longer fits a prompt, it ends at its last call. auto:
  # the text first as a free request where every continuation of it fits a prompt, else the text and
  # the first call as one request under the lazy grammar of one call; required: the calls alone.
  lazy = calling and not s.revise and tools.choice in ("auto", "required")
  if lazy:
    free_text = tools.choice == "auto" and len(ids) + s.max_tokens <= state.engine.sc.max_prompt
    grammar = None if free_text else tools_lib.grammar(tools_lib.one_call(tools))
  else:
    grammar = tools_lib.grammar(tools) if calling else guide
  return await _generate(state, request, "chat", [Prompt(ids)], s, grammar=grammar,
                         end_ids=_single_tokens(state, stops), calls=calling, lazy_tools=tools if lazy else None)


async def _completions(state: ServerState, request: Request):
  """OpenAI's completions: lists of prompts, token-id prompts, echo, and a suffix to infill against."""
  body = await _endpoint_body(state, request, "completions")
  s = parse_sampling(body, state.limits, default_max_tokens=16)
  guide = parse_guidance(body)
  suffix = parse_suffix(body) or ""
  echo = parse_echo(body)
  if echo and suffix:
    raise APIError(400, "echo: cannot be combined with suffix", param="echo", code="invalid_value")
  s.logprobs = _logprobs_for(body, "completions", s, echo=echo)
  prompts = []
  for i, p in enumerate(parse_prompts(body, state.tok.vocab_size, state.limits, s.n)):
    ids = state.engine.encode(p) if isinstance(p, str) else list(p)
    if state.tok.mask_id in ids and not isinstance(p, str):
      raise APIError(400, f"prompt[{i}]: token id {state.tok.mask_id} is the mask token, which only the decoder"
                     " writes", param=f"prompt[{i}]", code="invalid_value")
    prompts.append(Prompt(ids, (p if isinstance(p, str) else state.tok.decode(ids)) if echo else ""))
  return await _generate(state, request, "completions", prompts, s, suffix=suffix, grammar=guide)


async def _fim(state: ServerState, request: Request):
  """Fill-in-the-middle: the prompt before and the suffix after the middle."""
  body = await _endpoint_body(state, request, "fim")
  s = parse_sampling(body, state.limits, default_max_tokens=64)
  prompt, suffix = parse_prompt(body), parse_suffix(body) or ""
  return await _generate(state, request, "fim", [Prompt(state.engine.encode(prompt))], s, suffix=suffix)


async def _apply(state: ServerState, request: Request):
  """Mercury Edit's apply endpoint: the merged file as the answer."""
  body = await _endpoint_body(state, request, "apply")
  messages = parse_messages(body)
  if len(messages) != 1 or messages[0]["role"] != "user":
    raise APIError(400, "messages: one user message holding the original code and the update snippet",
                   param="messages", code="invalid_value")
  cap, _ = parse_output_cap(body)
  # The file is merged, not decoded: the sampling fields steer the placements the model decides.
  s = parse_sampling({k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")},
                     state.limits, default_max_tokens=1)
  try:
    original, snippet = apply_edit.parse(messages[0]["content"])
  except apply_edit.EditError as e:
    raise APIError(400, f"messages[0].content: {e}", param="messages[0].content", code="invalid_value") from e
  t0 = time.perf_counter()
  decided = []

  def decide(before: str, candidates: list[str], after: str) -> int:
    decided.append(_place(state, s, before, candidates, after))
    return decided[-1]

  merged = await asyncio.to_thread(apply_edit.merge, original, snippet, decide)
  answer, finish = _cut_answer(state, merged, s.stop, cap)
  prompt_tokens, completion = len(state.tok.encode(messages[0]["content"])), len(state.tok.encode(answer))
  state.metrics.tokens(prompt_tokens, completion)
  state.metrics.latency(time.perf_counter() - t0)
  state.metrics.request("apply", 200)
  rid, created, usage = "chatcmpl-" + secrets.token_hex(12), int(time.time()), _usage(prompt_tokens, completion)
  if s.stream:
    return StreamingResponse(_apply_stream(state, rid, created, answer, finish, usage if s.include_usage else None,
                                           len(decided)),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
  return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": state.model_id,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                    "logprobs": None, "finish_reason": finish}],
                       "usage": usage, "model_decisions": len(decided)})


# -- helpers ----------------------------------------------------------------------


def _cut_answer(state: ServerState, text: str, stop: Sequence[str], cap: int | None) -> tuple[str, str]:
  """(answer, finish_reason) of a whole answer: cut before its first stop
  string ("stop"), then to `cap` tokens ("length")."""
  cuts = [i for i in (text.find(t) for t in stop) if i >= 0]
  if cuts:
    return text[:min(cuts)], "stop"
  if cap is not None:
    ids = state.tok.encode(text)
    if len(ids) > cap:
      return state.tok.decode(ids[:cap]), "length"
  return text, "stop"


def _apply_stream(state: ServerState, rid: str, created: int, answer: str, finish: str, usage: dict | None,
                  decisions: int):
  """A merged file as chat chunks: the role, then the file line by line, then
  the finish reason (and the usage when asked), as OpenAI's clients read them."""
  def chunk(delta: dict, reason: str | None, **extra) -> str:
    return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}], **extra})
  yield chunk({"role": "assistant", "content": ""}, None)
  for line in answer.splitlines(keepends=True):
    yield chunk({"content": line}, None)
  yield chunk({}, finish, model_decisions=decisions)
  if usage is not None:
    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
                "choices": [], "usage": usage})
  yield "data: [DONE]\n\n"


def _place(state: ServerState, s: Sampling, before: str, candidates: list[str], after: str) -> int:
  """Which placement of an edit the model writes between `before` and
  `after`: one engine request, infilling under a grammar whose alternatives
  are exactly the candidates (the context cut to what the engine takes)."""
  engine = state.engine
  need = max(len(state.tok.encode(c)) for c in candidates) + 2
  if need > engine.sc.max_new_tokens:
    raise APIError(400, f"messages[0].content: placing an edit among {len(candidates) - 1} lines needs {need} tokens;"
                   f" this server decodes at most {engine.sc.max_new_tokens}", param="messages[0].content",
                   code="context_length_exceeded")
  bs = engine.sc.block_size
  room = min(engine.sc.max_prompt, engine.sc.context - -(-need // bs) * bs) - 8
  suffix = engine.encode(after, add_bos=False)[:room // 4]
  prefix = engine.encode(before, add_bos=False)[-(room - len(suffix)):]
  sampler = engine.sampler_for(s.effort, temperature=s.temperature, top_p=s.top_p, revisable=False)
  seed = s.seed if s.seed is not None else secrets.randbits(31)
  req = engine.prepare(EngineRequest([engine.tok.bos_id] + prefix, need, sampler, seed=seed, suffix_ids=suffix,
                                     grammar=Grammar.choice(candidates, "messages[0].content")))
  done = _submit_all(state, [req], want_drafts=False)[0].result(timeout=600)
  if (err := _engine_failure(done)) is not None:
    raise err
  if done.text not in candidates:
    raise APIError(500, f"the model's placement {done.text!r} is none of the candidates", code="engine_error")
  return candidates.index(done.text)


def _static(name: str) -> str:
  import importlib.resources
  return (importlib.resources.files("mdlm_jax.server") / "static" / name).read_text(encoding="utf-8")


def _endpoint(request: Request) -> str:
  path = request.url.path
  for name, prefix in (("chat", "/v1/chat/completions"), ("fim", "/v1/fim/completions"), ("apply", "/v1/apply"),
                       ("completions", "/v1/completions"), ("models", "/v1/models")):
    if path.startswith(prefix):
      return name
  return "other"


def _model_card(state: ServerState) -> dict:
  """OpenAI's card, with the context this server gives the model (vLLM and
  OpenRouter names): prompt plus completion, and each bound on its own."""
  context = min(state.limits.max_prompt_tokens + state.limits.max_tokens, state.engine.sc.context)
  return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "mdlm_jax",
          "context_length": context, "max_model_len": context, "max_prompt_tokens": state.limits.max_prompt_tokens,
          "max_completion_tokens": state.limits.max_tokens}


@dataclasses.dataclass
class Prompt:
  """One prompt of a request: its ids, and the text `echo` puts before each completion."""
  ids: list[int]
  echo: str = ""


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


def _engine_requests(state: ServerState, prompts: list[Prompt], s: Sampling, suffix: str = "",
                     grammar: Grammar | None = None, end_ids: tuple[int, ...] = ()) -> list[EngineRequest]:
  """One engine request per choice, prompt by prompt and n for each (seeds
  base, base + 1, ...), decoded as the effort means everywhere."""
  check_logit_bias_ids(s.logit_bias, state.engine.sc.vocab_size)
  if s.revise:
    if not state.engine.loaded.spec.cfg.clean_causal:
      raise APIError(400, "revise: this model has no base to check drafts against (it is not an AR model adapted"
                     " to diffusion)", param="revise", code="invalid_value")
    if suffix:
      raise APIError(400, "revise: a revising request writes left to right and cannot infill against a suffix",
                     param="revise", code="invalid_value")
    if grammar is not None:
      raise APIError(400, "revise: a revising request does not run under a grammar (structured outputs, tools)",
                     param="revise", code="invalid_value")
  sampler = state.engine.sampler_for(s.effort, revisable=not suffix and grammar is None, **s.rule())
  suffix_ids = state.engine.encode(suffix, add_bos=False) if suffix else []
  base_seed = s.seed if s.seed is not None else secrets.randbits(31)
  return [state.engine.prepare(EngineRequest(p.ids, s.max_tokens, sampler, seed=base_seed + i, stop=s.stop,
                                            suffix_ids=suffix_ids, grammar=grammar, end_ids=end_ids,
                                            logprobs=s.logprobs))
          for p in prompts for i in range(s.n)]


def _logprobs_for(body: dict, endpoint: str, s: Sampling, *, calls: bool = False, echo: bool = False) -> int | None:
  """The request's logprobs setting, refused where this server cannot give
  them: for the prompt (echo), for tool calls, or for whole drafts."""
  k = parse_logprobs(body, endpoint)
  if k is None:
    return None
  why = ("the prompt's are not computed (echo)" if echo else "tool calls do not report them" if calls else
         "a diffusing stream sends whole drafts, not tokens" if s.diffusing else None)
  if why:
    raise APIError(400, f"logprobs: not available here: {why}", param="logprobs", code="unsupported_parameter")
  return k


def _logprobs_body(state: ServerState, kind: str, entries, offset: int = 0) -> dict | None:
  """OpenAI's logprobs object for these engine entries (chat: `content`;
  completions: the legacy token lists, `offset` the text before them)."""
  if entries is None:
    return None

  def text(i):
    return state.token_bytes[i].decode("utf-8", "replace") if state.token_bytes[i] is not None else ""

  if kind == "chat":
    def one(i, lp):
      return {"token": text(i), "logprob": lp, "bytes": list(state.token_bytes[i] or b"")}
    return {"content": [{**one(i, lp), "top_logprobs": [one(a, v) for a, v in alts]} for i, lp, alts in entries],
            "refusal": None}
  offsets, at = [], offset
  for i, _, _ in entries:
    offsets.append(at)
    at += len(text(i))
  return {"tokens": [text(i) for i, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
          "top_logprobs": [{text(a): v for a, v in alts} for _, _, alts in entries], "text_offset": offsets}


async def _endpoint_body(state: ServerState, request: Request, endpoint: str) -> dict:
  """The request's JSON body, for this server's model, every field one the endpoint takes."""
  body = await _read_body(state, request)
  parse_model(body, state.model_id)
  check_fields(body, endpoint)
  return body


def _single_tokens(state: ServerState, texts) -> tuple[int, ...]:
  """The ids of those `texts` that are one token each (a template's end of
  turn): where a constrained answer may end besides EOS."""
  ids = [state.tok.encode(t) for t in texts]
  return tuple(i[0] for i in ids if len(i) == 1)


def _usage(prompt_tokens: int, completion_tokens: int, passes: int | None = None) -> dict:
  """OpenAI's usage; `forward_passes`: the refinement passes that carried the
  request's choices (a diffusion model commits several tokens in each)."""
  out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
  if passes is not None:
    out["forward_passes"] = passes
  return out


class _Arrival:
  """One HTTP request's place in the engine's count of arriving requests."""

  def __init__(self, engine: Engine):
    self.engine, self.pending = engine, True
    engine.arriving(+1)

  def end(self) -> None:
    if self.pending:
      self.pending = False
      self.engine.arriving(-1)


_arrival: contextvars.ContextVar[_Arrival | None] = contextvars.ContextVar("mdlm_jax_arrival", default=None)


class _AnnounceArrivals:
  """ASGI middleware: a generation request counts as arriving at the engine
  until it is submitted (`_submit_all`) or answered, so an idle engine admits
  a burst of them together (`Engine.admit_wait_s`)."""

  def __init__(self, app, engine: Engine):
    self.app, self.engine = app, engine

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
      return await self.app(scope, receive, send)
    arrival = _Arrival(self.engine)
    token = _arrival.set(arrival)
    try:
      await self.app(scope, receive, send)
    finally:
      arrival.end()
      _arrival.reset(token)


def _submit_all(state: ServerState, reqs: list[EngineRequest], want_drafts: bool):
  try:
    return _submit_each(state, reqs, want_drafts)
  finally:
    if (arrival := _arrival.get()) is not None:
      arrival.end()


def _submit_each(state: ServerState, reqs: list[EngineRequest], want_drafts: bool):
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
  except GrammarError as e:
    for h in handles:
      h.cancel()
    raise APIError(400, f"{e.field}: {e}", param=e.field, code="invalid_value") from e
  except ValueError as e:
    raise APIError(400, str(e), code="invalid_value") from e
  return handles


async def _events(handles, request: Request, *, end_only: bool = False):
  """Yields (choice index, event) from several handles as events arrive, or
  with `end_only` (a response sent whole) as each request ends, its events
  then all at once. A client that disconnects cancels its requests: a
  watcher waits on the connection itself, so their slots free within a
  pass, streaming or not."""
  loop = asyncio.get_running_loop()
  wake = asyncio.Event()
  for h in handles:
    h.add_listener(lambda: loop.call_soon_threadsafe(wake.set), end_only=end_only)

  async def watch():
    while True:
      message = await request.receive()
      if message["type"] == "http.disconnect":
        for h in handles:
          h.cancel()
        return

  watcher = asyncio.ensure_future(watch())
  open_ = set(range(len(handles)))
  try:
    while open_:
      await wake.wait()
      wake.clear()
      for i in sorted(open_):
        for ev in handles[i].poll():
          yield i, ev
          if ev.kind == "done":
            open_.discard(i)
  finally:
    watcher.cancel()


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


def _delta_chunk(rid: str, state: ServerState, created: int, index: int, delta: dict) -> dict:
  """A chat chunk with a tool-call stream's delta (content or tool_calls)."""
  return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
          "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}


def _sse(obj) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _engine_failure(ev) -> APIError | None:
  """The error a request that did not finish by itself reports."""
  if ev.finish_reason == "error":
    return APIError(500, "the engine failed while generating", code="engine_error")
  if ev.finish_reason == "cancelled":
    return APIError(503, "the request was cancelled: the server is shutting down", code="cancelled")
  return None


@dataclasses.dataclass
class _Answer:
  """One response being made: the engine requests of its choices and what
  the response body and the metrics need to say about them."""
  state: ServerState
  request: Request
  kind: str  # "chat", "completions" or "fim"
  s: Sampling
  reqs: list[EngineRequest]
  handles: list
  echo: list[str]  # text each choice starts with (completions' echo)
  prompt_tokens: int
  calls: bool  # the answer may hold tool calls, returned as `tool_calls`
  rid: str
  created: int
  t0: float

  def done(self, completion: int, reasons: list[str]) -> None:
    self.state.metrics.tokens(self.prompt_tokens, completion)
    self.state.metrics.latency(time.perf_counter() - self.t0)
    self.state.metrics.request(self.kind, 200)
    log.info("%s %s user=%s prompt_tokens=%d completion_tokens=%d finish=%s", self.rid, self.kind, self.s.user,
             self.prompt_tokens, completion, ",".join(reasons))


async def _generate(state: ServerState, request: Request, kind: str, prompts: list[Prompt], s: Sampling,
                    suffix: str = "", grammar: Grammar | None = None, end_ids: tuple[int, ...] = (),
                    calls: bool = False, lazy_tools: tools_lib.Tools | None = None):
  """`calls`: the answer may hold tool calls, returned as `tool_calls`;
  `lazy_tools`: as free text until a call opens, then under those tools'
  grammar (`lazy_calls`)."""
  reqs = _engine_requests(state, prompts, s, suffix, grammar, end_ids)
  # What the model reads, each prompt once (as OpenAI counts it for n > 1).
  prompt_tokens = sum(len(r.prompt_ids) + len(r.suffix_ids) for r in reqs[::s.n])
  echo = [p.echo for p in prompts for _ in range(s.n)]
  t0 = time.perf_counter()
  if lazy_tools is None:
    handles = _submit_all(state, reqs, want_drafts=s.diffusing)
  else:
    try:
      thens = [_calls_after(state, r, s, lazy_tools, end_ids) for r in reqs]
    except ValueError as e:  # settings the calls' decoding does not take
      raise APIError(400, str(e), code="invalid_value") from e
    calling = grammar is not None  # the first request is under a call's grammar already
    firsts = _submit_all(state, reqs if calling else [lazy_calls.first_request(r) for r in reqs],
                         want_drafts=s.diffusing)
    handles = [lazy_calls.LazyCalls(h, lambda r: state.engine.submit(r, want_drafts=s.diffusing), then, probe,
                                    calling=calling)
               for h, (then, probe) in zip(firsts, thens)]
  a = _Answer(state, request, kind, s, reqs, handles, echo, prompt_tokens, calls,
              ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12), int(time.time()), t0)
  if not s.stream:
    return await _whole(a)
  return StreamingResponse(_chunks(a), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _calls_after(state: ServerState, first: EngineRequest, s: Sampling, tools: tools_lib.Tools,
                 end_ids: tuple[int, ...]):
  """What makes the requests of a lazily constrained answer after its first (`lazy_calls.LazyCalls`): a call's
  after its opening tag, and the free probe after a closed call (none where one call is all it may hold)."""
  tag = len(state.engine.encode(tools_lib.OPENED, add_bos=False))
  sampler = state.engine.sampler_for(s.effort, revisable=False, **s.rule())
  free = state.engine.sampler_for(s.effort, **s.rule())
  call = tools_lib.grammar(tools_lib.one_call(tools), opened=True)
  probe_tokens = len(state.engine.encode("\n\n" + tools_lib.OPEN, add_bos=False))  # whitespace, then a tag

  def then(text: str, used: int):
    room = first.max_tokens - used - tag
    if room < 1:
      return None
    ids = list(first.prompt_ids) + state.engine.encode(text + tools_lib.OPENED, add_bos=False)
    if len(ids) > state.engine.sc.max_prompt:  # the text re-encoded in more tokens than it was written in
      return None
    return EngineRequest(ids, room, sampler, seed=first.seed, stop=first.stop, grammar=call, end_ids=end_ids), tag

  def probe(text: str, used: int):
    if first.max_tokens - used - tag < 1:
      return None
    ids = list(first.prompt_ids) + state.engine.encode(text, add_bos=False)
    if len(ids) + probe_tokens + tag > state.engine.sc.max_prompt:  # no room to go on with a call it opens
      return None
    return lazy_calls.first_request(EngineRequest(ids, min(probe_tokens, first.max_tokens - used), free,
                                                  seed=first.seed, stop=first.stop))
  return then, probe if tools.parallel else None


async def _whole(a: _Answer) -> JSONResponse:
  """The response to a request without `stream`: every choice at its end."""
  state, request, kind, s, reqs, handles, echo = a.state, a.request, a.kind, a.s, a.reqs, a.handles, a.echo
  prompt_tokens, calls, rid, created, done = a.prompt_tokens, a.calls, a.rid, a.created, a.done
  finals = {}
  entries = [[] if s.logprobs is not None else None for _ in reqs]
  try:
    async for i, ev in _events(handles, request, end_only=True):
      if ev.logprobs is not None and entries[i] is not None:
        entries[i] += ev.logprobs
      if ev.kind == "done":
        finals[i] = ev
  finally:
    for h in handles:
      h.cancel()  # a client that went away frees its slots; finished ones ignore this
  for ev in finals.values():
    if (err := _engine_failure(ev)) is not None:
      raise err
  completion = sum(ev.completion_tokens for ev in finals.values())
  passes = sum(ev.passes for ev in finals.values())
  done(completion, [finals[i].finish_reason for i in range(len(reqs))])
  choices = []
  for i in range(len(reqs)):
    ev = finals[i]
    if kind == "chat" and calls:
      content, made = tools_lib.split(ev.text)
      message = {"role": "assistant", "content": content}
      if made:
        message["tool_calls"] = [c.message() for c in made]
      choices.append({"index": i, "message": message, "logprobs": None,
                      "finish_reason": "tool_calls" if made and ev.finish_reason == "stop" else ev.finish_reason})
    elif kind == "chat":
      choices.append({"index": i, "message": {"role": "assistant", "content": ev.text},
                      "logprobs": _logprobs_body(state, kind, entries[i]), "finish_reason": ev.finish_reason})
    else:
      choices.append({"index": i, "text": echo[i] + ev.text, "logprobs": _logprobs_body(state, kind, entries[i]),
                      "finish_reason": ev.finish_reason})
  return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                       "created": created, "model": state.model_id, "choices": choices,
                       "usage": _usage(prompt_tokens, completion, passes)})


async def _chunks(a: _Answer):
  """The server-sent events of a streamed response: deltas (or whole drafts
  with `diffusing`), tool calls as they close, each choice's end, the usage."""
  state, request, kind, s, reqs, handles, echo = a.state, a.request, a.kind, a.s, a.reqs, a.handles, a.echo
  prompt_tokens, calls, rid, created, done = a.prompt_tokens, a.calls, a.rid, a.created, a.done
  call_streams = [tools_lib.CallStream() for _ in reqs] if calls else None
  answers = [""] * len(reqs)
  streamed = [0] * len(reqs)  # characters sent per choice (completions' text_offset)

  def call_chunks(i: int, final: bool):
    for delta in call_streams[i].feed(answers[i], final=final):
      yield _sse(_delta_chunk(rid, state, created, i, delta))

  completion, reasons, passes = 0, [], 0
  try:
    for i in range(len(reqs)):
      if kind == "chat":
        yield _sse(_chunk(kind, rid, state, created, i, "", None, role=True))
      elif echo[i] and not s.diffusing:
        yield _sse(_chunk(kind, rid, state, created, i, echo[i], None))
    async for i, ev in _events(handles, request):
      if ev.kind == "draft" and s.diffusing:
        yield _sse(_chunk(kind, rid, state, created, i, echo[i] + ev.text, None))
      elif ev.kind == "delta" and not s.diffusing and calls:
        answers[i] += ev.text
        for chunk in call_chunks(i, final=False):
          yield chunk
      elif ev.kind == "delta" and not s.diffusing:
        chunk = _chunk(kind, rid, state, created, i, ev.text, None)
        if s.logprobs is not None:
          chunk["choices"][0]["logprobs"] = _logprobs_body(state, kind, ev.logprobs or [], streamed[i])
        streamed[i] += len(ev.text)
        yield _sse(chunk)
      elif ev.kind == "done":
        if (err := _engine_failure(ev)) is not None:
          # Ended by the engine, not by the model: say so, as OpenAI's
          # clients read it (an error event raises in them), and stop.
          yield _sse(err.body())
          state.metrics.request(kind, err.status)
          return
        completion += ev.completion_tokens
        passes += ev.passes
        reasons.append(ev.finish_reason)
        finish = ev.finish_reason
        if s.diffusing:  # the last draft is the answer itself (calls as written)
          yield _sse(_chunk(kind, rid, state, created, i, echo[i] + ev.text, None))
          if calls and tools_lib.split(ev.text)[1] and finish == "stop":
            finish = "tool_calls"
        elif calls:
          answers[i] = ev.text
          for chunk in call_chunks(i, final=True):
            yield chunk
          if call_streams[i].calls and finish == "stop":
            finish = "tool_calls"
        last = _chunk(kind, rid, state, created, i, None if kind == "chat" else "", finish)
        if s.logprobs is not None and ev.logprobs:  # tokens whose text no delta carried (cut by a stop)
          last["choices"][0]["logprobs"] = _logprobs_body(state, kind, ev.logprobs, streamed[i])
        yield _sse(last)
    if s.include_usage:
      yield _sse({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                  "created": created, "model": state.model_id, "choices": [],
                  "usage": _usage(prompt_tokens, completion, passes)})
    yield "data: [DONE]\n\n"
    done(completion, reasons)
  finally:
    for h in handles:
      h.cancel()  # the client went away (or we are done): free the slots


def api_key_from_env(flag: str | None) -> str | None:
  return flag or os.environ.get("MDLM_API_KEY") or None
