"""OpenAI request bodies, checked field by field, and the OpenAI error shape.

Requests are read as plain JSON and validated here, so every bad field gets a
400 that names it (`param`), in the shape the official clients parse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mdlm_jax.sampling.presets import DEFAULT_EFFORT, EFFORTS


class APIError(Exception):
  """An error response: {"error": {"message", "type", "param", "code"}}."""

  TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
           405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
           429: "rate_limit_error", 500: "server_error", 503: "server_error"}

  def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                      "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
  max_body_bytes: int = 1 << 20
  max_prompt_tokens: int = 512
  max_tokens: int = 512
  max_n: int = 8
  max_stop: int = 4


@dataclasses.dataclass
class Sampling:
  """What every generation endpoint takes."""
  max_tokens: int
  temperature: float
  top_p: float
  seed: int | None
  stop: tuple[str, ...]
  n: int
  stream: bool
  include_usage: bool
  effort: str
  diffusing: bool


def _bad(param: str, message: str) -> APIError:
  return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _get(body: dict, name: str, kinds, default=None, *, allow_none: bool = True):
  if name not in body or (body[name] is None and allow_none):
    return default
  value = body[name]
  if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
    raise _bad(name, f"expected {_kind_name(kinds)}, got a boolean")
  if not isinstance(value, kinds):
    raise _bad(name, f"expected {_kind_name(kinds)}, got {type(value).__name__}")
  return value


def _kind_name(kinds) -> str:
  kinds = kinds if isinstance(kinds, tuple) else (kinds,)
  names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
           dict: "an object"}
  return " or ".join(names.get(k, k.__name__) for k in kinds)


def parse_sampling(body: dict, limits: Limits, *, default_max_tokens: int, max_tokens_field: str = "max_tokens"
                   ) -> Sampling:
  max_tokens = _get(body, max_tokens_field, int, None)
  if max_tokens_field == "max_tokens" and "max_completion_tokens" in body:
    max_tokens = _get(body, "max_completion_tokens", int, max_tokens)
    max_tokens_field = "max_completion_tokens"
  if max_tokens is None:
    max_tokens = default_max_tokens
  if not 1 <= max_tokens <= limits.max_tokens:
    raise _bad(max_tokens_field, f"must be in [1, {limits.max_tokens}], got {max_tokens}")
  temperature = float(_get(body, "temperature", (int, float), 0.0))
  if not 0.0 <= temperature <= 2.0:
    raise _bad("temperature", f"must be in [0, 2], got {temperature}")
  top_p = float(_get(body, "top_p", (int, float), 1.0))
  if not 0.0 < top_p <= 1.0:
    raise _bad("top_p", f"must be in (0, 1], got {top_p}")
  seed = _get(body, "seed", int, None)
  stop = _get(body, "stop", (str, list), None)
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  else:
    if len(stop) > limits.max_stop or not all(isinstance(s, str) for s in stop):
      raise _bad("stop", f"must be a string or an array of at most {limits.max_stop} strings")
    stop = tuple(stop)
  if any(s == "" for s in stop):
    raise _bad("stop", "stop strings must not be empty")
  n = _get(body, "n", int, 1)
  if not 1 <= n <= limits.max_n:
    raise _bad("n", f"must be in [1, {limits.max_n}], got {n}")
  stream = _get(body, "stream", bool, False)
  options = _get(body, "stream_options", dict, {})
  if options and not stream:
    raise _bad("stream_options", "only allowed with stream=true")
  include_usage = bool(_get(options, "include_usage", bool, False)) if options else False
  effort = _get(body, "reasoning_effort", str, DEFAULT_EFFORT)
  if effort not in EFFORTS:
    raise _bad("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
  diffusing = _get(body, "diffusing", bool, False)
  if diffusing and not stream:
    raise _bad("diffusing", "diffusing streams drafts: it needs stream=true")
  return Sampling(max_tokens, temperature, top_p, seed, stop, n, stream, include_usage, effort, diffusing)


def parse_messages(body: dict) -> list[dict[str, str]]:
  messages = _get(body, "messages", list, None)
  if not messages:
    raise APIError(400, "messages: a non-empty array is required", param="messages", code="missing_required_field")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise _bad(f"messages[{i}]", "each message must be an object")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
      raise _bad(f"messages[{i}].role", f"must be system, developer, user or assistant, got {role!r}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        raise _bad(f"messages[{i}].content", "only text content parts are supported")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise _bad(f"messages[{i}].content", "must be a string or an array of text parts")
    out.append({"role": "system" if role == "developer" else role, "content": content})
  return out


def parse_prompt(body: dict, field: str = "prompt") -> str:
  prompt = _get(body, field, (str, list), None)
  if isinstance(prompt, list):
    if len(prompt) != 1 or not isinstance(prompt[0], str):
      raise _bad(field, "batched prompts are not supported: send one string (use n for several samples)")
    prompt = prompt[0]
  if prompt is None:
    raise APIError(400, f"{field}: a string is required", param=field, code="missing_required_field")
  return prompt


def parse_suffix(body: dict) -> str | None:
  return _get(body, "suffix", str, None)


def parse_model(body: dict, model_id: str) -> str:
  model = _get(body, "model", str, None)
  if model is None:
    raise APIError(400, "model: a string is required", param="model", code="missing_required_field")
  if model != model_id:
    raise APIError(404, f"The model {model!r} does not exist; this server serves {model_id!r}", param="model",
                   code="model_not_found")
  return model


def require_object(body: Any) -> dict:
  if not isinstance(body, dict):
    raise APIError(400, "the request body must be a JSON object", code="invalid_json")
  return body
