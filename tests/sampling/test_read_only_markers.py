"""Tokens a model reads but never writes ([MASK], BOS, PAD, UNK and the chat
and FIM openers) stay out of every generation path, even where the model
puts almost all its probability on them."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.data.tokenizer import CHAT_AND_FIM_PIECES, never_generated, train_tokenizer
from mdlm_jax.engine.engine import Engine, Request
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.generate import ARGenerator, Generator
from mdlm_jax.sampling.samplers import ThresholdSampler


def test_never_generated_names_the_openers_and_keeps_the_enders(tmp_path):
  docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
  tok = train_tokenizer(docs, str(tmp_path / "c.model"), vocab_size=400, user_pieces=CHAT_AND_FIM_PIECES)
  never = set(never_generated(tok))
  ids = {p: tok.piece_id(p) for p in CHAT_AND_FIM_PIECES}
  read_only = {"<|im_start|>", "<tool_response>", "</tool_response>", "<|fim_prefix|>", "<|fim_suffix|>",
               "<|fim_middle|>"}
  assert never == {tok.mask_id, tok.bos_id, tok.pad_id, tok.unk_id} | {ids[p] for p in read_only}
  assert tok.eos_id not in never and not never & {ids[p] for p in set(ids) - read_only}


def test_propose_never_picks_an_excluded_id():
  rng = np.random.default_rng()
  logits = rng.normal(size=(3, 7, 50))
  never = tuple(sorted(rng.choice(50, size=4, replace=False).tolist()))
  logits[..., list(never)] += 20.0  # the excluded ids are the favourites
  keys = rule.row_keys(jnp.arange(3))
  for temperature in (0.0, 1.0):
    x0, conf = rule.propose(jnp.asarray(logits, jnp.float32), keys, jnp.arange(7), never, temperature)
    assert not np.isin(np.asarray(x0), never).any()
    allowed = np.delete(logits, never, axis=-1)
    if temperature == 0:
      want = np.delete(np.arange(50), never)[allowed.argmax(-1)]
      np.testing.assert_array_equal(np.asarray(x0), want)
    p = np.exp(allowed - allowed.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    picked = np.take_along_axis(logits, np.asarray(x0)[..., None], -1)[..., 0]
    z = np.log(np.exp(allowed - allowed.max(-1, keepdims=True)).sum(-1)) + allowed.max(-1)
    np.testing.assert_allclose(np.asarray(conf), np.exp(picked - z), rtol=1e-5)


def _rigged(loaded, favourite: int, runner_up: int):
  """The model with two vocabulary rows of the head set to +-c * v: at every
  position one of the two scores about c |h . v|, far above every other token."""
  params = dict(loaded.params)
  v = np.random.default_rng(0).normal(size=loaded.spec.cfg.embed_dim) * 100.0
  key = "embedding" if params.get("head") is None else "head"
  w = np.array(params[key])
  rows = w if key == "embedding" or loaded.spec.cfg.weight_layout == "out_in" else w.T
  rows[favourite], rows[runner_up] = v, -v
  params[key] = jnp.asarray(w)
  return dataclasses.replace(loaded, params=params)


@pytest.fixture(scope="module")
def rigged(tiny_checkpoints):
  out = {}
  for kind in ("mdlm", "ar"):
    loaded = checkpoints.load(tiny_checkpoints[kind])
    out[kind] = _rigged(loaded, loaded.tokenizer.unk_id, loaded.tokenizer.pad_id)
  return out


def test_the_rigged_model_wants_the_read_only_ids(rigged):
  """What makes the tests below able to fail: the rig's two ids win everywhere."""
  loaded = rigged["mdlm"]
  tok = loaded.tokenizer
  tokens = jnp.asarray([[tok.bos_id] + tok.encode("x = 1\n") + [tok.mask_id] * 8])
  logits = loaded.model(tokens, jnp.full((1,), 0.5)) if loaded.spec.cfg.time_conditioning else loaded.model(tokens)
  assert set(np.asarray(jnp.argmax(logits, -1)).ravel().tolist()) <= {tok.unk_id, tok.pad_id}


@pytest.mark.slow  # every decoding path compiles (about 15 s)
def test_no_path_writes_a_read_only_id(rigged):
  loaded = rigged["mdlm"]
  tok = loaded.tokenizer
  rig = {tok.unk_id, tok.pad_id}
  sampler = ThresholdSampler(block_size=8, kv_cache=True, threshold=0.5, min_tokens=2)
  gen = Generator(loaded)
  one_shot = gen.generate(["x = "], max_new_tokens=16, sampler=sampler, seed=0).completions[0]
  e = Engine(loaded, num_slots=2, max_prompt=32, max_new_tokens=16, block_size=8).start()
  try:
    served = e.submit(Request(gen.encode_prompt("x = "), 16, sampler, seed=0)).result(timeout=120)
  finally:
    e.close(deadline_s=1)
  assert len(one_shot.tokens) and not rig & set(one_shot.tokens)
  assert served.text == one_shot.text and served.completion_tokens == len(one_shot.tokens)
  ar = rigged["ar"]
  twin = ARGenerator(ar).generate(["x = "], max_new_tokens=8, temperature=1.0, seed=1).completions[0]
  assert len(twin.tokens) and not {ar.tokenizer.unk_id, ar.tokenizer.pad_id} & set(twin.tokens)
