"""Reasoning-effort presets: named settings of the refinement rule, from
fastest to most careful, and the one function (`for_model`) that says what an
effort means for a model. The CLI, the engine, the server and the benchmarks
all call it, so one effort decodes the same everywhere.

All four are confidence-threshold samplers with greedy (temperature 0)
proposals, decoding semi-autoregressively in blocks of the block size a
BD3-LM model was trained with, against a KV cache: exact for such a model. A
model trained on whole sequences (LLaDA, Dream, plain MDLM) decodes in
full-canvas passes over blocks of 32 by default, as its reference
implementations do; cached blocks (`kv_cache=True`, which the engine needs)
are an approximation for it that ignores the masked blocks to the right. Each
pass commits every proposal at least `threshold` sure and never fewer than
`min_tokens`, so a preset bounds the passes per block from above and lets
confident stretches go faster.
"""

from __future__ import annotations

import dataclasses

import jax

from mdlm_jax.sampling.samplers import SAMPLERS, ThresholdSampler

BLOCK = 32  # the block size of models not trained with BD3-LM

PRESETS = {
    # At least 8 tokens a pass (one pass per block of 8), and anything 30% sure.
    "instant": ThresholdSampler(threshold=0.3, min_tokens=8, block_size=BLOCK, kv_cache=True),
    # At least 4 tokens a pass, and anything 30% sure: a block of 8 goes in one
    # pass whenever all of it is. (With 6 at least a pass, every block of 8
    # still took 2 passes, as at medium, and the text was worse.)
    "low": ThresholdSampler(threshold=0.3, min_tokens=4, block_size=BLOCK, kv_cache=True),
    # At least 4 tokens a pass, more wherever the model is 90% sure.
    "medium": ThresholdSampler(threshold=0.9, min_tokens=4, block_size=BLOCK, kv_cache=True),
    # At least 2 a pass, and only the very confident beyond that.
    "high": ThresholdSampler(threshold=0.95, min_tokens=2, block_size=BLOCK, kv_cache=True),
}
EFFORTS = tuple(PRESETS)
DEFAULT_EFFORT = "medium"
_OVERRIDES = ("steps", "block_size", "threshold", "temperature", "top_p", "min_tokens", "kv_cache",
              "presence_penalty", "frequency_penalty", "logit_bias", "revise", "agreement", "lookup", "head_width",
              "model_drafts", "table_floor", "pass_widths")


def block_size_for(model_block_size: int) -> int:
  """The decoding block of a model: its BD3-LM block, else BLOCK."""
  return model_block_size if model_block_size > 0 else BLOCK


def sampler_for(effort: str = DEFAULT_EFFORT, *, sampler: str | None = None, **overrides):
  """The preset for `effort`, or the named sampler, with any overrides
  (None leaves a field as it is). Settings are validated by the sampler."""
  base = _named(effort, sampler)
  return dataclasses.replace(base, **_changes(base, overrides))


def _named(effort: str, sampler: str | None):
  """The preset for `effort`, or the named sampler in cached blocks where it has them."""
  if effort not in PRESETS:
    raise ValueError(f"unknown effort {effort!r}; choose from {', '.join(EFFORTS)}")
  if sampler is None:
    return PRESETS[effort]
  if sampler not in SAMPLERS:
    raise ValueError(f"unknown sampler {sampler!r}; choose from {', '.join(SAMPLERS)}")
  kind = SAMPLERS[sampler]
  return kind(block_size=BLOCK, kv_cache=True) if "kv_cache" in {f.name for f in dataclasses.fields(kind)} \
      else kind()


def _changes(base, overrides: dict) -> dict:
  """The overrides that are set, each checked to be a field of `base`."""
  unknown = set(overrides) - set(_OVERRIDES)
  if unknown:
    raise TypeError(f"sampler_for got unknown settings {sorted(unknown)}")
  fields = {f.name for f in dataclasses.fields(base)}
  changes = {}
  for name, value in overrides.items():
    if value is None:
      continue
    if name not in fields:
      raise ValueError(f"--{name.replace('_', '-')} does not apply to the {type(base).__name__}")
    changes[name] = value
  return changes


def adapt_to_model(sampler, model_block_size: int):
  """Block-diffusion (BD3-LM) models decode exactly with a KV cache in blocks
  of the size they were trained on: a cached confidence sampler takes that."""
  if model_block_size > 0 and getattr(sampler, "kv_cache", False):
    return dataclasses.replace(sampler, block_size=model_block_size)
  return sampler


PRESET_BLOCK = 8  # the block the presets' floors were chosen for (the packaged BD3 model's)
# On an adapted AR model these write the base's own text: its drafts are
# verified by the base (revise) where a request can be revised, else they
# commit the base's own token and only confident ones beside it.
BASE_FIRST_EFFORTS = ("medium", "high")
# The drafts a revising pass offers are at least this sure. On the packaged
# default's HumanEval chat answers (10 problems) 0 and 0.3 kept 1.32 tokens a
# pass, 0.6 1.20 and 0.9 1.04: a hopeless draft costs the drafts behind it.
DRAFT_THRESHOLD = 0.3
# A revising pass also offers drafts copied from the prompt and the text so
# far after this many matching tokens (`rule.lookup_drafts`), and chained from
# the model's table of its own answers (`sampling.draft_table`), where the
# model's own drafts are fewer.
DRAFT_LOOKUP = 2


def model_drafts_pay() -> bool:
  """Whether a revising pass carries the model's masked block by default.
  On CPU a pass costs about its token rows: on the packaged default's
  HumanEval chat answers the block (four more rows, with the adapters) made
  a pass 1.4 to 1.6 times as long for 3% more tokens a pass than copies and
  the draft table alone (docs/sampling.md), so there it is left out.
  Elsewhere it stays: an accelerator's pass reads the weights once for any
  few rows (not measured yet)."""
  return jax.default_backend() != "cpu"


# On CPU a revising pass verifies this many columns (the base's next token and
# five drafts) rather than its block of four: copied and table drafts run past
# the block. On the packaged default's first 20 HumanEval chat answers (the
# one-shot generator, w8a8, without the masked block) heads of 4, 5 and 6 kept
# 2.37, 2.57 and 2.72 tokens a pass, and a pass of 6 rows took about 9% longer
# than one of 4 (8 rows: 27% longer for 2.5 tokens a pass with the table of pairs).
CPU_HEAD_WIDTH = 6


def head_width_for(block_size: int) -> int:
  """The columns of a revising pass's verified head on this backend (0: the
  block). On CPU a pass costs about its token rows, and CPU_HEAD_WIDTH paid
  there; elsewhere the block stays, not yet measured."""
  return max(block_size, CPU_HEAD_WIDTH) if jax.default_backend() == "cpu" else 0


def for_model(effort: str, model_block_size: int, *, sampler: str | None = None, in_order: bool = False,
              revisable: bool = True, **overrides):
  """What `effort` (with any overrides) decodes with on a model whose BD3-LM
  block is `model_block_size` (0: trained on whole sequences, decoded in
  exact full-canvas passes unless `kv_cache=True`). An explicit
  `block_size` override wins over the model's. `in_order` (an AR model
  adapted to diffusion, model.clean_causal): the floor commits the leftmost
  undecided tokens, the first of which its base predicts exactly. At
  `medium` and `high` the floor is that one token, so at temperature 0 they
  never write worse than the base's greedy text and every other token they
  commit (90% or 95% sure) is speed; `low` and `instant` keep their share of
  the block (half of it, all of it), trading quality for passes.

  `revise` (None: as the effort has it) keeps only the drafts the base's
  own causal pass proposes too: the text is then the base's, exactly, and
  the drafts buy speed (`rule.verify`; offered from DRAFT_THRESHOLD sure
  unless `threshold` says otherwise, and copied from earlier in the text
  after DRAFT_LOOKUP matching tokens unless `lookup` says otherwise; a head of
  `head_width_for` columns unless `head_width` says otherwise). `medium` and `high` revise on an
  adapted model whenever the request is `revisable`: it writes left to right
  from a prompt (no suffix to infill against, no grammar)."""
  revise = overrides.pop("revise", None)
  if revise and not in_order:
    raise ValueError("revise keeps the drafts its base agrees with: it needs an AR model adapted to diffusion"
                     " (model.clean_causal)")
  if revise and not revisable:
    raise ValueError("revise writes left to right from a prompt: it cannot infill against a suffix or run under"
                     " a grammar")
  base = _named(effort, sampler)
  if revise and not isinstance(base, ThresholdSampler):
    raise ValueError(f"revise applies to the threshold sampler, not the {type(base).__name__}")
  changes = _changes(base, overrides)
  has_cache = "kv_cache" in {f.name for f in dataclasses.fields(base)}
  if "block_size" not in changes and model_block_size > 0 and changes.get("kv_cache", has_cache and base.kv_cache):
    changes["block_size"] = model_block_size  # BD3-LM: exact cached blocks of the trained size
  if model_block_size <= 0 and "kv_cache" not in changes and has_cache:
    changes["kv_cache"] = False  # exact unless the caller opts into the approximation
  if in_order and isinstance(base, ThresholdSampler):
    block = changes.get("block_size", base.block_size)
    min_tokens = changes.get("min_tokens", base.min_tokens)
    share = 1 if effort in BASE_FIRST_EFFORTS else max(1, min_tokens * block // PRESET_BLOCK)
    changes.update(in_order=True, min_tokens=min_tokens if overrides.get("min_tokens") is not None else share)
    if revise is None:
      revise = effort in BASE_FIRST_EFFORTS and revisable and changes.get("kv_cache", base.kv_cache) and block >= 2
    if revise:
      lookup = changes.get("lookup", DRAFT_LOOKUP)
      changes.update(revise=True, threshold=changes.get("threshold", DRAFT_THRESHOLD), lookup=lookup,
                     model_drafts=changes.get("model_drafts", model_drafts_pay() or not lookup),
                     head_width=changes.get("head_width", head_width_for(block) if lookup else 0))
  return dataclasses.replace(base, **changes)  # validated once, as built
