"""OpenAI request bodies, checked field by field, and the OpenAI error shape.

Requests are read as plain JSON and validated here, so every bad field gets a
400 that names it (`param`), in the shape the official clients parse.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from mdlm_jax.sampling.grammar import Grammar, GrammarError
from mdlm_jax.sampling.presets import DEFAULT_EFFORT, EFFORTS
from mdlm_jax.sampling.rule import MAX_LOGIT_BIAS, MAX_LOOKUP
from mdlm_jax.sampling.samplers import RULES


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
  max_choices: int = 64  # prompts x n in one /v1/completions request


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
  user: str | None = None
  logprobs: int | None = None  # alternatives per token when log-probabilities are asked for
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
  revise: bool | None = None  # drafts kept only where the base agrees (None: as the effort has it)
  sampler: str | None = None  # a rule of samplers.RULES instead of the effort's threshold rule
  steps: int | None = None  # low_confidence: passes per block
  agreement: float | None = None  # with revise: drafts the base rates this near its best are kept too
  # with revise: drafts copied after this many matching tokens, and from the model's draft table (None: the
  # effort's; 0: neither)
  lookup: int | None = None

  def rule(self) -> dict:
    """The rule's name and settings as `presets.for_model` takes them."""
    return {"sampler": self.sampler, "steps": self.steps, "temperature": self.temperature, "top_p": self.top_p,
            "revise": self.revise, "agreement": self.agreement, "lookup": self.lookup, **self.moves()}

  def moves(self) -> dict:
    """The logit moves as sampler settings (`presets.sampler_for` overrides)."""
    return {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias}


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
  for key in options:
    if key != "include_usage":
      raise _unsupported(f"stream_options.{key}", "only include_usage is supported")
  diffusing = _get(body, "diffusing", bool, False)
  if diffusing and not stream:
    raise _bad("diffusing", "diffusing streams drafts: it needs stream=true")
  user = _get(body, "user", str, None)
  penalties = {}
  for name in ("presence_penalty", "frequency_penalty"):
    penalties[name] = float(_get(body, name, (int, float), 0.0))
    if not -2.0 <= penalties[name] <= 2.0:
      raise _bad(name, f"must be in [-2, 2], got {penalties[name]}")
  sampler, steps = parse_rule(body)
  revise = _get(body, "revise", bool, None)
  agreement = _get(body, "agreement", (int, float), None)
  if agreement is not None:
    agreement = float(agreement)
    if not 0.0 < agreement <= 1.0:
      raise _bad("agreement", f"must be in (0, 1], got {agreement}")
    if agreement < 1.0 and revise is not True:
      raise _bad("agreement", "sets which drafts revision keeps: it needs revise=true")
  lookup = _get(body, "lookup", int, None)
  if lookup is not None:
    if not 0 <= lookup <= MAX_LOOKUP:
      raise _bad("lookup", f"must be in [0, {MAX_LOOKUP}], got {lookup}")
    if lookup and revise is not True:
      raise _bad("lookup", "offers copied drafts for revision to verify: it needs revise=true")
  return Sampling(max_tokens, temperature, top_p, seed, stop, n, stream, include_usage, effort, diffusing, user,
                  logit_bias=parse_logit_bias(body), revise=revise, sampler=sampler, steps=steps, agreement=agreement,
                  lookup=lookup, **penalties)


MAX_STEPS = 1024


def parse_rule(body: dict) -> tuple[str | None, int | None]:
  """(sampler, steps): the refinement rule a request names instead of the
  effort's, `steps` its passes per block for low_confidence."""
  sampler = _get(body, "sampler", str, None)
  if sampler is not None and sampler not in RULES:
    raise _bad("sampler", f"must be one of {', '.join(RULES)}, got {sampler!r}")
  steps = _get(body, "steps", int, None)
  if steps is not None:
    if sampler != "low_confidence":
      raise _bad("steps", "sets the passes per block of sampler=low_confidence")
    if not 1 <= steps <= MAX_STEPS:
      raise _bad("steps", f"must be in [1, {MAX_STEPS}], got {steps}")
  if sampler == "low_confidence":
    if "reasoning_effort" in body:
      raise _bad("reasoning_effort", "chooses the threshold rule's settings; sampler=low_confidence takes steps")
    if body.get("revise"):
      raise _bad("revise", "revision verifies the threshold rule's drafts; it does not apply to low_confidence")
  return sampler, steps


def parse_output_cap(body: dict) -> tuple[int | None, str]:
  """(max_tokens or max_completion_tokens, the field's name) of an answer
  that is not decoded token by token (apply-edit's merged file): None, no cap."""
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  cap = _get(body, name, int, None)
  if cap is not None and cap < 1:
    raise _bad(name, f"must be at least 1, got {cap}")
  return cap, name


def check_logit_bias_ids(pairs: tuple[tuple[int, float], ...], vocab_size: int) -> None:
  """A 400 naming the first logit_bias id the model has no logit for."""
  for tok, _ in pairs:
    if tok >= vocab_size:
      raise _bad(f"logit_bias.{tok}", f"token id {tok} is outside the model's vocabulary of {vocab_size}")


def parse_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
  """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as (id, bias)
  pairs (`check_logit_bias_ids` checks the ids against a model)."""
  name = "logit_bias"
  v = _get(body, name, dict, {})
  if len(v) > MAX_LOGIT_BIAS:
    raise _bad(name, f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
  out = []
  for k, b in v.items():
    if not k.isdigit():
      raise _bad(f"{name}.{k}", "keys must be token ids (non-negative integers as strings)")
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
      raise _bad(f"{name}.{k}", f"the bias must be a number in [-100, 100], got {b!r}")
    out.append((int(k), float(b)))
  ids = [i for i, _ in out]
  if len(set(ids)) != len(ids):
    raise _bad(name, "a token id appears twice")
  return tuple(sorted(out))


def parse_messages(body: dict) -> list[dict[str, Any]]:
  """Chat messages as the template reads them: role and content (text parts
  joined), an assistant's `tool_calls`, a tool message's `tool_call_id`,
  and an optional `name`; anything else is a 400 naming it."""
  messages = _get(body, "messages", list, None)
  if not messages:
    raise APIError(400, "messages: a non-empty array is required", param="messages", code="missing_required_field")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise _bad(f"messages[{i}]", "each message must be an object")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
      raise _bad(f"messages[{i}].role", f"must be system, developer, user, assistant or tool, got {role!r}")
    for key in m:
      if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
        raise _unsupported(f"messages[{i}].{key}", "not a message field this server implements")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
    calls = m.get("tool_calls")
    if calls is not None:
      if role != "assistant":
        raise _bad(f"messages[{i}].tool_calls", "only assistant messages make tool calls")
      if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls", "must be an array")
      msg["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    content = m.get("content")
    if content is None and role == "assistant" and msg.get("tool_calls"):
      content = ""
    msg["content"] = _text(content, f"messages[{i}].content")
    if role == "tool":
      if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
        raise APIError(400, f"messages[{i}].tool_call_id: a tool message must name the call it answers",
                       param=f"messages[{i}].tool_call_id", code="missing_required_field")
      msg["tool_call_id"] = m["tool_call_id"]
    elif "tool_call_id" in m:
      raise _bad(f"messages[{i}].tool_call_id", "only tool messages answer tool calls")
    if "name" in m:
      if not isinstance(m["name"], str):
        raise _bad(f"messages[{i}].name", "must be a string")
      msg["name"] = m["name"]
    out.append(msg)
  return out


def _text(content, param: str) -> str:
  if isinstance(content, list):  # content parts: text only
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
      raise _bad(param, "only text content parts are supported")
    content = "".join(p["text"] for p in content)
  if not isinstance(content, str):
    raise _bad(param, "must be a string or an array of text parts")
  return content


def _tool_call(call, param: str) -> dict:
  fn = call.get("function") if isinstance(call, dict) else None
  if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
    raise _bad(param, 'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}')
  if not isinstance(call.get("id"), str) or not call["id"]:
    raise _bad(f"{param}.id", "a tool call needs an id")
  if not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
    raise _bad(f"{param}.function", "needs a name and its arguments as a JSON string")
  try:
    json.loads(fn["arguments"])
  except ValueError:
    raise _bad(f"{param}.function.arguments", "is not JSON") from None
  return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}


def parse_prompts(body: dict, vocab_size: int, limits: Limits, n: int) -> list[str | list[int]]:
  """/v1/completions' `prompt`: a string, token ids, or an array of either."""
  prompt = _get(body, "prompt", (str, list), None)
  if prompt is None:
    raise APIError(400, "prompt: a string, an array of strings or an array of token ids is required",
                   param="prompt", code="missing_required_field")
  if isinstance(prompt, str) or (prompt and all(_is_token(t) for t in prompt)):
    prompts = [prompt]
  else:
    prompts = prompt
  if not prompts:
    raise _bad("prompt", "must not be an empty array")
  if len(prompts) * n > limits.max_choices:
    raise _bad("prompt", f"{len(prompts)} prompts x n={n} is more than {limits.max_choices} completions")
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      continue
    if not isinstance(p, list) or not p or not all(_is_token(t) for t in p):
      raise _bad(f"prompt[{i}]", "each prompt must be a string or a non-empty array of token ids")
    bad = [t for t in p if not 0 <= t < vocab_size]
    if bad:
      raise _bad(f"prompt[{i}]", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
  return prompts


def _is_token(t) -> bool:
  return isinstance(t, int) and not isinstance(t, bool)


def parse_prompt(body: dict, field: str = "prompt") -> str:
  """One prompt string (fill-in-the-middle)."""
  prompt = _get(body, field, str, None)
  if prompt is None:
    raise APIError(400, f"{field}: a string is required", param=field, code="missing_required_field")
  return prompt


def parse_suffix(body: dict) -> str | None:
  return _get(body, "suffix", str, None)


def parse_echo(body: dict) -> bool:
  return bool(_get(body, "echo", bool, False))


def parse_logprobs(body: dict, endpoint: str) -> int | None:
  """How many alternatives to report with each token's log-probability, or
  None for none: chat's `logprobs` (bool) and `top_logprobs` (0 to 20),
  completions' `logprobs` (0 to 5)."""
  if endpoint == "chat":
    on = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not 0 <= top <= 20:
      raise _bad("top_logprobs", f"must be in [0, 20], got {top}")
    if top and not on:
      raise _bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if on else None
  k = _get(body, "logprobs", int, None)
  if k is not None and not 0 <= k <= 5:
    raise _bad("logprobs", f"must be in [0, 5], got {k}")
  return k


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


# -- fields: implemented, or refused by name ---------------------------------------

# Structured outputs: OpenAI's response_format, and vLLM's guided_* fields
# (what `extra_body` sends from the official client).
GUIDANCE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
LOGIT_MOVES = ("presence_penalty", "frequency_penalty", "logit_bias")
RULE_FIELDS = ("revise", "agreement", "lookup", "sampler", "steps")
ENDPOINT_FIELDS = {
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
             "stream", "stream_options", "reasoning_effort", "diffusing", "user", "tools", "tool_choice",
             "parallel_tool_calls", "logprobs", "top_logprobs", *RULE_FIELDS, *GUIDANCE_FIELDS, *LOGIT_MOVES},
    "completions": {"model", "prompt", "suffix", "echo", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
                    "stream", "stream_options", "reasoning_effort", "diffusing", "user", "logprobs",
                    *RULE_FIELDS, *GUIDANCE_FIELDS, *LOGIT_MOVES},
    "fim": {"model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
            "stream_options", "reasoning_effort", "diffusing", "user", *RULE_FIELDS},
    "apply": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
              "stream", "stream_options", "reasoning_effort", "user"},
}
# OpenAI fields not implemented yet: checked, and accepted only at the value
# that asks for nothing (which is then exactly what the server does).
NEUTRAL_ONLY = {
    "chat": (),
    "completions": ("best_of",),
    "fim": (),
    "apply": (),
}


def _unsupported(param: str, message: str) -> APIError:
  return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def check_fields(body: dict, endpoint: str) -> None:
  """Every field of the body is one this endpoint implements, or an OpenAI
  field at its neutral value; anything else is a 400 naming it."""
  neutral = NEUTRAL_ONLY[endpoint]
  for name in body:
    if name in ENDPOINT_FIELDS[endpoint]:
      continue
    if name not in neutral:
      raise _unsupported(name, f"not a field this server's {endpoint} endpoint implements")
    if body[name] is not None:
      _CHECKS[(endpoint, name) if (endpoint, name) in _CHECKS else name](body, name)


def _best_of(body: dict, name: str) -> None:
  v = _get(body, name, int)
  n = body.get("n") if isinstance(body.get("n"), int) else 1
  if v < max(n, 1):
    raise _bad(name, f"must be at least n ({n}), got {v}")
  if v != n:
    raise _unsupported(name, "best_of is not implemented (only equal to n)")


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_guidance(body: dict) -> Grammar | None:
  """The grammar a request's output must follow, from at most one of
  response_format (text, json_object, json_schema), guided_json,
  guided_regex, guided_grammar (Lark or GBNF) and guided_choice; None for
  free text. A malformed one is a 400 naming its field."""
  given = guidance_given(body)
  if len(given) > 1:
    raise _bad(given[1], f"only one output constraint per request; {given[0]} is already given")
  if not given:
    if "response_format" in body and body["response_format"] is not None:
      _response_format_type(body)  # {"type": "text"}: check it all the same
    return None
  name = given[0]
  try:
    if name == "response_format":
      return _response_format(body)
    if name == "guided_json":
      schema = _get(body, name, (dict, str))
      if isinstance(schema, str):
        try:
          schema = json.loads(schema)
        except ValueError as e:
          raise _bad(name, f"not a JSON schema: {e}") from None
      return Grammar.json_schema(schema, name)
    if name == "guided_regex":
      return Grammar.regex(_get(body, name, str), name)
    if name == "guided_grammar":
      return Grammar.lark(_get(body, name, str), name)
    return Grammar.choice(_get(body, name, list), name)
  except GrammarError as e:
    raise _bad(e.field, str(e)) from None


def guidance_given(body: dict) -> list[str]:
  """The output-constraint fields a request sets ({"type": "text"} sets none)."""
  return [name for name in GUIDANCE_FIELDS if body.get(name) is not None
          and not (name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text")]


def _response_format_type(body: dict) -> str:
  v = _get(body, "response_format", dict)
  kind = v.get("type")
  if kind not in ("text", "json_object", "json_schema"):
    raise _bad("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
  for key in v:
    if key not in ("type", "json_schema"):
      raise _unsupported(f"response_format.{key}", "not a response_format field")
  return kind


def _response_format(body: dict) -> Grammar:
  name = "response_format"
  if _response_format_type(body) == "json_object":
    return Grammar.json_object(name)
  spec = body[name].get("json_schema")
  if not isinstance(spec, dict):
    raise _bad(f"{name}.json_schema", "must be an object with a name and a schema")
  if not isinstance(spec.get("name"), str) or not _SCHEMA_NAME.fullmatch(spec["name"]):
    raise _bad(f"{name}.json_schema.name", "must be 1 to 64 letters, digits, _ or -")
  for key, kinds in (("description", str), ("strict", (bool, type(None)))):
    if key in spec and not isinstance(spec[key], kinds):
      raise _bad(f"{name}.json_schema.{key}", f"expected {_kind_name(kinds)}")
  for key in spec:
    if key not in ("name", "schema", "description", "strict"):
      raise _unsupported(f"{name}.json_schema.{key}", "not a json_schema field")
  schema = spec.get("schema", {})
  if not isinstance(schema, dict):
    raise _bad(f"{name}.json_schema.schema", "must be a JSON Schema object")
  return Grammar.json_schema(schema, f"{name}.json_schema.schema")


_CHECKS = {
    "best_of": _best_of,
}
