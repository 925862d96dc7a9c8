"""RoPE scaling: frequencies against float64 formulas written from the
papers' and transformers' definitions, the rotation itself, Hugging Face
config parsing and the export round trip."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mdlm_jax import config as config_lib
from mdlm_jax.checkpoints.interop import hf_rope_scaling
from mdlm_jax.model import ModelConfig, Transformer
from mdlm_jax.model.rope import RopeScaling, rope, rotation

THETA, DIM = 10000.0, 64


def base_inv(dim=DIM, theta=THETA):
  return 1.0 / theta ** (np.arange(0, dim, 2) / dim)


def np_rotate(x, pos, inv, scale=1.0):
  """Rotate-half RoPE in float64 with the given inverse frequencies."""
  ang = pos[..., None].astype(np.float64) * inv
  sin, cos = np.sin(ang)[:, :, None] * scale, np.cos(ang)[:, :, None] * scale
  x1, x2 = np.split(x, 2, axis=-1)
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def yarn_inv(factor, trained, beta_fast=32.0, beta_slow=1.0, dim=DIM, theta=THETA):
  """YaRN (Peng et al. 2023): dims turning more than beta_fast times in the
  trained context keep their frequency, fewer than beta_slow times are
  interpolated by `factor`, linear in between (bounds floored/ceiled)."""
  def dim_of(turns):
    return dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(theta))
  lo, hi = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), dim - 1)
  inv = base_inv(dim, theta)
  out = np.empty_like(inv)
  for i in range(dim // 2):
    t = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
    out[i] = inv[i] * (1 - t) + inv[i] / factor * t
  return out


def test_linear_is_position_interpolation():
  """Linear scaling by f at positions f*p is plain RoPE at p."""
  rng = np.random.default_rng()
  x = jnp.asarray(rng.normal(size=(2, 7, 3, DIM)), jnp.float32)
  pos = rng.integers(0, 500, size=(2, 7))
  plain = np.asarray(rope(x, jnp.asarray(pos), THETA))
  scaled = np.asarray(rope(x, jnp.asarray(4 * pos), THETA, RopeScaling(type="linear", factor=4.0)))
  np.testing.assert_allclose(scaled, plain, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("factor,trained", [(4.0, 2048), (8.0, 512), (2.5, 4096)])
def test_yarn_frequencies_and_attention_factor(factor, trained):
  s = RopeScaling(type="yarn", factor=factor, max_position=trained)
  inv, scale = s.frequencies(DIM, THETA)
  np.testing.assert_allclose(inv, yarn_inv(factor, trained), rtol=1e-6)
  assert scale == pytest.approx(0.1 * math.log(factor) + 1.0)
  assert inv[0] == pytest.approx(base_inv()[0], rel=1e-6)  # the fastest dim turns many times: kept
  assert inv[-1] == pytest.approx(base_inv()[-1] / factor, rel=1e-6)  # the slowest: interpolated
  assert RopeScaling(type="yarn", factor=factor, max_position=trained, attention_factor=0.7).frequencies(
      DIM, THETA)[1] == 0.7
  ratio = (0.1 * 1.0 * math.log(factor) + 1) / (0.1 * 0.5 * math.log(factor) + 1)  # DeepSeek's mscale pair
  assert RopeScaling(type="yarn", factor=factor, max_position=trained, mscale=1.0, mscale_all_dim=0.5).frequencies(
      DIM, THETA)[1] == pytest.approx(ratio)


def test_llama3_bands():
  """Llama 3.1: wavelengths under trained/high_freq_factor keep their
  frequency, over trained/low_freq_factor are divided by factor, smoothed between."""
  s = RopeScaling(type="llama3", factor=8.0, max_position=8192, low_freq_factor=1.0, high_freq_factor=4.0)
  inv, scale = s.frequencies(128, 500000.0)
  ref = base_inv(128, 500000.0)
  wavelen = 2 * math.pi / ref
  for i, w in enumerate(wavelen):
    if w < 8192 / 4:
      want = ref[i]
    elif w > 8192 / 1:
      want = ref[i] / 8
    else:
      smooth = (8192 / w - 1) / (4 - 1)
      want = (1 - smooth) * ref[i] / 8 + smooth * ref[i]
    assert inv[i] == pytest.approx(want, rel=1e-6), i
  assert scale == 1.0 and (wavelen < 2048).any() and (wavelen > 8192).any() and (
      (wavelen > 2048) & (wavelen < 8192)).any()  # all three bands occur


def test_dynamic_is_plain_within_the_context_and_raises_the_base_past_it():
  rng = np.random.default_rng()
  s = RopeScaling(type="dynamic", factor=2.0, max_position=256)
  x = rng.normal(size=(1, 5, 2, DIM))
  short = rng.integers(0, 256, size=(1, 5))
  got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(short), THETA, s))
  np.testing.assert_allclose(got, np_rotate(x, short, base_inv()), rtol=1e-4, atol=1e-4)
  long = np.asarray([[0, 10, 300, 999, 5]])  # length 1000: base * (2 * 1000 / 256 - 1) ** (d / (d - 2))
  base = THETA * (2.0 * 1000 / 256 - 1.0) ** (DIM / (DIM - 2))
  got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(long), THETA, s))
  np.testing.assert_allclose(got, np_rotate(x, long, base_inv(DIM, base)), rtol=1e-3, atol=1e-3)


def test_rotation_applies_the_frequencies_and_attention_factor():
  rng = np.random.default_rng()
  s = RopeScaling(type="yarn", factor=4.0, max_position=1024)
  x = rng.normal(size=(2, 6, 2, DIM))
  pos = rng.integers(0, 4096, size=(2, 6))
  got = np.asarray(jax.jit(lambda x, p: rope(x, p, THETA, s))(jnp.asarray(x, jnp.float32), jnp.asarray(pos)))
  np.testing.assert_allclose(got, np_rotate(x, pos, yarn_inv(4.0, 1024), 0.1 * math.log(4.0) + 1), rtol=2e-3,
                             atol=2e-3)


def test_a_rotation_made_once_turns_heads_as_positions_do():
  rng = np.random.default_rng()
  s = RopeScaling(type="yarn", factor=4.0, max_position=1024)
  x = jnp.asarray(rng.normal(size=(2, 6, 3, DIM)), jnp.float32)
  pos = jnp.asarray(rng.integers(0, 4096, size=(2, 6)))
  rot = rotation(pos, DIM, THETA, s)
  np.testing.assert_allclose(np.asarray(rope(x, rot, THETA, s)), np_rotate(np.asarray(x, np.float64), np.asarray(pos),
                             yarn_inv(4.0, 1024), 0.1 * math.log(4.0) + 1), rtol=2e-3, atol=2e-3)
  with pytest.raises(ValueError, match="heads of 32"):
    rope(x[..., :32], rot, THETA, s)


def test_a_forward_pass_computes_its_sines_once_for_every_layer():
  # XLA fuses an elementwise producer into each consumer: without the
  # rotation's barrier every layer's q and k rotation holds sines of its own.
  cfg = ModelConfig(vocab_size=37, num_layers=3, embed_dim=32, num_heads=4, mlp_dim=64, causal=True)
  graph, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  hlo = jax.jit(lambda st, t: nnx.merge(graph, st)(t)).lower(state, jnp.zeros((1, 8), jnp.int32)).compile().as_text()
  assert hlo.count(" sine(") == 1 and hlo.count(" cosine(") == 1


def test_hugging_face_configs():
  qwen = {"max_position_embeddings": 131072,
          "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
  s = RopeScaling.from_hf(qwen)
  assert (s.type, s.factor, s.max_position) == ("yarn", 4.0, 32768)
  # transformers takes the ratio of the two lengths over `factor` when both are given
  assert RopeScaling.from_hf({**qwen, "max_position_embeddings": 65536}).factor == 2.0
  llama = {"max_position_embeddings": 131072, "rope_scaling": {
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}}
  assert RopeScaling.from_hf(llama) == RopeScaling(type="llama3", factor=8.0, max_position=8192)
  assert RopeScaling.from_hf({"max_position_embeddings": 4096,
                              "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}).max_position == 4096
  assert RopeScaling.from_hf({"rope_scaling": None}) == RopeScaling()
  with pytest.raises(ValueError, match="longrope"):
    RopeScaling.from_hf({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


@pytest.mark.parametrize("s", [RopeScaling(type="linear", factor=2.0),
                               RopeScaling(type="dynamic", factor=3.0, max_position=512),
                               RopeScaling(type="yarn", factor=5.0, max_position=1024, beta_fast=16.0),
                               RopeScaling(type="llama3", factor=8.0, max_position=2048, high_freq_factor=2.0)])
def test_exported_rope_scaling_reads_back_to_the_same_frequencies(s):
  hf = {"rope_scaling": hf_rope_scaling(s),
        "max_position_embeddings": s.max_position if s.type in ("dynamic", "yarn") else 99999}
  back = RopeScaling.from_hf(hf)
  assert back.type == s.type and back.factor == s.factor
  if s.type != "dynamic":
    np.testing.assert_array_equal(back.frequencies(DIM, THETA)[0], s.frequencies(DIM, THETA)[0])
    assert back.frequencies(DIM, THETA)[1] == s.frequencies(DIM, THETA)[1]
  else:
    assert back.max_position == s.max_position


def test_config_validation_names_the_field():
  c = config_lib.base_config()
  c.model.rope_scaling.type = "yarn"
  with pytest.raises(config_lib.ConfigError, match="model.rope_scaling.*max_position"):
    config_lib.validate(c)
  c.model.rope_scaling.type = "sideways"
  with pytest.raises(config_lib.ConfigError, match="model.rope_scaling.*type"):
    config_lib.validate(c)
  c.model.rope_scaling.update(dataclasses.asdict(RopeScaling(type="linear", factor=4.0)))
  config_lib.validate(c)
