"""int8 decoding weights in the model and the generators: every matmul weight
quantized once at load; the passes equal the same int8 model's through XLA's
float path (token rows rounded to int16 alike), and lie within that rounding's
reach of a float32 model holding the dequantized weights."""

import dataclasses

import jax
import numpy as np
import pytest

from mdlm_jax import checkpoints, kernels
from mdlm_jax.checkpoints import packaged
from mdlm_jax.kernels import int8
from mdlm_jax.model.spec import bind, for_decoding
from mdlm_jax.sampling.generate import ARGenerator, Generator
from mdlm_jax.sampling.presets import adapt_to_model, sampler_for

PROMPTS = ["def read_config(path):\n", "import os\n\nclass Cache:\n"]


@pytest.fixture(scope="module")
def diffusion():
  return checkpoints.load(packaged.path(packaged.DIFFUSION))


def dequantized(loaded):
  """The same out_in model with each int8 weight replaced by its float32 value."""
  is_q = lambda x: isinstance(x, kernels.QuantizedWeight)
  params = jax.tree.map(lambda x: x.dequantize() if is_q(x) else x, loaded.params, is_leaf=is_q)
  return dataclasses.replace(loaded, params=params)


def test_every_matmul_weight_is_int8_and_the_logits_are_the_dequantized_models(diffusion, monkeypatch):
  q = for_decoding(diffusion, decode_dtype="int8")
  block = q.params["blocks"][0]
  for w in (block["attn"]["wqkv"], block["attn"]["wo"], block["mlp"]["w_in"], block["mlp"]["w_down"],
            q.params["embedding"]):
    assert isinstance(w, kernels.QuantizedWeight) and w.q.dtype == np.int8
  int8_bytes = sum(x.nbytes for x in jax.tree.leaves(q.params))
  float_bytes = sum(x.nbytes for x in jax.tree.leaves(diffusion.params))
  assert int8_bytes < 0.3 * float_bytes
  rng = np.random.default_rng()
  tokens = rng.integers(0, diffusion.spec.cfg.vocab_size, size=(2, 12)).astype(np.int32)
  t = np.full((2,), 0.4, np.float32) if diffusion.spec.cfg.time_conditioning else None
  got = jax.jit(lambda p: bind(q.spec, p)(tokens, t))(q.params)
  # the same arithmetic through XLA's path (rows rounded to int16 alike)
  with monkeypatch.context() as m:
    m.setattr(int8, "native_kernel_ready", lambda: False)
    want = jax.jit(lambda p: bind(q.spec, p)(tokens, t))(q.params)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  # the float32 model holding the dequantized weights, unrounded rows: 2^-16 of a
  # row's largest magnitude a product, compounded over the layers
  unrounded = jax.jit(lambda p: bind(q.spec, p)(tokens, t))(dequantized(q).params)
  np.testing.assert_allclose(np.asarray(got), np.asarray(unrounded), rtol=0, atol=1e-3 * np.abs(unrounded).max())
  # and near the float32 model: the weights moved by at most half a quantization step
  full = jax.jit(lambda p: bind(diffusion.spec, p)(tokens, t))(diffusion.params)
  assert np.corrcoef(np.asarray(got).ravel(), np.asarray(full).ravel())[0, 1] > 0.99


def test_the_generator_decodes_int8_as_the_dequantized_model(diffusion):
  sampler = adapt_to_model(sampler_for("medium"), diffusion.config.diffusion.block_size)
  q = for_decoding(diffusion, decode_dtype="int8")
  got = Generator(diffusion, decode_dtype="int8").generate(PROMPTS[:1], max_new_tokens=8, sampler=sampler)
  want = Generator(dequantized(q), weight_layout="out_in").generate(PROMPTS[:1], max_new_tokens=8, sampler=sampler)
  assert [c.tokens for c in got.completions] == [c.tokens for c in want.completions]


@pytest.mark.slow
def test_the_ar_generator_decodes_int8_as_the_dequantized_model():
  ar = checkpoints.load(packaged.path(packaged.AR))
  got = ARGenerator(ar, decode_dtype="int8").generate(PROMPTS, max_new_tokens=16)
  want = ARGenerator(dequantized(for_decoding(ar, decode_dtype="int8")), weight_layout="out_in").generate(
      PROMPTS, max_new_tokens=16)
  assert [c.tokens for c in got.completions] == [c.tokens for c in want.completions]


def test_bad_decode_dtypes_are_refused(diffusion):
  with pytest.raises(ValueError, match="unknown decode dtype 'int4'"):
    Generator(diffusion, decode_dtype="int4")
  with pytest.raises(ValueError, match="weight layout 'in_out' cannot hold them"):
    Generator(diffusion, weight_layout="in_out", decode_dtype="int8")
