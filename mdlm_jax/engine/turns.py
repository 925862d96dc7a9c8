"""One engine turn as data, and its encoding for the other processes.

Process 0 plans each turn and broadcasts it as fixed-shape arrays (the same
shapes on every process); every process decodes and applies it, so the
sharded state changes in lockstep. A request's decoding settings are
written from the sampler's own field list, so a new setting cannot be
left behind.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mdlm_jax.engine.requests import Request
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.samplers import RULES, rule_name


@dataclasses.dataclass
class Turn:
  """The device work of one engine turn, in order: free `release` rows,
  admit `admits` [(row, request, key data, start, stop)] (the request's
  fixed row [start, stop) is encoded: the whole of it, or with chunked
  prefill one chunk; start 0 resets the slot, stop at the row's end starts
  its decoding), write the host's commits for
  constrained rows `guides` [(row, tokens from the old cursor, new cursor,
  bitmask, how many of the tokens the last pass proposed)], then run one
  pass over the first `rows` slots (none when 0), `guided` when a
  constrained row is busy, `logprobs` when a busy request asked for them
  and `revising` when a busy request revises (`head_only` when every busy
  request revises without the model's drafts); `passes` > 1: up to that many
  passes in one launch (each row stops where it ends). `stop` ends every
  process's loop."""
  stop: bool = False
  release: list[int] = dataclasses.field(default_factory=list)
  admits: list[tuple[int, Request, np.ndarray, int, int]] = dataclasses.field(default_factory=list)
  guides: list[tuple[int, list[int], int, np.ndarray, int]] = dataclasses.field(default_factory=list)
  rows: int = 0
  with_head: bool = False
  guided: bool = False
  logprobs: bool = False
  revising: bool = False
  passes: int = 1
  head_only: bool = False


# A request's decoding settings travel to the other processes as the rule's name (its
# index in RULES) and field by field from the rules' own definitions: every float field as
# a float, every int or bool field as an int, logit_bias as its arrays; block_size,
# kv_cache and pass_widths are the engine's (`_check`).
_ENGINE_FIXED = ("block_size", "kv_cache", "pass_widths")
_RULE_NAMES = tuple(RULES)
_SAMPLER_FIELDS = {f.name: f.default for kind in RULES.values() for f in dataclasses.fields(kind)}
_FLOAT_SETTINGS = tuple(k for k, v in _SAMPLER_FIELDS.items() if isinstance(v, float))
_INT_SETTINGS = tuple(k for k, v in _SAMPLER_FIELDS.items()
                      if isinstance(v, (bool, int)) and not isinstance(v, float) and k not in _ENGINE_FIXED)
_untravelled = set(_SAMPLER_FIELDS) - {*_FLOAT_SETTINGS, *_INT_SETTINGS, *_ENGINE_FIXED, "logit_bias"}
if _untravelled:  # a new kind of field: teach encode and decode to carry it
  raise TypeError(f"sampler fields {sorted(_untravelled)} have no encoding for other processes")
_REQUEST_INTS = 7  # row, prompt length, max_tokens, suffix length, start, stop, rule


def encode(turn: Turn, sc) -> dict[str, np.ndarray]:
  """A turn as fixed-shape arrays, the same shapes on every process (for a broadcast)."""
  n = sc.num_slots
  out = {"head": np.asarray([turn.stop, len(turn.admits), turn.rows, turn.with_head, turn.guided, len(turn.guides),
                             turn.logprobs, turn.revising, turn.passes, turn.head_only], np.int32),
         "release": np.zeros(n, np.int32), "ints": np.zeros((n, _REQUEST_INTS + len(_INT_SETTINGS)), np.int32),
         "floats": np.zeros((n, len(_FLOAT_SETTINGS)), np.float32), "keys": np.zeros((n, 2), np.uint32),
         "prompts": np.zeros((n, sc.max_prompt), np.int32), "guide_ints": np.zeros((n, 4), np.int32),
         "guide_tokens": np.zeros((n, sc.block_size), np.int32),
         "guide_allowed": np.zeros((n, sc.bitmask_words), np.uint32),
         "bias_ids": np.full((n, rule.MAX_LOGIT_BIAS), rule.NO_BIAS_ID, np.int32),
         "bias": np.zeros((n, rule.MAX_LOGIT_BIAS), np.float32)}
  out["release"][turn.release] = 1
  for i, (row, tokens, cursor, allowed, proposed) in enumerate(turn.guides):
    out["guide_ints"][i] = (row, len(tokens), cursor, proposed)
    out["guide_tokens"][i, :len(tokens)] = tokens
    out["guide_allowed"][i] = allowed
  for i, (row, r, key, start, stop) in enumerate(turn.admits):
    given = lambda f: getattr(r.sampler, f, _SAMPLER_FIELDS[f])  # noqa: E731  (a field of another rule: its default)
    out["ints"][i] = (row, len(r.prompt_ids), r.max_tokens, len(r.suffix_ids), start, stop,
                      _RULE_NAMES.index(rule_name(r.sampler)), *(int(given(f)) for f in _INT_SETTINGS))
    out["floats"][i] = [given(f) for f in _FLOAT_SETTINGS]
    out["bias_ids"][i], out["bias"][i] = rule.bias_arrays(r.sampler.logit_bias)
    out["keys"][i] = key
    ids = list(r.prompt_ids) + list(r.suffix_ids)
    out["prompts"][i, :len(ids)] = ids
  return out


def decode(a: dict[str, np.ndarray], sc) -> Turn:
  """The turn `encode` wrote: what touches the device. Stop strings and seeds
  stay on process 0 (text matching is host work; the key is sent instead)."""
  stop, n_admits, rows, with_head, guided, n_guides, logprobs, revising, passes, head_only = (
      int(v) for v in a["head"])
  admits = []
  for i in range(n_admits):
    row, plen, max_tokens, slen, start, end, rule_index = (int(v) for v in a["ints"][i, :_REQUEST_INTS])
    kind = RULES[_RULE_NAMES[rule_index]]
    own = {f.name for f in dataclasses.fields(kind)}
    settings = {f: type(_SAMPLER_FIELDS[f])(int(v)) for f, v in zip(_INT_SETTINGS, a["ints"][i, _REQUEST_INTS:])}
    settings.update((f, float(v)) for f, v in zip(_FLOAT_SETTINGS, a["floats"][i]))
    bias = tuple((int(t), float(b)) for t, b in zip(a["bias_ids"][i], a["bias"][i]) if t != rule.NO_BIAS_ID)
    sampler = kind(block_size=sc.block_size, kv_cache=True, logit_bias=bias,
                   **{f: v for f, v in settings.items() if f in own})
    admits.append((row, Request(a["prompts"][i, :plen].tolist(), max_tokens, sampler,
                                suffix_ids=a["prompts"][i, plen:plen + slen].tolist()),
                   a["keys"][i].astype(np.uint32), start, end))
  guides = [(int(row), a["guide_tokens"][i, :int(k)].tolist(), int(cursor), a["guide_allowed"][i], int(proposed))
            for i, (row, k, cursor, proposed) in enumerate(a["guide_ints"][:n_guides])]
  return Turn(stop=bool(stop), release=np.flatnonzero(a["release"]).tolist(), admits=admits, guides=guides,
              rows=rows, with_head=bool(with_head), guided=bool(guided), logprobs=bool(logprobs),
              revising=bool(revising), passes=passes, head_only=bool(head_only))
