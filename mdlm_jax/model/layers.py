"""Transformer building blocks with logical axis names on every parameter."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax import kernels
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model.precision import PARAM_DTYPE, STATS_DTYPE
from mdlm_jax.model.rope import RopeScaling, Rotation, rope
from mdlm_jax.parallel.sharding import constrain


class ParamKeys:
  """The keys `nnx.Rngs(seed).params()` hands out, in the same order (the seed's
  key folded with a count), counted in Python rather than in an nnx variable.
  Under a trace, each update of that variable had flax ask the traced count for
  its sharding, and JAX build (then drop) an error message whose cost grows with
  the trace: constructing SmolLM2's 30 layers abstractly took about 6 s (0.7 s
  now), and a `sample` start builds five."""

  def __init__(self, seed: int | jax.Array):  # a seed or a key, as nnx.Rngs takes
    is_key = isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
    self._key, self._count = seed if is_key else jax.random.key(seed), 0

  def params(self) -> jax.Array:
    key = jax.random.fold_in(self._key, self._count)
    self._count += 1
    return key


Keys = nnx.Rngs | ParamKeys  # what a module's constructor draws its parameters' keys from


def param(rngs: Keys, init, shape: Sequence[int], names: Sequence[str | None]) -> nnx.Param:
  """A float32 parameter tagged with the logical names of its axes."""
  if len(shape) != len(names):
    raise ValueError(f"shape {shape} and logical axes {names} differ in rank")
  return nnx.Param(init(rngs.params(), tuple(shape), PARAM_DTYPE), logical_axes=tuple(names))


WEIGHT_LAYOUTS = ("in_out", "out_in")
FEW_ROWS = kernels.FEW_ROWS


def dense(x2d, w2d, dtype, out_in: bool = False, noisy=None):
  """A matmul on [tokens, features]. Activations are flattened to 2-D before
  every weight matmul: XLA:CPU runs the backward of a [b, l, d] x [d, m]
  contraction at half the speed of the same product on [b * l, d].
  With `out_in` the weight is stored [out, in] (`kernels.out_in_matmul`);
  an int8 decoding weight (`kernels.QuantizedWeight`) is always [out, in],
  and applies the adapters it carries to the `noisy` rows (`_lora_delta`'s
  meaning) in the same product."""
  if isinstance(w2d, kernels.QuantizedWeight):
    return kernels.int8_matmul(x2d, w2d, noisy).astype(dtype)
  x2d, w2d = x2d.astype(dtype), w2d.astype(dtype)
  return kernels.out_in_matmul(x2d, w2d) if out_in else x2d @ w2d


class Narrow:
  """A pass whose last columns are padding (a revising head with few drafts):
  its products run over each row's first w columns only, w the narrowest of
  `widths` (the last the pass's width) that holds `need` (a traced count).
  One switch a product, whose branches only read their operands: the cache,
  written outside them, is never copied. The padding columns' products are
  zeros."""

  def __init__(self, widths: Sequence[int], need):
    self.widths = tuple(widths)
    self.index = jnp.minimum(jnp.sum(jnp.asarray(self.widths, jnp.int32) < need), len(self.widths) - 1)

  def by_width(self, branch, *operands):
    """branch(w)(*operands) for the chosen width w: `branch(w)` is traced for every width."""
    return jax.lax.switch(self.index, [branch(w) for w in self.widths], *operands)

  def columns(self, fn, x):
    """fn(x) for x [b, l, ...] (l the widest width), run on x[:, :w] and zero-padded back to l."""
    l = x.shape[1]
    if l != self.widths[-1]:
      raise ValueError(f"a narrowed pass is {self.widths[-1]} columns wide; got {l}")

    def over(w):
      def run(x):
        y = fn(x[:, :w])
        return jnp.pad(y, ((0, 0), (0, l - w)) + ((0, 0),) * (y.ndim - 2))
      return run
    return self.by_width(over, x)

  def rows(self, fn, x2d):
    """fn(x2d) for x2d [b * l, k], the rows of a [b, l] pass, run as `columns` does."""
    l = self.widths[-1]
    out = self.columns(lambda x: fn(x.reshape(-1, x2d.shape[-1])).reshape(x.shape[0], x.shape[1], -1),
                       x2d.reshape(-1, l, x2d.shape[-1]))
    return out.reshape(x2d.shape[0], -1)


def _narrowed(narrow: "Narrow | None", fn, x2d):
  return fn(x2d) if narrow is None else narrow.rows(fn, x2d)


def _add_bias(y, b):
  return y if b is None else y + b[...].reshape(-1).astype(y.dtype)


def fan_in_init(fan_in: int):
  return nnx.initializers.truncated_normal(stddev=1.0 / math.sqrt(fan_in))


class LoRA(nnx.Module):
  """A low-rank update x @ a @ b * scale of one linear layer (b starts at zero,
  so an adapted model starts as its base), applied to the `noisy` rows only."""

  def __init__(self, fan_in: int, fan_out: int, rank: int, scale: float, *, rngs: Keys,
               axes: tuple[str | None, str | None] = ("embed", None)):
    self.scale = scale
    self.a = param(rngs, fan_in_init(fan_in), (fan_in, rank), (axes[0], None))
    self.b = param(rngs, nnx.initializers.zeros, (rank, fan_out), (None, axes[1]))

  def __call__(self, x2d, dtype, noisy2d=None):
    y = (x2d.astype(dtype) @ self.a[...].astype(dtype)) @ (self.b[...] * self.scale).astype(dtype)
    return y if noisy2d is None else y * noisy2d.astype(dtype)


def carries_adapters(w) -> bool:
  """Whether weight `w` applies its adapters in its own product (an int8
  decoding weight with `kernels.join_adapters` joined in)."""
  return isinstance(w, kernels.QuantizedWeight) and w.adapters is not None


def _lora_delta(lora: "LoRA | None", x2d, dtype, noisy, w=None):
  """The adapter's update of `x2d`'s rows: on all (noisy None), none (noisy False, a
  clean-only pass skips the products) or the rows where `noisy` [b, l] is True;
  nothing where weight `w` carries the adapters itself."""
  if lora is None or noisy is False or carries_adapters(w):
    return 0.0
  return lora(x2d, dtype, None if noisy is None else noisy.reshape(-1, 1))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, *, rngs: Keys, axis: str = "embed"):
    self.eps = eps
    self.scale = param(rngs, nnx.initializers.ones, (dim,), (axis,))

  def __call__(self, x):
    xf = x.astype(STATS_DTYPE)
    y = xf * jax.lax.rsqrt(row_mean_square(xf) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def row_mean_square(x: Float[Array, "... d"]) -> Float[Array, "... 1"]:
  """mean(x * x) over the last axis, the same bits for a row however many rows
  come with it. XLA:CPU sums a [1, d] row in another order than the rows of an
  [8, d] array (a few ulps apart, measured), and int8 decoding's rounding of
  token rows turns such ulps into different tokens: the one-row AR step and an
  eight-row revising pass then disagree where they must not. So on XLA:CPU
  the sum is a fixed tree of elementwise adds (halves added lane by lane),
  whose order no shape can change. It is no reduction either: XLA:CPU hands
  reductions to YNNPACK, whose call cost a decoding step about 40 us a norm
  (61 a SmolLM2 pass) for a few hundred flops. Elsewhere (training on a
  sharded sequence) the plain mean keeps the activations' layout."""
  if jax.default_backend() != "cpu":
    return jnp.mean(x * x, axis=-1, keepdims=True)
  d = x.shape[-1]
  s = x * x
  while s.shape[-1] > 1:
    half = s.shape[-1] // 2
    s = jnp.concatenate([s[..., :half] + s[..., half:2 * half], s[..., 2 * half:]], axis=-1)
  return s / d


class Attention(nnx.Module):
  """Self-attention with RoPE; `num_kv_heads` < `num_heads` is grouped-query
  attention (query heads [j * r, (j + 1) * r) share kv head j, as in Llama)."""

  def __init__(self, embed_dim: int, num_heads: int, head_dim: int, *, rope_theta: float,
               attention_impl: str, dtype, rngs: Keys, num_kv_heads: int | None = None,
               rope_scaling: RopeScaling = RopeScaling(),
               qkv_bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6, out_in: bool = False,
               lora: tuple[int, float] | None = None):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta, self.attention_impl, self.dtype, self.out_in = rope_theta, attention_impl, dtype, out_in
    self.rope_scaling = rope_scaling
    init = fan_in_init(embed_dim)
    if out_in:  # the decoding layout: q, k and v heads in one [out, in] weight, one product
      self.wqkv = param(rngs, init, (num_heads + 2 * num_kv_heads, head_dim, embed_dim), ("heads", "kv", "embed"))
      self.wo = param(rngs, fan_in_init(num_heads * head_dim), (embed_dim, num_heads, head_dim),
                      ("embed", "heads", "kv"))
    else:
      self.wq = param(rngs, init, (embed_dim, num_heads, head_dim), ("embed", "heads", "kv"))
      self.wk = param(rngs, init, (embed_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "kv"))
      self.wv = param(rngs, init, (embed_dim, num_kv_heads, head_dim), ("embed", "kv_heads", "kv"))
      self.wo = param(rngs, fan_in_init(num_heads * head_dim), (num_heads, head_dim, embed_dim),
                      ("heads", "kv", "embed"))
    if qkv_bias:
      zeros = nnx.initializers.zeros
      self.bq = param(rngs, zeros, (num_heads, head_dim), ("heads", "kv"))
      self.bk = param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "kv"))
      self.bv = param(rngs, zeros, (num_kv_heads, head_dim), ("kv_heads", "kv"))
    else:
      self.bq = self.bk = self.bv = None
    if lora is not None:  # (rank, scale): adapters on q, k, v and the output
      r, sc = lora
      self.lora_q = LoRA(embed_dim, num_heads * head_dim, r, sc, rngs=rngs)
      self.lora_k = LoRA(embed_dim, num_kv_heads * head_dim, r, sc, rngs=rngs)
      self.lora_v = LoRA(embed_dim, num_kv_heads * head_dim, r, sc, rngs=rngs)
      self.lora_o = LoRA(num_heads * head_dim, embed_dim, r, sc, rngs=rngs, axes=(None, "embed"))
    else:
      self.lora_q = self.lora_k = self.lora_v = self.lora_o = None
    if qk_norm:  # per head, over head_dim (Qwen3)
      self.q_norm = RMSNorm(head_dim, norm_eps, rngs=rngs, axis="kv")
      self.k_norm = RMSNorm(head_dim, norm_eps, rngs=rngs, axis="kv")
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, *, causal: bool, mask=None, noisy=None):
    return self.forward(x, positions, causal=causal, mask=mask, noisy=noisy)[0]

  def _project(self, x2, w, b, shape, narrow: Narrow | None = None):
    """[tokens, d] @ [d, heads, k] (+ bias), reshaped to [b, l, heads, k]."""
    w = w[...]
    heads, k = w.shape[1:]
    y = _narrowed(narrow, lambda x: dense(x, w.reshape(-1, heads * k), self.dtype), x2)
    return _add_bias(y, b).reshape(*shape, heads, k)

  def _project_qkv(self, x2, shape, noisy=None, narrow: Narrow | None = None):
    """q, k and v, each [b, l, heads, k] (with the adapters where the joined
    weight carries them)."""
    if not self.out_in:
      return tuple(self._project(x2, w, bias, shape, narrow)
                   for w, bias in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
    h, g, k = self.num_heads, self.num_kv_heads, self.head_dim
    wqkv = self.wqkv[...].reshape((h + 2 * g) * k, -1)
    y = _narrowed(narrow, lambda x: dense(x, wqkv, self.dtype, out_in=True, noisy=noisy), x2)
    parts = jnp.split(y, [h * k, (h + g) * k], axis=-1)
    return tuple(_add_bias(p, bias).reshape(*shape, n, k) for p, bias, n in zip(parts, (self.bq, self.bk, self.bv),
                                                                                   (h, g, g)))

  def forward(self, x: Float[Array, "b l d"], positions: Int[Array, "b l"] | Rotation, *, causal: bool,
              mask: Bool[Array, "b #h l s"] | kernels.AttentionMask | None = None, cache: KVCache | None = None,
              layer: int = 0, noisy: Bool[Array, "b l"] | None = None,
              narrow: Narrow | None = None) -> tuple[Float[Array, "b l d"], KVCache | None]:
    """Self-attention; with `cache`, the new keys/values are first written into
    layer `layer` of the cache and the queries read the whole cache buffer
    (`mask` then says which slots are visible). Returns the updated cache.
    `noisy`: the tokens the adapters act on (None: all). `narrow`: the
    projections run over the valid columns only (adapters off)."""
    dt = self.dtype
    b, l, d = x.shape
    h, k = self.num_heads, self.head_dim
    if narrow is not None and noisy is not False:
      raise ValueError("a narrowed pass runs the base alone (noisy=False)")
    x2 = x.reshape(b * l, d)
    q, k_, v = self._project_qkv(x2, (b, l), noisy, narrow)
    if self.lora_q is not None and noisy is not False and not (self.out_in and carries_adapters(self.wqkv[...])):
      q, k_, v = (y + _lora_delta(a, x2, dt, noisy).reshape(y.shape)
                  for y, a in ((q, self.lora_q), (k_, self.lora_k), (v, self.lora_v)))
    if self.q_norm is not None:
      q, k_ = self.q_norm(q), self.k_norm(k_)
    q = constrain(rope(q, positions, self.rope_theta, self.rope_scaling), ("batch", "length", "act_heads", None))
    k_ = constrain(rope(k_, positions, self.rope_theta, self.rope_scaling), ("batch", "length", "act_kv_heads", None))
    v = constrain(v, ("batch", "length", "act_kv_heads", None))
    if cache is not None:
      cache = cache.write(layer, k_, v)
      o = kernels.cache_attention(q, cache.k, cache.v, layer=layer, causal=causal, mask=mask,
                                  implementation=self.attention_impl)
    else:
      o = kernels.attention(q, k_, v, causal=causal, mask=mask, implementation=self.attention_impl)
    wo = self.wo[...].reshape((d, h * k) if self.out_in else (h * k, d))
    o2 = o.reshape(b * l, h * k)
    out = _narrowed(narrow, lambda x: dense(x, wo, dt, self.out_in, noisy), o2) + _lora_delta(self.lora_o, o2, dt,
                                                                                               noisy, wo)
    return out.reshape(b, l, d), cache


class MLP(nnx.Module):
  def __init__(self, embed_dim: int, mlp_dim: int, kind: str, *, dtype, rngs: Keys, out_in: bool = False,
               lora: tuple[int, float] | None = None):
    self.kind, self.dtype, self.out_in = kind, dtype, out_in
    if lora is not None:  # (rank, scale): adapters on every projection
      r, sc = lora
      self.lora_gate = LoRA(embed_dim, mlp_dim, r, sc, rngs=rngs, axes=("embed", "mlp")) if kind == "swiglu" else None
      self.lora_up = LoRA(embed_dim, mlp_dim, r, sc, rngs=rngs, axes=("embed", "mlp"))
      self.lora_down = LoRA(mlp_dim, embed_dim, r, sc, rngs=rngs, axes=("mlp", "embed"))
    else:
      self.lora_gate = self.lora_up = self.lora_down = None
    init = fan_in_init(embed_dim)
    if out_in:  # the decoding layout: gate and up in one [out, in] weight, one product
      self.w_in = param(rngs, init, (2 if kind == "swiglu" else 1, mlp_dim, embed_dim), (None, "mlp", "embed"))
      self.w_down = param(rngs, fan_in_init(mlp_dim), (embed_dim, mlp_dim), ("embed", "mlp"))
    else:
      if kind == "swiglu":
        self.w_gate = param(rngs, init, (embed_dim, mlp_dim), ("embed", "mlp"))
      self.w_up = param(rngs, init, (embed_dim, mlp_dim), ("embed", "mlp"))
      self.w_down = param(rngs, fan_in_init(mlp_dim), (mlp_dim, embed_dim), ("mlp", "embed"))

  def __call__(self, x, noisy=None):
    dt, out_in = self.dtype, self.out_in
    b, l, d = x.shape
    x2 = x.reshape(b * l, d)
    if out_in:
      w_in = self.w_in[...]
      parts = jnp.split(dense(x2, w_in.reshape(-1, d), dt, out_in=True, noisy=noisy), w_in.shape[0], axis=-1)
    else:
      parts = [dense(x2, self.w_gate[...], dt)] if self.kind == "swiglu" else []
      parts.append(dense(x2, self.w_up[...], dt))
    if self.lora_up is not None and not (out_in and carries_adapters(self.w_in[...])):
      adapters = [self.lora_gate, self.lora_up] if self.kind == "swiglu" else [self.lora_up]
      parts = [p + _lora_delta(a, x2, dt, noisy) for p, a in zip(parts, adapters)]
    if self.kind == "swiglu":
      gate, up = parts
      h = jax.nn.silu(gate) * up
    else:
      h = jax.nn.gelu(parts[0])
    h = constrain(h.reshape(b, l, -1), ("batch", "length", "act_mlp")).reshape(b * l, -1)
    w_down = self.w_down[...]
    return (dense(h, w_down, dt, out_in, noisy) + _lora_delta(self.lora_down, h, dt, noisy, w_down)).reshape(b, l, d)


class Modulation(nnx.Module):
  """adaLN: shift/scale/gate vectors from the time embedding (DiT, MDLM).

  Zero-initialised and applied as x * (1 + scale) + shift and (1 + gate), so
  a time-conditioned model starts exactly as the unconditioned one."""

  def __init__(self, cond_dim: int, embed_dim: int, n: int, *, rngs: Keys):
    self.n = n
    self.w = param(rngs, nnx.initializers.zeros, (cond_dim, n, embed_dim), ("cond", None, "embed"))
    self.b = param(rngs, nnx.initializers.zeros, (n, embed_dim), (None, "embed"))

  def __call__(self, cond):
    out = jnp.einsum("bc,cnd->bnd", cond, self.w[...].astype(cond.dtype)) + self.b[...].astype(cond.dtype)
    return [out[:, None, i, :] for i in range(self.n)]  # each [b, 1, d]


class TimeEmbedding(nnx.Module):
  """Sinusoidal features of t in [0, 1] followed by a 2-layer MLP."""

  def __init__(self, cond_dim: int, *, freq_dim: int = 256, rngs: Keys):
    self.freq_dim = freq_dim
    self.w1 = param(rngs, fan_in_init(freq_dim), (freq_dim, cond_dim), (None, "cond"))
    self.b1 = param(rngs, nnx.initializers.zeros, (cond_dim,), ("cond",))
    self.w2 = param(rngs, fan_in_init(cond_dim), (cond_dim, cond_dim), (None, "cond"))
    self.b2 = param(rngs, nnx.initializers.zeros, (cond_dim,), ("cond",))

  def __call__(self, t: Float[Array, "b"]):
    half = self.freq_dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    args = (t.astype(jnp.float32) * 1000.0)[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)
    h = jax.nn.silu(emb @ self.w1[...] + self.b1[...])
    return h @ self.w2[...] + self.b2[...]
