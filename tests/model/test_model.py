"""The transformer and its layers against float64 numpy re-implementations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mdlm_jax.model import layers
from mdlm_jax.model import ModelConfig, Transformer, count_params
from mdlm_jax.parallel.sharding import logical_to_spec

rope = jax.jit(layers.rope, static_argnames="theta")

BASE = dict(vocab_size=37, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64, cond_dim=16)
B, L = 2, 8


def random_params(pure, seed, modulation_scale=0.0):
  """float64-friendly random parameters for every leaf of a pure param dict (by path):
  embeddings N(0, 1), norm scales 1 + 0.3 N (so the references see them), adaLN
  modulation `modulation_scale` * N (0 = its zero init), matrices N(0, 1/fan_in)."""
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    keys = [getattr(k, "key", None) for k in path]
    name = keys[-1]
    if name == "embedding":
      return rng.normal(size=x.shape)
    if name == "scale":
      return 1.0 + 0.3 * rng.normal(size=x.shape)
    if "modulation" in keys or "final_modulation" in keys:
      return modulation_scale * rng.normal(size=x.shape)
    if name in ("b1", "b2"):
      return 0.1 * rng.normal(size=x.shape)
    fan_in = x.shape[0] * x.shape[1] if name == "wo" else x.shape[0]
    return rng.normal(size=x.shape) / math.sqrt(fan_in)

  return jax.tree_util.tree_map_with_path(leaf, pure)


def make(seed=0, **kw):
  """A model with numpy-drawn parameters. Built with nnx.eval_shape: eager random init
  costs one compile per parameter shape, which on a 2-core CPU dominates these tests."""
  cfg = ModelConfig(**{**BASE, **kw})
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
  set_params(model, random_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), seed))
  return model


def forward_fn(model):
  """A jitted forward of `model` (its current parameters): one compile per model."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def f(state, tokens, t):
    return nnx.merge(graphdef, state)(tokens, t)

  return lambda tokens, t=None: f(state, jnp.asarray(tokens), None if t is None else jnp.asarray(t))


def random_tokens(seed, b=B, l=L, v=BASE["vocab_size"]):
  return np.random.default_rng(seed).integers(0, v, size=(b, l)).astype(np.int32)


def params_np(model):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def set_params(model, pure):
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), pure))
  nnx.update(model, state)


# ------------------------------------------------------------- float64 numpy references


def np_rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_rope(x, pos, theta):
  """Rotate-half RoPE: pairs (i, i + d/2) rotate by pos * theta^(-2i/d)."""
  d = x.shape[-1]
  inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  ang = np.asarray(pos, np.float64)[..., None] * inv  # [b, l, d/2]
  c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def np_silu(x):
  return x / (1.0 + np.exp(-x))


def np_gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def np_attention_layer(p, x, pos, cfg):
  q = np.einsum("bld,dhk->blhk", x, p["wq"])
  k = np.einsum("bld,dhk->blhk", x, p["wk"])
  v = np.einsum("bld,dhk->blhk", x, p["wv"])
  q, k = np_rope(q, pos, cfg.rope_theta), np_rope(k, pos, cfg.rope_theta)
  sc = np.einsum("blhk,bshk->bhls", q, k) / math.sqrt(q.shape[-1])
  if cfg.causal:
    l = x.shape[1]
    sc = np.where(np.tril(np.ones((l, l), bool)), sc, -np.inf)
  o = np.einsum("bhls,bshk->blhk", np_softmax(sc), v)
  return np.einsum("blhk,hkd->bld", o, p["wo"])


def np_mlp(p, x, kind):
  if kind == "swiglu":
    h = np_silu(x @ p["w_gate"]) * (x @ p["w_up"])
  else:
    h = np_gelu_tanh(x @ p["w_up"])
  return h @ p["w_down"]


def np_forward(P, tokens, cfg, return_hidden=False):
  """Pre-norm transformer: x += attn(norm(x)); x += mlp(norm(x)); final norm; logits =
  h E^T / sqrt(d) when tied, h W_head otherwise. No time conditioning."""
  x = P["embedding"][tokens]
  pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  for i in range(cfg.num_layers):
    bp = P["blocks"][i]
    x = x + np_attention_layer(bp["attn"], np_rmsnorm(x, bp["attn_norm"]["scale"], cfg.norm_eps), pos, cfg)
    x = x + np_mlp(bp["mlp"], np_rmsnorm(x, bp["mlp_norm"]["scale"], cfg.norm_eps), cfg.mlp)
  h = np_rmsnorm(x, P["final_norm"]["scale"], cfg.norm_eps)
  if return_hidden:
    return h
  if cfg.tie_embeddings:
    return h @ P["embedding"].T * cfg.embed_dim ** -0.5
  return h @ P["head"]


# ------------------------------------------------------------- the whole forward pass


@pytest.mark.parametrize("kw", [
    dict(mlp="swiglu", causal=False, tie_embeddings=True),
    dict(mlp="gelu", causal=True, tie_embeddings=False, head_dim=6, rope_theta=500.0),
], ids=["swiglu_tied_bidirectional", "gelu_untied_causal_hd6"])
def test_forward_matches_numpy(kw):
  model = make(1, **kw)
  cfg = model.cfg
  P = params_np(model)
  tokens = random_tokens(3)
  got = np.asarray(forward_fn(model)(tokens), np.float64)
  assert got.shape == (B, L, cfg.vocab_size)
  ref = np_forward(P, tokens, cfg)
  assert np.abs(ref).max() > 0.5  # a non-trivial function
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())



@pytest.mark.parametrize("kw,rows", [
    (dict(mlp="swiglu", causal=False, tie_embeddings=True), (B, L)),
    (dict(mlp="gelu", causal=True, tie_embeddings=False, num_kv_heads=2, qkv_bias=True), (B, L)),
    (dict(mlp="swiglu", causal=True, tie_embeddings=False), (1, 1)),
    (dict(mlp="swiglu", causal=False, tie_embeddings=False), (9, 8)),
    (dict(mlp="swiglu", causal=False, tie_embeddings=False, num_kv_heads=2, lora_rank=3), (B, L)),
    (dict(mlp="gelu", causal=True, tie_embeddings=True, lora_rank=2), (1, 1)),
], ids=["tied_bidirectional", "untied_causal_gqa_bias", "one_row", "many_rows", "adapters_gqa", "adapters_gelu"])
def test_out_in_weight_layout_matches_numpy(kw, rows):
  """The decoding layout: the same trained weights, moved and joined, give the
  trained layout's logits, and the float64 reference's where it applies (no
  GQA or biases); one row and more than FEW_ROWS (64) rows take their own paths. Adapters are random,
  so every update is live."""
  from mdlm_jax.model import convert_weight_layout
  model = make(2, **kw)
  P = params_np(model)
  trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  moved = convert_weight_layout(trained, model.cfg, "out_in")
  out_in = make(0, **kw, weight_layout="out_in")
  assert jax.tree.map(np.shape, nnx.to_pure_dict(nnx.state(out_in, nnx.Param))) == jax.tree.map(np.shape, moved)
  set_params(out_in, moved)
  tokens = random_tokens(6, *rows)
  got = np.asarray(forward_fn(out_in)(tokens), np.float64)
  want = np.asarray(forward_fn(model)(tokens), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  if not model.cfg.qkv_bias and model.cfg.resolved_kv_heads == model.cfg.num_heads and not model.cfg.lora_rank:
    ref = np_forward(P, tokens, model.cfg)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
  back = convert_weight_layout(moved, out_in.cfg, "in_out")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float64), b), back, P)


def test_out_in_layout_joins_weights_and_keeps_logical_axes():
  """Each dim keeps its logical name, so the sharding rules still apply."""
  m = make(0, tie_embeddings=False, num_kv_heads=2, weight_layout="out_in")
  h, g, k, d = BASE["num_heads"], 2, BASE["embed_dim"] // BASE["num_heads"], BASE["embed_dim"]
  expect = {"wqkv": ((h + 2 * g, k, d), ("heads", "kv", "embed")), "wo": ((d, h, k), ("embed", "heads", "kv")),
            "w_in": ((2, BASE["mlp_dim"], d), (None, "mlp", "embed")), "w_down": ((d, BASE["mlp_dim"]), ("embed", "mlp")),
            "head": ((BASE["vocab_size"], d), ("vocab", "embed"))}
  for name, (shape, names) in expect.items():
    var = getattr(m.blocks[0].attn if name.startswith("wq") or name == "wo" else
                  m.blocks[0].mlp if name.startswith("w_") else m, name)
    assert var[...].shape == shape and var.get_metadata()["logical_axes"] == names, name
  with pytest.raises(ValueError, match="weight_layout"):
    ModelConfig(**BASE, weight_layout="col_major")

def test_bfloat16_compute_close_to_float32_reference():
  model = make(4, dtype="bfloat16")
  P = params_np(model)
  tokens = random_tokens(5)
  got = forward_fn(model)(tokens)
  assert got.dtype == jnp.float32 and got.shape == (B, L, BASE["vocab_size"])
  ref = np_forward(P, tokens, model.cfg)
  err = np.abs(np.asarray(got, np.float64) - ref).max()
  assert err < 0.05 * np.abs(ref).max(), err


# ------------------------------------------------------------- structure and masking


@pytest.mark.parametrize("causal", [True, False])
def test_causality(causal):
  model = make(6, causal=causal)
  f = forward_fn(model)
  a = random_tokens(7)
  k = 5
  b = a.copy()
  b[:, k:] = (a[:, k:] + 1 + random_tokens(8)[:, k:] % 30) % BASE["vocab_size"]
  assert np.all(a[:, k:] != b[:, k:])
  la, lb = np.asarray(f(a)), np.asarray(f(b))
  if causal:
    np.testing.assert_allclose(la[:, :k], lb[:, :k], rtol=0, atol=1e-6)
  else:
    assert np.abs(la[:, :k] - lb[:, :k]).max() > 1e-3
  assert np.abs(la[:, k:] - lb[:, k:]).max() > 1e-3


def test_position_shift_and_padding_mask():
  """RoPE makes a bidirectional model depend on relative positions only; a key mask that hides
  the tail makes the head of the sequence see exactly the truncated sequence."""
  model = make(20)
  graphdef, state = nnx.split(model)
  f = jax.jit(lambda st, tok, pos, mask: nnx.merge(graphdef, st)(tok, positions=pos, mask=mask))
  tokens = random_tokens(21)
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
  full = np.ones((B, 1, L, L), bool)
  base = np.asarray(f(state, tokens, pos, full))
  shifted = np.asarray(f(state, tokens, pos + np.array([[5], [23]], np.int32), full))
  np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4)
  k = 5
  pad = np.broadcast_to(np.arange(L) < k, (B, 1, L, L))
  masked = np.asarray(f(state, tokens, pos, pad))
  trunc = np.asarray(forward_fn(model)(tokens[:, :k]))
  np.testing.assert_allclose(masked[:, :k], trunc, rtol=1e-5, atol=1e-5)
  assert np.abs(masked[:, :k] - base[:, :k]).max() > 1e-3


def test_every_param_has_logical_axes():
  model = make(9, time_conditioning=True, tie_embeddings=False, mlp="swiglu")
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                               is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert len(leaves) > 10
  n = 0
  for path, var in leaves:
    names = var.get_metadata().get("logical_axes")
    assert names is not None, path
    assert len(names) == np.ndim(var[...]), (path, names, var[...].shape)
    logical_to_spec(names)  # every name has a sharding rule
    n += np.size(var[...])
  assert n == count_params(model)


def test_untied_head_shape_and_use():
  tied, untied = make(10), make(10, tie_embeddings=False)
  assert tied.head is None
  assert untied.head[...].shape == (BASE["embed_dim"], BASE["vocab_size"])
  assert count_params(untied) - count_params(tied) == BASE["embed_dim"] * BASE["vocab_size"]
  # The head is what produces the logits: moving one column moves one logit by h . delta.
  tokens = random_tokens(11)
  before = np.asarray(forward_fn(untied)(tokens), np.float64)
  P = params_np(untied)
  delta = np.random.default_rng(12).normal(size=BASE["embed_dim"])
  P["head"][:, 3] += delta
  set_params(untied, P)
  after = np.asarray(forward_fn(untied)(tokens), np.float64)
  expected = np.zeros_like(after)
  expected[..., 3] = np_forward(P, tokens, untied.cfg, return_hidden=True) @ delta
  np.testing.assert_allclose(after - before, expected, atol=1e-4)


def test_time_conditioning_requires_t():
  model = make(12, time_conditioning=True)
  with pytest.raises(ValueError):
    model(jnp.asarray(random_tokens(13)))


def _copy_shared(dst_model, src_model):
  dst, src = params_np(dst_model), params_np(src_model)

  def go(d, s):
    for k in d:
      d[k] = go(d[k], s[k]) if isinstance(d[k], dict) else s[k]
    return d

  set_params(dst_model, go(dst, src))


def test_time_conditioning_starts_as_unconditioned_model():
  """layers.Modulation: "zero-initialised so a time-conditioned model starts as the
  unconditioned one". With the same shared weights, the outputs must agree for any t."""
  cond = make(14, time_conditioning=True)  # modulation at its zero init
  assert all(np.all(x == 0) for x in jax.tree.leaves(params_np(cond)["final_modulation"]))
  plain = make(15)
  _copy_shared(plain, cond)
  tokens = random_tokens(16)
  f_cond = forward_fn(cond)
  ref = np.asarray(forward_fn(plain)(tokens))
  out1 = np.asarray(f_cond(tokens, np.array([0.1, 0.9], np.float32)))
  out2 = np.asarray(f_cond(tokens, np.array([0.6, 0.3], np.float32)))
  np.testing.assert_allclose(out1, out2, atol=1e-6)  # t has no effect at init
  np.testing.assert_allclose(
      out1, ref, rtol=1e-5, atol=1e-5,
      err_msg="time-conditioned model at zero-initialised modulation differs from the unconditioned "
              "model with the same weights (Block gates g1/g2 are zero, so every block is skipped)")


def test_time_conditioning_uses_t_after_perturbation():
  model = make(17, time_conditioning=True)
  set_params(model, random_params(params_np(model), 18, modulation_scale=0.1))
  f = forward_fn(model)
  tokens = random_tokens(19)
  a = np.asarray(f(tokens, np.array([0.2, 0.2], np.float32)))
  b = np.asarray(f(tokens, np.array([0.7, 0.2], np.float32)))
  assert np.abs(a[0] - b[0]).max() > 1e-3
  np.testing.assert_allclose(a[1], b[1], atol=1e-5)  # rows are independent


# ------------------------------------------------------------- layers


def test_rope_matches_numpy():
  rng = np.random.default_rng(20)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
  pos = rng.integers(0, 50, size=(2, 5)).astype(np.int32)
  got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 100.0), np.float64)
  np.testing.assert_allclose(got, np_rope(x.astype(np.float64), pos, 100.0), rtol=1e-5, atol=1e-5)
  # Rotations: norms kept; position 0 is the identity.
  np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  zero = np.asarray(rope(jnp.asarray(x), jnp.zeros((2, 5), jnp.int32), 100.0))
  np.testing.assert_allclose(zero, x, atol=1e-7)
  assert rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(pos), 100.0).dtype == jnp.bfloat16


def test_rope_relative_position():
  rng = np.random.default_rng(21)
  q = jnp.asarray(rng.normal(size=(1, 4, 2, 16)).astype(np.float32))
  k = jnp.asarray(rng.normal(size=(1, 4, 2, 16)).astype(np.float32))
  pq = np.array([[0, 3, 7, 11]], np.int32)
  pk = np.array([[2, 2, 9, 5]], np.int32)
  dots = []
  for shift in (0, 13, 41):
    rq = rope(q, jnp.asarray(pq + shift), 10000.0)
    rk = rope(k, jnp.asarray(pk + shift), 10000.0)
    dots.append(np.asarray(jnp.sum(rq * rk, -1)))
  np.testing.assert_allclose(dots[1], dots[0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dots[2], dots[0], rtol=1e-4, atol=1e-4)
  # ... and it does depend on the offset between the two.
  rq = rope(q, jnp.asarray(pq + 1), 10000.0)
  rk = rope(k, jnp.asarray(pk), 10000.0)
  assert np.abs(np.asarray(jnp.sum(rq * rk, -1)) - dots[0]).max() > 1e-2


def test_rmsnorm_matches_numpy():
  rng = np.random.default_rng(22)
  norm = layers.RMSNorm(16, 1e-5, rngs=nnx.Rngs(0))
  scale = rng.normal(size=16).astype(np.float32)
  norm.scale[...] = jnp.asarray(scale)
  x = (rng.normal(size=(3, 5, 16)) * rng.uniform(0.01, 10, size=(3, 5, 1))).astype(np.float32)
  norm_jit = nnx.jit(lambda m, x: m(x))
  got = np.asarray(norm_jit(norm, jnp.asarray(x)), np.float64)
  np.testing.assert_allclose(got, np_rmsnorm(x.astype(np.float64), scale.astype(np.float64), 1e-5),
                             rtol=1e-5, atol=1e-6)
  out16 = norm_jit(norm, jnp.asarray(x, jnp.bfloat16))
  assert out16.dtype == jnp.bfloat16


def test_modulation_is_zero_initialised():
  mod = layers.Modulation(8, 16, 6, rngs=nnx.Rngs(0))
  outs = mod(jnp.asarray(np.random.default_rng(24).normal(size=(3, 8)), jnp.float32))
  assert len(outs) == 6 and outs[0].shape == (3, 1, 16)
  assert all(np.all(np.asarray(o) == 0) for o in outs)


def test_init_params_of_some_names_equals_those_of_the_whole_initialisation():
  """A run from an imported base initialises only its adapters: the same
  values as the whole model's initialisation, by name, and nothing else."""
  from mdlm_jax.model.spec import init_params, model_spec
  cfg = ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64, causal=False,
                    time_conditioning=False, lora_rank=4, lora_alpha=8.0)
  spec = model_spec(cfg, None)
  seed = int(np.random.default_rng().integers(1 << 30))
  whole = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(init_params(spec, seed))[0]}
  adapters = frozenset(n for n in whole if "lora" in n)
  assert adapters and len(adapters) < len(whole)
  some = init_params(spec, seed, only=adapters)
  assert set(some) == adapters
  for name in adapters:
    np.testing.assert_array_equal(np.asarray(some[name]), np.asarray(whole[name]), err_msg=name)
  with pytest.raises(ValueError, match="no parameters"):
    init_params(spec, seed, only=frozenset({"['nothing']"}))


def test_a_rows_mean_square_is_the_same_bits_among_any_number_of_rows():
  """RMSNorm's statistic for one row alone and among 2 to 200 rows: equal bits
  (XLA's plain mean over [1, 576] and [8, 576] rounds apart), and within float32
  rounding of float64 numpy."""
  from mdlm_jax.model.layers import row_mean_square
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  x = jnp.asarray(rng.normal(size=(1, 200, 576)) * rng.uniform(0.1, 10), jnp.float32)
  f = jax.jit(row_mean_square)
  alone = np.concatenate([np.asarray(f(x[:, i:i + 1])) for i in range(200)], axis=1)
  for m in (2, 3, 8, 12, 16, 40, 200):
    np.testing.assert_array_equal(np.asarray(f(x[:, :m])), alone[:, :m], err_msg=f"{m} rows")
  want = np.mean(np.asarray(x, np.float64) ** 2, axis=-1, keepdims=True)
  np.testing.assert_allclose(alone, want, rtol=1e-6)


def test_init_params_draws_the_keys_nnx_rngs_would():
  """`ParamKeys` counts in Python what nnx.Rngs counts in a variable (whose updates are slow to
  trace): the same seed gives the same initial weights, bit for bit, adapters included."""
  from mdlm_jax.model.spec import init_params, model_spec
  seed = int(np.random.default_rng().integers(1 << 30))
  cfg = ModelConfig(**{**BASE, "lora_rank": 4, "num_kv_heads": 2})
  want = jax.jit(lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))))()
  got = init_params(model_spec(cfg, None), seed)
  by_key = init_params(model_spec(cfg, None), jax.random.key(seed))  # a key, as nnx.Rngs takes too
  jax.tree.map(np.testing.assert_array_equal, by_key, got)
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(got)[0]}
  leaves = jax.tree_util.tree_flatten_with_path(want)[0]
  assert len(leaves) == len(flat) and any(np.asarray(v).std() > 0 for _, v in leaves)
  for k, v in leaves:
    name = jax.tree_util.keystr(k)
    np.testing.assert_array_equal(np.asarray(flat[name]), np.asarray(v), err_msg=name)
