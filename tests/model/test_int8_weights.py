"""int8 decoding weights in the model and the generators: every matmul weight
quantized once at load; the passes equal the same int8 model's through XLA's
float path (token rows rounded to int16 alike), and lie within that rounding's
reach of a float32 model holding the dequantized weights."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from mdlm_jax import checkpoints, kernels
from mdlm_jax.checkpoints import packaged
from mdlm_jax.kernels import int8
from mdlm_jax.model.spec import bind, for_decoding, model_spec
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
    assert isinstance(w, kernels.QuantizedWeight) and w.matrix().dtype == np.int8
  # a product's weight is held once, as the kernel's tiles; the table is gathered from too
  assert block["mlp"]["w_in"].q is None and block["mlp"]["w_in"].tiles is not None
  assert q.params["embedding"].q is not None
  int8_bytes = sum(x.nbytes for x in {id(x): x for x in jax.tree.leaves(q.params)}.values())  # stacks once
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
  # XLA sums in float32, the kernel exactly: the odd int16 rounding of a later
  # layer's rows flips (2^-16 of a row's largest magnitude each), hence 1e-3
  tol = 1e-3 * np.abs(np.asarray(want)).max()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol)
  # the float32 model holding the dequantized weights, unrounded rows: 2^-16 of a
  # row's largest magnitude a product, compounded over the layers
  unrounded = jax.jit(lambda p: bind(q.spec, p)(tokens, t))(dequantized(q).params)
  np.testing.assert_allclose(np.asarray(got), np.asarray(unrounded), rtol=0, atol=2 * tol)
  # and near the float32 model: the weights moved by at most half a quantization step
  full = jax.jit(lambda p: bind(diffusion.spec, p)(tokens, t))(diffusion.params)
  assert np.corrcoef(np.asarray(got).ravel(), np.asarray(full).ravel())[0, 1] > 0.99


def test_w8a8_rounds_token_rows_to_8_bits_in_groups_and_stays_near_the_float_model(diffusion, monkeypatch):
  q = for_decoding(diffusion, decode_dtype="w8a8")
  block = q.params["blocks"][0]
  multiplied = q.params["head"] if "head" in q.params else q.params["embedding"]
  for w in (block["attn"]["wqkv"], block["mlp"]["w_down"], multiplied):
    assert isinstance(w, kernels.QuantizedWeight) and w.activation_bits == 8
  # the same int8 weights as the int8 decode dtype, in the 8-bit kernel's tiles
  same = for_decoding(diffusion, decode_dtype="int8").params["blocks"][0]["mlp"]["w_down"]
  np.testing.assert_array_equal(np.asarray(block["mlp"]["w_down"].matrix()), np.asarray(same.matrix()))
  rng = np.random.default_rng()
  tokens = rng.integers(0, diffusion.spec.cfg.vocab_size, size=(2, 12)).astype(np.int32)
  t = np.full((2,), 0.4, np.float32) if diffusion.spec.cfg.time_conditioning else None
  logits = lambda model: np.asarray(jax.jit(lambda p: bind(model.spec, p)(tokens, t))(model.params))  # noqa: E731
  got = logits(q)
  with monkeypatch.context() as m:  # XLA's path over the same 8-bit groups
    m.setattr(int8, "native_kernel_ready", lambda: False)
    want = logits(q)
  # float32 sums against exact group sums: an odd 8-bit rounding of a later
  # layer's rows flips (1/254 of its group's largest magnitude)
  np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max())
  full = logits(diffusion)
  assert np.corrcoef(got.ravel(), full.ravel())[0, 1] > 0.99


@pytest.mark.slow  # 11 s; the AR generator's int8 test and the revising generator's w8a8 test run by default
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


def test_auto_picks_w8a8_on_one_cpu_with_the_kernels_vector_paths_and_float32_elsewhere(diffusion, monkeypatch):
  from mdlm_jax.model.spec import resolve_decode_dtype
  from mdlm_jax.parallel import sharding
  for explicit in ("float32", "int8", "w8a8"):
    assert resolve_decode_dtype(diffusion, explicit) == explicit
  with pytest.raises(ValueError, match="unknown decode dtype 'fp8'"):
    resolve_decode_dtype(diffusion, "fp8")
  monkeypatch.setattr(int8, "kernels_vectorized", lambda: True)
  assert resolve_decode_dtype(diffusion, "auto") == "w8a8"
  assert resolve_decode_dtype(diffusion, "auto", layout="out_in") == "w8a8"
  assert resolve_decode_dtype(diffusion, "auto", layout="in_out") == "float32"  # no int8 copy in that layout
  mesh = sharding.make_mesh({"data": 1, "fsdp": 4}, jax.devices()[:4])
  sharded = checkpoints.load(packaged.path(packaged.DIFFUSION), mesh=mesh)
  assert resolve_decode_dtype(sharded, "auto") == "float32"  # the int8 copy lives on one device
  monkeypatch.setattr(int8, "kernels_vectorized", lambda: False)
  assert resolve_decode_dtype(diffusion, "auto") == "float32"  # the kernels' portable loops are the slower
  # what the generators and the engine hold is the resolved one
  assert Generator(diffusion, decode_dtype="auto").decode_dtype == "float32"
  monkeypatch.setattr(int8, "kernels_vectorized", lambda: True)
  gen = Generator(diffusion, decode_dtype="auto")
  assert gen.decode_dtype == "w8a8" and isinstance(gen.loaded.params["embedding"], kernels.QuantizedWeight)


def block_pass_logits(spec, params, tokens):
  """The logits of one pass over a fresh cache that keeps the first half of
  `tokens` [1, 8] as a clean head and denoises the second as a block."""
  from mdlm_jax.model.kv_cache import KVCache
  cache = KVCache.init(spec.cfg, 1, 16)
  positions = jax.numpy.arange(8, dtype=jax.numpy.int32)[None]
  return np.asarray(jax.jit(lambda p: bind(spec, p).forward_cached(tokens, positions, cache, commit=True, new_block=4,
                                                                   commit_len=4)[0])(params))


def test_adapters_joined_into_int8_weights_act_on_the_noisy_rows_as_separate_ones(monkeypatch):
  """An adapted model's int8 copy carries its adapters inside the weights they
  adapt: a pass that keeps a clean head and denoises a block gives the logits
  of the same int8 weights with the adapters as separate products, and those
  of XLA's path."""
  from tests.conftest import adapted_from
  adapted = adapted_from(checkpoints.load(packaged.path(packaged.AR)), lora_rank=4, block_size=4)
  q = for_decoding(adapted, decode_dtype="int8")
  block = q.params["blocks"][0]
  wqkv, w_in = block["attn"]["wqkv"].one_layer(), block["mlp"]["w_in"].one_layer()
  assert wqkv.adapters.ends.shape == (3,) and w_in.adapters.ends.shape == (2,)
  # The copy holds no float adapters of its own; its layers have none.
  assert q.spec.cfg.adapters_joined and not any("lora_" in jax.tree_util.keystr(path)
                                                for path, _ in jax.tree_util.tree_flatten_with_path(q.params)[0])
  # The same int8 weights without the joined adapters, beside the adapters' own float params.
  floats = for_decoding(adapted, layout="out_in").params
  separate = model_spec(dataclasses.replace(q.spec.cfg, adapters_joined=False), None)
  apart = dict(q.params, blocks={i: {part: dict(jax.tree.map(
      lambda x: x.replace(adapters=None) if isinstance(x, kernels.QuantizedWeight) else x, blk[part],
      is_leaf=lambda x: isinstance(x, kernels.QuantizedWeight)),
      **{n: v for n, v in floats["blocks"][i][part].items() if n.startswith("lora_")})
      if isinstance(blk[part], dict) else blk[part] for part in blk} for i, blk in q.params["blocks"].items()})
  tokens = np.random.default_rng().integers(0, adapted.spec.cfg.vocab_size, size=(1, 8)).astype(np.int32)
  logits = functools.partial(block_pass_logits, q.spec, tokens=tokens)
  got = logits(q.params)
  # Float32 differences in the order of the sums flip the odd int16 rounding of
  # a later layer's rows (2^-16 of a row's largest magnitude each): hence 1e-3.
  tol = 1e-3 * np.abs(got).max()
  np.testing.assert_allclose(got, block_pass_logits(separate, apart, tokens), rtol=0, atol=tol)
  with monkeypatch.context() as m:
    m.setattr(int8, "native_kernel_ready", lambda: False)
    np.testing.assert_allclose(got, logits(q.params), rtol=0, atol=tol)
  # the adapters matter here: without them the block's logits move
  zeroed = jax.tree.map(lambda x: x.replace(adapters=x.adapters.replace(b=0 * x.adapters.b))
                        if isinstance(x, kernels.QuantizedWeight) and x.adapters is not None else x, q.params,
                        is_leaf=lambda x: isinstance(x, kernels.QuantizedWeight))
  assert np.abs(logits(zeroed) - got).max() > 20 * tol


def test_the_int8_copy_holds_each_kind_of_block_array_once_and_decodes_as_one_array_a_layer():
  """`with_int8_weights` stacks the blocks' arrays (`model.stacked`): a pass
  hands XLA a few dozen arrays instead of one per layer and kind, and its
  logits are those of the copy holding an array per layer."""
  from mdlm_jax.engine.slots import SlotConfig, compile_programs
  from mdlm_jax.model.spec import int8_quantizer
  from tests.conftest import adapted_from
  adapted = adapted_from(checkpoints.load(packaged.path(packaged.AR)), lora_rank=4, block_size=4)
  q = for_decoding(adapted, decode_dtype="w8a8")
  out_in = for_decoding(adapted, layout="out_in")
  apart = jax.jit(int8_quantizer(out_in.params, out_in.spec.cfg, 8))(out_in.params)
  per_layer = len(jax.tree.leaves(apart["blocks"][0]))
  distinct = {id(x) for x in jax.tree.leaves(q.params)}
  assert len(distinct) <= len(jax.tree.leaves(apart)) - (adapted.spec.cfg.num_layers - 1) * per_layer
  sc = SlotConfig(num_slots=1, block_size=4, max_prompt=16, max_new_tokens=16, mask_id=0, eos_id=1)
  assert len(compile_programs(q, sc).leaves) == len(distinct)
  tokens = np.random.default_rng().integers(0, adapted.spec.cfg.vocab_size, size=(1, 8)).astype(np.int32)
  logits = functools.partial(block_pass_logits, q.spec, tokens=tokens)
  want = logits(apart)
  np.testing.assert_allclose(logits(q.params), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_eval_scores_the_int8_copy_as_the_dequantized_model_scores():
  """`eval --decode_dtype`: the perplexity of the weights a decoder reads."""
  from mdlm_jax import data
  from mdlm_jax.diffusion import objectives
  from mdlm_jax.training import checkpoint_eval, evaluation
  path = packaged.path(packaged.AR)
  got = checkpoint_eval.evaluate_checkpoint(path, num_batches=2, batch_size=2, decode_dtype="int8")
  trained = checkpoint_eval.evaluate_checkpoint(path, num_batches=2, batch_size=2)
  assert (got["decode_dtype"], trained["decode_dtype"]) == ("int8", "float32")
  loaded = checkpoints.load(path)
  c = loaded.config
  reference = dequantized(for_decoding(loaded, decode_dtype="int8"))
  docs = data.load_documents(c.data.corpus, "validation", c.data.validation_fraction, c.data.text_field)
  batches = data.make_eval_batches(docs, loaded.tokenizer, seq_len=c.data.seq_len, batch_size=2, num_batches=2)
  want = evaluation.evaluate(reference.spec, objectives.from_config(c, loaded.tokenizer.mask_id), reference.params,
                             batches, seed=c.eval.seed)
  # the int8 products round token rows to 16 bits; the dequantized float32 model does not
  assert got["nats_per_token"] == pytest.approx(want["nats_per_token"], rel=1e-4)
  assert got["nats_per_token"] != trained["nats_per_token"]  # the int8 copy, not the trained weights, was scored
  assert got["nats_per_token"] == pytest.approx(trained["nats_per_token"], rel=1e-2)
