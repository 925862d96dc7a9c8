"""What the engine is asked and what it answers: a request's tokens and
decoding settings, the events it streams back, and the errors a submission
can meet."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mdlm_jax.sampling import grammar as grammar_lib
from mdlm_jax.sampling.samplers import ConfidenceSampler


class QueueFull(RuntimeError):
  """More requests are waiting than the engine accepts."""


class EngineClosed(RuntimeError):
  """The engine is shutting down and admits nothing new."""


class ContextLengthExceeded(ValueError):
  """A request's prompt (and suffix) can never fit this engine's context."""


@dataclasses.dataclass(frozen=True)
class Request:
  """What to decode and how: `sampler` is the refinement rule's settings (a
  cached rule of `samplers.RULES` in the engine's block size, as
  `presets.for_model` builds it for an effort and a sampler name); `seed`
  keys its noise.
  With `suffix_ids` the request fills in the middle: the suffix is encoded
  into the slot's cache with the prompt, at the positions after the middle's
  `max_tokens`, and every block of the middle reads it."""
  prompt_ids: Sequence[int]
  max_tokens: int
  sampler: ConfidenceSampler
  seed: int = 0
  stop: tuple[str, ...] = ()
  suffix_ids: Sequence[int] = ()
  # Decode under this grammar (left to right, at least one token a pass):
  # the output is in its language, or cut by max_tokens.
  grammar: grammar_lib.Grammar | None = None
  # Tokens besides EOS that end a constrained output where the grammar may
  # end (a chat template's end of turn).
  end_ids: tuple[int, ...] = ()
  # Report each token's log-probability and this many alternatives (None: off).
  logprobs: int | None = None

  def fixed_row(self) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, RoPE positions) the prefill encodes: [suffix | prompt]."""
    p, x = len(self.prompt_ids), len(self.suffix_ids)
    tokens = np.asarray(list(self.suffix_ids) + list(self.prompt_ids), np.int32)
    positions = np.concatenate([p + self.max_tokens + np.arange(x), np.arange(p)]).astype(np.int32)
    return tokens, positions


@dataclasses.dataclass
class Event:
  """kind: "draft" (text = the whole current draft), "delta" (text = newly
  committed text) or "done" (text = the final completion). `logprobs`: for
  a request that asked, the tokens whose text this event completes, each
  (id, log-probability, [(alternative id, log-probability), ...])."""
  kind: str
  text: str = ""
  finish_reason: str | None = None
  completion_tokens: int = 0
  passes: int = 0
  logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
  stopped_by: str | None = None  # "done" only: the stop string that ended it, if one did
