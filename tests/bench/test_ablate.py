"""bench ablate: the A2D recipe's choices trained for the same steps from one base."""

import json
import os

import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.bench import ablate
from mdlm_jax.training.checkpoint_eval import evaluate_checkpoint
from mdlm_jax.checkpoints import params_only

CONFIG = '''
import os
from mdlm_jax.config import load_config_file

def get_config():
  c = load_config_file(os.path.join({configs!r}, "tiny.py"))
  c.objective = "mdlm"
  c.model.update(causal=False, shift_logits=True, clean_causal=True, lora_rank=4)
  c.diffusion.update(block_size=4, distill_weight=0.5)
  c.train.update(init_from={base!r}, trainable="adapters")
  return c
'''


def recipe_file(tmp_path, base: str) -> str:
  configs = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
  path = tmp_path / "a2d_tiny.py"
  path.write_text(CONFIG.format(configs=os.path.abspath(configs), base=base))
  return str(path)


def test_stages_split_the_steps_and_chain():
  from tests.conftest import load_config
  c = load_config("tiny")
  c.train.init_from = "BASE"
  (one, c1), (two, c2) = ablate.stage_configs(c, 7, ablate.VARIANTS["curriculum"][1], "w")
  assert (c1.train.num_steps, c2.train.num_steps) == (4, 3)  # the last stage takes what is left
  assert (c1.diffusion.block_size, c2.diffusion.block_size) == (2, c.diffusion.block_size)
  assert (c1.train.init_from, c2.train.init_from) == ("BASE", one) and two == os.path.join("w", "stage2")
  [(only, full)] = ablate.stage_configs(c, 7, ablate.VARIANTS["full+ar"][1], "w")
  assert only == "w" and full.train.trainable == "all" and full.model.lora_rank == 0 and full.diffusion.ar_weight == 1
  assert c.train.num_steps == 50 and c.diffusion.ar_weight == 0  # the recipe itself is untouched


def test_unknown_variants_are_named():
  with pytest.raises(SystemExit):
    ablate.parse(["--variants", "recipe,bogus"])


@pytest.mark.slow  # three tiny runs of two steps, their evals and generators (about a minute on 2 cores)
def test_each_variant_trains_the_same_steps_and_a_second_run_only_evaluates(tiny_checkpoints, tmp_path, capsys):
  base = tiny_checkpoints["ar"]
  argv = ["--config", recipe_file(tmp_path, base), "--steps", "4", "--variants", "recipe,curriculum,full+ar",
          "--workdir", str(tmp_path / "runs"), "--eval-batches", "1", "--code-prompts", "1", "--prompt-tokens", "8",
          "--new-tokens", "8", "--json"]
  ablate.main(argv)
  res = json.loads(capsys.readouterr().out)
  rows = res["variants"]
  base_ppl = evaluate_checkpoint(base, num_batches=1, batch_size=8)["ppl"]
  assert res["base_ppl"] == pytest.approx(base_ppl)
  for name, row in rows.items():
    got = checkpoints.load(row["final"])
    assert got.step == (2 if name == "curriculum" else 4), name  # the curriculum's second stage runs two
    assert row["trained_now"] == row["trained_tokens"] == 4 * 8 * 64 and row["tokens_per_s"] > 0 and row["hours"] > 0
    assert row["bound_over_base"] == pytest.approx(row["bound_ppl"] / base_ppl)
    assert row["code"]["medium"]["tokens_per_forward"] > 0
  assert checkpoints.load(os.path.join(rows["curriculum"]["final"], "..", "stage1")).config.diffusion.block_size == 2
  # Adapters leave the base's weights as they were; the full fine-tune moves them and has no revision row.
  base_params = params_only.flatten(checkpoints.load(base).params)
  adapted = params_only.flatten(checkpoints.load(rows["recipe"]["final"]).params)
  full = params_only.flatten(checkpoints.load(rows["full+ar"]["final"]).params)
  assert all(np.array_equal(np.asarray(adapted[k]), np.asarray(v)) for k, v in base_params.items())
  assert not all(np.array_equal(np.asarray(full[k]), np.asarray(v)) for k, v in base_params.items())
  assert {"revise", "revise_all"} <= set(rows["recipe"]["code"]) and set(rows["full+ar"]["code"]) == {"medium"}
  # The same command again finds every run finished: it evaluates them, trains nothing and reports
  # the training figures the runs recorded.
  ablate.main(argv)
  again = json.loads(capsys.readouterr().out)["variants"]
  for name in rows:
    assert again[name]["trained_now"] == 0
    for k in ("trained_tokens", "tokens_per_s", "mfu", "hours"):
      assert again[name][k] == pytest.approx(rows[name][k]), (name, k)
    assert again[name]["bound_ppl"] == pytest.approx(rows[name]["bound_ppl"])
