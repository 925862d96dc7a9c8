"""Reasoning-effort presets: named sampler settings, from fastest to most careful.

All four are confidence-threshold samplers with greedy (temperature 0)
proposals, decoding semi-autoregressively in blocks (32 tokens, or the block
size a BD3-LM model was trained with). Each pass commits every proposal at
least `threshold` sure and never fewer than `min_tokens`, so a preset bounds
the passes per block from above and lets confident stretches go faster.
"""

from __future__ import annotations

from mdlm_jax.sampling.samplers import AncestralSampler, LowConfidenceSampler, ThresholdSampler

BLOCK = 32

PRESETS = {
    # At least 8 tokens a pass (one pass per block of 8), and anything 30% sure.
    "instant": ThresholdSampler(threshold=0.3, min_tokens=8, block_size=BLOCK),
    # At least 4 tokens a pass, and anything 30% sure: a block of 8 goes in one
    # pass whenever all of it is. (With 6 at least a pass, every block of 8
    # still took 2 passes, as at medium, and the text was worse.)
    "low": ThresholdSampler(threshold=0.3, min_tokens=4, block_size=BLOCK),
    # At least 4 tokens a pass, more wherever the model is 90% sure.
    "medium": ThresholdSampler(threshold=0.9, min_tokens=4, block_size=BLOCK),
    # At least 2 a pass, and only the very confident beyond that.
    "high": ThresholdSampler(threshold=0.95, min_tokens=2, block_size=BLOCK),
}
EFFORTS = tuple(PRESETS)
DEFAULT_EFFORT = "medium"


def sampler_for(effort: str = DEFAULT_EFFORT, *, sampler: str | None = None, steps: int | None = None,
                block_size: int | None = None, threshold: float | None = None, temperature: float | None = None,
                min_tokens: int | None = None):
  """The preset for `effort`, or the named sampler, with any overrides."""
  import dataclasses
  if effort not in PRESETS:
    raise ValueError(f"unknown effort {effort!r}; choose from {', '.join(EFFORTS)}")
  base = PRESETS[effort]
  if sampler is not None:
    kinds = {"ancestral": AncestralSampler(), "low_confidence": LowConfidenceSampler(block_size=BLOCK),
             "threshold": ThresholdSampler(block_size=BLOCK)}
    if sampler not in kinds:
      raise ValueError(f"unknown sampler {sampler!r}; choose from {', '.join(kinds)}")
    base = kinds[sampler]
  fields = {f.name for f in dataclasses.fields(base)}
  overrides = {"steps": steps, "block_size": block_size, "threshold": threshold, "temperature": temperature,
               "min_tokens": min_tokens}
  changes = {}
  for name, value in overrides.items():
    if value is None:
      continue
    if name not in fields:
      raise ValueError(f"--{name.replace('_', '-')} does not apply to the {type(base).__name__}")
    changes[name] = value
  if changes.get("steps", 1) < 1:
    raise ValueError(f"--steps must be >= 1, got {changes['steps']}")
  if changes.get("min_tokens", 1) < 1:
    raise ValueError(f"--min-tokens must be >= 1, got {changes['min_tokens']}")
  if changes.get("block_size", 0) < 0:
    raise ValueError(f"--block-size must be >= 0, got {changes['block_size']}")
  if not 0 <= changes.get("threshold", 0.5) <= 1:
    raise ValueError(f"--threshold must be in [0, 1], got {changes['threshold']}")
  if changes.get("temperature", 0) < 0:
    raise ValueError(f"--temperature must be >= 0, got {changes['temperature']}")
  return dataclasses.replace(base, **changes)


def adapt_to_model(sampler, model_block_size: int):
  """Block-diffusion (BD3-LM) models decode exactly with a KV cache in blocks
  of the size they were trained on: confidence samplers switch to that."""
  import dataclasses
  if model_block_size > 0 and hasattr(sampler, "kv_cache"):
    return dataclasses.replace(sampler, block_size=model_block_size, kv_cache=True)
  return sampler
