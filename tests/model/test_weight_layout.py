"""The decoding weight layout as the generators use it: chosen per platform,
a copy (the loaded model is untouched), exact both ways, same samples."""

import jax
import numpy as np
import pytest

from mdlm_jax.checkpoints import packaged
from mdlm_jax import checkpoints
from mdlm_jax.model.layers import FEW_ROWS
from mdlm_jax.model.spec import for_decoding, with_weight_layout
from mdlm_jax.sampling.generate import ARGenerator, Generator
from mdlm_jax.sampling.presets import adapt_to_model, sampler_for
from tests.compiles import compilations


@pytest.fixture(scope="module")
def diffusion():
  return checkpoints.load(packaged.path(packaged.DIFFUSION))


def _host(params):
  return jax.tree.map(np.asarray, params)


def test_for_decoding_copies_into_the_cpu_layout_and_back_exactly(diffusion):
  before = _host(diffusion.params)
  moved = for_decoding(diffusion)
  assert moved.spec.cfg.weight_layout == "out_in" and diffusion.spec.cfg.weight_layout == "in_out"
  assert "wqkv" in moved.params["blocks"][0]["attn"] and "wq" in diffusion.params["blocks"][0]["attn"]
  jax.tree.map(np.testing.assert_array_equal, _host(diffusion.params), before)  # the input is untouched
  back = with_weight_layout(moved, "in_out")
  jax.tree.map(np.testing.assert_array_equal, _host(back.params), before)
  assert for_decoding(diffusion, "in_out") is diffusion  # already there: no copy


@pytest.mark.slow
def test_both_layouts_write_the_same_tokens(diffusion):
  sampler = adapt_to_model(sampler_for("medium"), diffusion.config.diffusion.block_size)
  prompts = ["def read_config(path):\n", "import os\n\nclass Cache:\n"]
  runs = [Generator(diffusion, weight_layout=layout).generate(prompts, max_new_tokens=32, sampler=sampler)
          for layout in ("in_out", "out_in")]
  assert [c.tokens for c in runs[0].completions] == [c.tokens for c in runs[1].completions]
  ar = checkpoints.load(packaged.path(packaged.AR))
  runs = [ARGenerator(ar, weight_layout=layout).generate(prompts, max_new_tokens=32) for layout in ("in_out", "out_in")]
  assert [c.tokens for c in runs[0].completions] == [c.tokens for c in runs[1].completions]


@pytest.mark.slow
def test_generator_picks_the_layout_by_rows_per_pass(diffusion):
  """Default on CPU: the [out, in] copy for few rows per pass, the trained
  layout past FEW_ROWS; the tokens are the same either way."""
  g = Generator(diffusion)
  assert (g.weight_layout_for(FEW_ROWS), g.weight_layout_for(FEW_ROWS + 1)) == ("out_in", "in_out")
  sampler = adapt_to_model(sampler_for("medium"), diffusion.config.diffusion.block_size)
  prompts = ["def f(x):\n", "import re\n", "class A:\n", "x = [\n", "# utils\n"]  # 5 x 16 rows > FEW_ROWS
  got = g.generate(prompts, max_new_tokens=16, sampler=sampler)
  with compilations() as again:
    g.generate(prompts, max_new_tokens=16, sampler=sampler)
  assert again == []  # one program per layout and shape, compiled once
  want = Generator(diffusion, weight_layout="out_in").generate(prompts, max_new_tokens=16, sampler=sampler)
  assert [c.tokens for c in got.completions] == [c.tokens for c in want.completions]
  with compilations() as few:
    g.generate(prompts[:1], max_new_tokens=16, sampler=sampler)  # 16 rows: the other layout, a second program
  assert any("decode_canvas" in name for name in few)


def test_unknown_layout_is_refused(diffusion):
  with pytest.raises(ValueError, match="weight_layout 'rows'"):
    Generator(diffusion, weight_layout="rows")
