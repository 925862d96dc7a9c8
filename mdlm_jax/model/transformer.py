"""The transformer: bidirectional for masked diffusion, causal for the AR twin.

One module serves both objectives so that the comparison between them is
about the objective and the decoding, never about the network.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax import kernels
from mdlm_jax.kernels import AttentionMask, HeadInput
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model.layers import (MLP, WEIGHT_LAYOUTS, Attention, Keys, Modulation, Narrow, RMSNorm, TimeEmbedding,
                                   fan_in_init, param)
from mdlm_jax.model.precision import compute_dtype
from mdlm_jax.model.rope import RopeScaling, Rotation, rotation
from mdlm_jax.parallel.sharding import constrain


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  num_layers: int
  embed_dim: int
  num_heads: int
  mlp_dim: int
  head_dim: int = -1
  num_kv_heads: int = -1
  qkv_bias: bool = False
  mlp: str = "swiglu"
  causal: bool = False
  # The hidden state at i - 1 scores token i (Dream's shifted head): a diffusion
  # model started from AR weights keeps their next-token mapping.
  shift_logits: bool = False
  time_conditioning: bool = False
  cond_dim: int = 128
  tie_embeddings: bool = True
  # A tied head divides the hidden state by sqrt(embed_dim) (unit-variance
  # embeddings; LLaDA's scale_logits); False is the plain tied head of Llama,
  # Qwen and SmolLM checkpoints.
  scale_tied_logits: bool = True
  # RMSNorm over each query and key head before RoPE (Qwen3).
  qk_norm: bool = False
  # An AR model adapted to diffusion: clean tokens (the prompt, committed
  # blocks) attend causally, as in the base, and only a block being denoised
  # attends both ways (A2D.md); the clean context stays the base's.
  clean_causal: bool = False
  # Low-rank adapters (rank r, update scaled by lora_alpha / r) on every
  # linear layer, acting on the tokens being denoised only: the clean stream
  # stays the frozen base's computation (0: none).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  # An int8 decoding copy whose adapters are joined into its weights
  # (`quantize_for_decoding`): its layers hold no adapters of their own, so a
  # pass is not handed the float copies it would never read.
  adapters_joined: bool = False
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  norm_eps: float = 1e-6
  dtype: str = "float32"
  attention: str = "xla"
  remat: bool = False
  # How matmul weights are stored: "in_out" (as trained and saved) or
  # "out_in", which decodes faster on CPU (see `with_weight_layout`).
  weight_layout: str = "in_out"

  def __post_init__(self):
    if self.weight_layout not in WEIGHT_LAYOUTS:
      raise ValueError(f"unknown weight_layout {self.weight_layout!r}; choose from {WEIGHT_LAYOUTS}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim != -1 else self.embed_dim // self.num_heads

  @property
  def resolved_kv_heads(self) -> int:
    return self.num_kv_heads if self.num_kv_heads != -1 else self.num_heads

  @classmethod
  def from_config(cls, m: ml_collections.ConfigDict, vocab_size: int | None = None) -> "ModelConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in m.to_dict().items() if k in fields}
    if "rope_scaling" in kw:
      kw["rope_scaling"] = RopeScaling.from_dict(kw["rope_scaling"])
    if vocab_size is not None:
      kw["vocab_size"] = vocab_size
    if kw.get("vocab_size", -1) <= 0:
      raise ValueError("model.vocab_size is unset; pass the tokenizer's vocabulary size")
    return cls(**kw)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: Keys):
    dt = compute_dtype(cfg.dtype)
    out_in = cfg.weight_layout == "out_in"
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs=rngs)
    self.attn = Attention(cfg.embed_dim, cfg.num_heads, cfg.resolved_head_dim, num_kv_heads=cfg.resolved_kv_heads,
                          qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps, lora=_lora(cfg),
                          rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                          attention_impl=cfg.attention, dtype=dt,
                          rngs=rngs, out_in=out_in)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs=rngs)
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, cfg.mlp, dtype=dt, rngs=rngs, out_in=out_in, lora=_lora(cfg))
    self.modulation = Modulation(cfg.cond_dim, cfg.embed_dim, 6, rngs=rngs) if cfg.time_conditioning else None

  def __call__(self, x, positions, cond, *, causal: bool, mask=None, noisy=None):
    return self.forward(x, positions, cond, causal=causal, mask=mask, noisy=noisy)[0]

  def forward(self, x: Float[Array, "b l d"], positions: Int[Array, "b l"] | Rotation,
              cond: Float[Array, "b c"] | None, *,
              causal: bool, mask: Bool[Array, "b #h l s"] | AttentionMask | None = None, cache: KVCache | None = None,
              layer: int = 0, noisy: Bool[Array, "b l"] | None = None,
              narrow: Narrow | None = None) -> tuple[Float[Array, "b l d"], KVCache | None]:
    """One pre-norm block; with `cache`, attention reads and extends layer `layer` of it.
    `noisy`: the tokens the adapters act on (None: all, when the model has any).
    `narrow`: the products run over each row's valid columns only (`layers.Narrow`)."""
    if self.modulation is None:
      a, cache = self.attn.forward(self.attn_norm(x), positions, causal=causal, mask=mask, cache=cache, layer=layer,
                                   noisy=noisy, narrow=narrow)
      x = x + a
      x = constrain(x, ("batch", "length", "act_embed"))
      mlp = lambda h: self.mlp(h, noisy=noisy)  # noqa: E731
      x = x + (mlp(self.mlp_norm(x)) if narrow is None else narrow.columns(mlp, self.mlp_norm(x)))
    elif narrow is not None:
      raise ValueError("a narrowed pass runs an adapted AR model (no time modulation)")
    else:
      sh1, sc1, g1, sh2, sc2, g2 = (m.astype(x.dtype) for m in self.modulation(cond))
      h = self.attn_norm(x) * (1 + sc1) + sh1
      a, cache = self.attn.forward(h, positions, causal=causal, mask=mask, cache=cache, layer=layer)
      x = x + (1 + g1) * a
      x = constrain(x, ("batch", "length", "act_embed"))
      x = x + (1 + g2) * self.mlp(self.mlp_norm(x) * (1 + sc2) + sh2)
    return constrain(x, ("batch", "length", "act_embed")), cache


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: Keys):
    self.cfg = cfg
    self.embedding = param(rngs, nnx.initializers.normal(stddev=1.0), (cfg.vocab_size, cfg.embed_dim),
                           ("vocab", "embed"))
    self.time_embedding = TimeEmbedding(cfg.cond_dim, rngs=rngs) if cfg.time_conditioning else None
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs=rngs)
    self.final_modulation = (Modulation(cfg.cond_dim, cfg.embed_dim, 2, rngs=rngs)
                             if cfg.time_conditioning else None)
    head_axes = ((cfg.vocab_size, cfg.embed_dim), ("vocab", "embed")) if cfg.weight_layout == "out_in" else \
        ((cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"))
    self.head = None if cfg.tie_embeddings else param(rngs, fan_in_init(cfg.embed_dim), *head_axes)

  def hidden_states(self, tokens: Int[Array, "b l"], t: Float[Array, "b"] | None = None,
                    positions: Int[Array, "b l"] | None = None, mask=None, noisy: Bool[Array, "b l"] | None = None):
    """Final normalised hidden states [b, l, d] in the compute dtype; `noisy`:
    the tokens adapters act on ([b, l] bool; None: all; False: none)."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return self._trunk(tokens, t, positions, causal=self.cfg.causal, mask=mask, noisy=noisy)[0]

  def _trunk(self, tokens, t, positions, *, causal: bool, mask, cache: KVCache | None = None, noisy=None,
             narrow: Narrow | None = None):
    """Embedding, blocks and final norm: the one body of the full and the cached forward."""
    cfg = self.cfg
    dt = compute_dtype(cfg.dtype)
    x = embed(self.embedding[...], tokens).astype(dt)
    x = constrain(x, ("batch", "length", "act_embed"))
    cond = None
    if self.time_embedding is not None:
      if t is None:
        raise ValueError("this model is time-conditioned: pass t")
      cond = jax.nn.silu(self.time_embedding(t))

    positions = rotation(positions, cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling)  # once, every layer's

    def run_block(block, x):
      return block(x, positions, cond, causal=causal, mask=mask, noisy=noisy)

    if cfg.remat:
      run_block = nnx.remat(run_block)
    for i, block in enumerate(self.blocks):
      if cache is None:
        x = run_block(block, x)
      else:  # inference only: nothing to rematerialise
        x, cache = block.forward(x, positions, cond, causal=causal, mask=mask, cache=cache, layer=i, noisy=noisy,
                                 narrow=narrow)
    x = self.final_norm(x)
    if self.final_modulation is not None:
      shift, scale = (m.astype(x.dtype) for m in self.final_modulation(cond))
      x = x * (1 + scale) + shift
    return x, cache

  def forward_cached(self, tokens: Int[Array, "b t"], positions: Int[Array, "b t"], cache: KVCache, *,
                     commit: bool, valid_new: Bool[Array, "b t"] | None = None,
                     t: Float[Array, "b"] | None = None, commit_len: int | Int[Array, "b"] | None = None,
                     new_block: int = 0, head: bool = False, last_only: bool = False,
                     clean: bool = False) -> tuple[Float[Array, "b t v"] | HeadInput, KVCache]:
    """Logits of t new tokens that read the cache's valid filled slots and each other.

    The new tokens see one another causally when cfg.causal, else all of them
    (a diffusion block sees its whole block); `valid_new` False marks padding,
    which no query reads (padding queries give arbitrary logits). Keys get
    RoPE at `positions`. With commit=True (static) the new keys/values are
    kept at slots [length, length + t) and length advances by t; with
    commit=False the input cache is returned, so a block can be re-denoised
    against the same prefix. The cache needs room: length + t <= max_len.
    `commit_len` keeps only the first new tokens (an int, or one count per
    row [b] with a per-row cache); `new_block` > 0
    splits the new tokens into a head that does not see the last `new_block`
    and that tail block, which sees all: one pass encodes a finished clean
    block or the prompt (to keep) and denoises the next block. Logits are
    then returned for the tail block only, [b, new_block, v]. With `head`
    (static) a `HeadInput` replaces the logits, for a sampler's fused head.
    `last_only` (static) returns only the logits that score the token after
    the kept ones, [b, 1, v] (from the last kept state, shifted head or
    not): a prefill reads nothing else, and [b, t, v] logits of a long
    prompt batch are the largest array of the pass. `clean` (static) says
    every new token is clean: kept, or padding past `commit_len` that no
    query reads. No product then runs the adapters, so a prefill costs
    what the base's does; the kept rows' values are the same either way.
    """
    b, n = tokens.shape
    if (last_only or clean) and new_block:
      raise ValueError("last_only and clean are for a pass that only encodes (new_block=0)")
    if clean and not commit:
      raise ValueError("clean=True describes tokens kept in the cache: it needs commit=True")
    if valid_new is None:
      valid_new = jnp.ones((b, n), jnp.bool_)
    keep = n if commit_len is None else commit_len
    noisy = None
    if self.cfg.clean_causal or self.cfg.lora_rank:
      # Tokens this pass keeps in the cache are clean; the rest are being denoised.
      first_noisy = (n - new_block if new_block > 0 else (keep if commit else 0))
      noisy = jnp.arange(n)[None] >= jnp.reshape(jnp.asarray(first_noisy, jnp.int32), (-1, 1))
      noisy = jnp.broadcast_to(noisy, (b, n))
    valid, mask = cache.attention_spec(valid_new, causal=self.cfg.causal, new_block=new_block,
                                       clean=~noisy if self.cfg.clean_causal else None)
    # The cache layout is not "queries are the last keys": causality lives in the mask.
    adapted = (False if clean else noisy) if self.cfg.lora_rank else None
    x, written = self._trunk(tokens, t, positions, causal=False, mask=mask, cache=cache, noisy=adapted)
    out = x[:, n - new_block:] if new_block > 0 else x  # nobody reads the head's logits: skip its vocabulary matmul
    if last_only:
      # The kept tokens' last state scores the next token, shifted head or not.
      out = _last_kept(x, keep, cache.last_hidden)[:, None]
    elif self.cfg.shift_logits:
      # The state before the first scored token: the head's last kept token,
      # or, with nothing kept before them in this pass, the cache's last token.
      before = jnp.minimum(keep, n - new_block) if new_block > 0 else 0
      out = jnp.concatenate([_last_kept(x, before, cache.last_hidden)[:, None], out[:, :-1]], axis=1)
    out = self.head_input(out) if head else self.logits(out)
    if not commit:
      return out, cache
    if self.cfg.shift_logits:
      written = written.replace(last_hidden=_last_kept(x, keep, cache.last_hidden))
    return out, written.commit(cache.kept_valid(valid, keep), keep)

  def forward_speculative(self, tokens: Int[Array, "b n"], positions: Int[Array, "b n"], cache: KVCache,
                          head_valid: Bool[Array, "b h"], widths: tuple[int, ...] = (),
                          need=None) -> tuple[Float[Array, "b n v"], "PendingCommit"]:
    """One pass of self-speculative decoding for an AR model adapted to
    diffusion (clean_causal, shift_logits): `tokens` are a clean head of h
    tokens (an exact token, then drafts; `head_valid` a prefix of each row)
    that reads the cache causally as the base model does, and a masked tail
    block after the head's valid tokens that reads everything.

    Logits [b, n, v]: head column i scores the head's token i given the
    head's tokens before it (column 0 from the cache's last state), which
    verifies the drafts against the base; the tail's columns score the tail,
    its first from the last valid head token's state (the base's next
    token, exact when every draft holds), the rest are the next drafts.
    Nothing is kept until `commit_speculative` says how many head tokens hold.

    `widths` (static; a pass of the head alone, the last its width) with
    `need` (traced: at least every row's valid head columns): the products
    run over each row's first w columns only, w the narrowest width that
    holds `need` (`layers.Narrow`); the logits of the columns past it are
    arbitrary and never read. Where a pass costs its rows (a CPU), a head
    with few drafts then costs a narrow pass."""
    cfg = self.cfg
    if not (cfg.clean_causal and cfg.shift_logits) or cfg.time_conditioning:
      raise ValueError("speculative decoding needs an adapted AR model (model.clean_causal and shift_logits,"
                       " no time conditioning)")
    b, n = tokens.shape
    h = head_valid.shape[1]
    valid_new = jnp.concatenate([head_valid.astype(jnp.bool_), jnp.ones((b, n - h), jnp.bool_)], axis=1)
    noisy = jnp.broadcast_to(jnp.arange(n)[None] >= h, (b, n))
    valid, mask = cache.attention_spec(valid_new, causal=False, new_block=n - h, clean=~noisy)
    # No masked column (a pass of the head alone): no product runs the adapters.
    adapted = (noisy if n > h else False) if cfg.lora_rank else None
    narrow = None
    if widths:
      if n > h:
        raise ValueError("a narrowed speculative pass is a head alone, without a masked tail")
      narrow = Narrow(widths, need)
      adapted = False
    x, written = self._trunk(tokens, None, positions, causal=False, mask=mask, cache=cache, noisy=adapted,
                             narrow=narrow)
    head = jnp.concatenate([cache.last_hidden[:, None].astype(x.dtype), x[:, :h - 1]], axis=1)
    last = _last_kept(x[:, :h], jnp.sum(head_valid, axis=-1), cache.last_hidden)
    tail = jnp.concatenate([last[:, None], x[:, h:n - 1]], axis=1)
    pending = PendingCommit(x[:, :h], written, valid, cache)
    if narrow is None:
      return self.logits(jnp.concatenate([head, tail], axis=1)), pending

    def scored(w):  # the first w head columns and the base's next token, the columns between them zeros
      def run(head, tail):
        y = self.logits(jnp.concatenate([head[:, :w], tail], axis=1))
        return jnp.concatenate([y[:, :w], jnp.zeros((b, h - w) + y.shape[2:], y.dtype), y[:, w:]], axis=1)
      return run
    return narrow.by_width(scored, head, tail), pending

  def head_input(self, hidden: Float[Array, "b l d"]) -> HeadInput:
    """The vocabulary head's inputs: `logits` is `head_input(hidden).logits()`."""
    out_in = self.cfg.weight_layout == "out_in"
    impl = "xla" if self.cfg.attention == "reference" else self.cfg.attention  # the head has no reference mode
    if self.head is not None:
      return HeadInput(hidden, self.head[...], impl, out_in)
    if self.cfg.scale_tied_logits:
      hidden = hidden * (self.cfg.embed_dim ** -0.5)  # tied: unit-variance embeddings
    emb = self.embedding[...]  # [v, d]: already out_in
    return HeadInput(hidden, emb if out_in else emb.T, impl, out_in)

  def logits(self, hidden: Float[Array, "b l d"]) -> Float[Array, "b l v"]:
    return constrain(self.head_input(hidden).logits(), ("batch", "length", "act_vocab"))

  def __call__(self, tokens, t=None, positions=None, mask=None) -> Float[Array, "b l v"]:
    hidden = self.hidden_states(tokens, t, positions, mask)
    return self.logits(shift_right(hidden) if self.cfg.shift_logits else hidden)


def _lora(cfg: ModelConfig):
  """(rank, scale) of the layers' own adapters, or None."""
  return (cfg.lora_rank, cfg.lora_alpha / cfg.lora_rank) if cfg.lora_rank > 0 and not cfg.adapters_joined else None


def shift_right(hidden: Float[Array, "b l d"]) -> Float[Array, "b l d"]:
  """Position i gets the state of i - 1; position 0, with nothing before it, keeps its own."""
  return jnp.concatenate([hidden[:, :1], hidden[:, :-1]], axis=1)


@struct.dataclass
class PendingCommit:
  """A speculative pass's head, written into the cache but not yet kept."""
  hidden: Float[Array, "b h d"]
  written: KVCache
  valid: Bool[Array, "b s"]
  before: KVCache

  def commit(self, keep: Int[Array, "b"]) -> KVCache:
    """The cache with each row's first `keep` head tokens kept (a per-row cache)."""
    written = self.written.replace(last_hidden=_last_kept(self.hidden, keep, self.before.last_hidden))
    return written.commit(self.before.kept_valid(self.valid, keep), keep)


def _last_kept(x: Float[Array, "b t d"], count, fallback: Float[Array, "b d"]) -> Float[Array, "b d"]:
  """x[row, count - 1] per row (count: an int or [b]); `fallback` where count is 0."""
  count = jnp.broadcast_to(jnp.asarray(count, jnp.int32), x.shape[:1])
  last = jnp.take_along_axis(x, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
  return jnp.where((count > 0)[:, None], last, fallback.astype(x.dtype))


def convert_weight_layout(params: dict, cfg: ModelConfig, to: str) -> dict:
  """`params` (of a model with config `cfg`) with the matmul weights in layout
  `to`. "out_in" stores each weight [out, in] and joins the weights that read
  the same input (q/k/v; gate/up), so decoding runs one product for each
  group; exact both ways (only axes move)."""
  if to not in WEIGHT_LAYOUTS:
    raise ValueError(f"unknown weight layout {to!r}; choose from {WEIGHT_LAYOUTS}")
  if cfg.weight_layout == to:
    return params
  h, g = cfg.num_heads, cfg.resolved_kv_heads
  out = dict(params, blocks={})
  for i, block in params["blocks"].items():
    attn, mlp = dict(block["attn"]), dict(block["mlp"])
    if to == "out_in":
      attn["wqkv"] = jnp.concatenate([jnp.transpose(attn.pop(n), (1, 2, 0)) for n in ("wq", "wk", "wv")], axis=0)
      attn["wo"] = jnp.transpose(attn["wo"], (2, 0, 1))
      mlp["w_in"] = jnp.stack([mlp.pop(n).T for n in ("w_gate", "w_up") if n in mlp])
      mlp["w_down"] = mlp["w_down"].T
    else:
      wq, wk, wv = jnp.split(attn.pop("wqkv"), [h, h + g], axis=0)
      attn.update(wq=jnp.transpose(wq, (2, 0, 1)), wk=jnp.transpose(wk, (2, 0, 1)), wv=jnp.transpose(wv, (2, 0, 1)),
                  wo=jnp.transpose(attn["wo"], (1, 2, 0)))
      w_in = mlp.pop("w_in")
      mlp.update(dict(zip(("w_gate", "w_up") if len(w_in) == 2 else ("w_up",), (w.T for w in w_in))),
                 w_down=mlp["w_down"].T)
    out["blocks"][i] = dict(block, attn=attn, mlp=mlp)
  if "head" in params:
    out["head"] = params["head"].T
  return out


def embed(table, tokens: Int[Array, "..."]) -> Float[Array, "... d"]:
  """Rows of the embedding table (float, or int8 with a scale per row)."""
  if isinstance(table, kernels.QuantizedWeight):
    return jnp.take(table.q, tokens, axis=0).astype(jnp.float32) * jnp.take(table.scale, tokens)[..., None]
  return jnp.take(table, tokens, axis=0)


# "int8": int8 weights, token rows rounded to int16 in the products; "w8a8":
# the same weights, token rows rounded to int8 in groups of 32 columns
# (`kernels.int8`), whose products run twice the multiplies an instruction.
DECODE_DTYPES = ("float32", "int8", "w8a8")
# What the command lines take: a decode dtype, or "auto" for the one this
# machine decodes fastest in (`spec.resolve_decode_dtype`).
DECODE_DTYPE_CHOICES = ("auto", *DECODE_DTYPES)
# The int8 decode dtypes and the bits their products round token rows to.
INT8_ACTIVATION_BITS = {"int8": 16, "w8a8": 8}


def quantize_for_decoding(params: dict, cfg: ModelConfig, activation_bits: int = 16,
                          adapter_dtype=jnp.float32) -> dict:
  """`params` of an "out_in" model with every matmul weight (q/k/v, output,
  gate/up, down, embedding, untied head) in weight-only int8, a float32 scale
  per output row (`kernels.QuantizedWeight`); adapters, norms and biases stay
  as they are. A pass at batch 1 reads a quarter of the bytes. A model's
  low-rank adapters are also joined into the weights they adapt
  (`kernels.join_adapters`: q, k and v's into the joined q/k/v weight, gate
  and up's into theirs), so that each product applies them in the same call,
  and their own params are dropped (the float32 copy keeps them; the copy's
  config says `adapters_joined`). Each weight is held
  once, in the layout its use reads: the CPU kernel's tiles for a product,
  rows for the embedding's gather (a tied table, the head too, holds both).
  `activation_bits`: what the products round token rows to (16, or 8 in
  groups: the "w8a8" decode dtype); `adapter_dtype`: what the joined
  adapters are held in (`adapters_fit_bfloat16`)."""
  if cfg.weight_layout != "out_in":
    raise ValueError(f"int8 decoding weights are stored [out, in]: convert the model to weight_layout='out_in'"
                     f" first (it is {cfg.weight_layout!r})")
  scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0

  def quantized(w, out_dims, group, names):
    qw = kernels.quantize(w, out_dims=out_dims, activation_bits=activation_bits).without_rows()
    loras = [group.pop(n) for n in names if n in group]
    joined = [(a["a"], a["b"]) for a in loras]
    return qw.replace(adapters=kernels.join_adapters(joined, scale, adapter_dtype)) if loras else qw

  out = dict(params, blocks={})
  for i, block in params["blocks"].items():
    attn, mlp = dict(block["attn"]), dict(block["mlp"])
    attn.update(wqkv=quantized(attn["wqkv"], 2, attn, ("lora_q", "lora_k", "lora_v")),
                wo=quantized(attn["wo"], 1, attn, ("lora_o",)))
    mlp.update(w_in=quantized(mlp["w_in"], 2, mlp, ("lora_gate", "lora_up")),
               w_down=quantized(mlp["w_down"], 1, mlp, ("lora_down",)))
    out["blocks"][i] = dict(block, attn=attn, mlp=mlp)
  table = kernels.quantize(params["embedding"], out_dims=1, activation_bits=activation_bits)
  out["embedding"] = table if "head" not in params else table.replace(tiles=None)
  if "head" in params:
    out["head"] = kernels.quantize(params["head"], out_dims=1, activation_bits=activation_bits).without_rows()
  return out


def adapters_fit_bfloat16(params: dict, cfg: ModelConfig) -> bool:
  """Whether every low-rank adapter, b times the adapters' scale, holds
  values bfloat16 represents exactly (the packaged adapters are stored in
  bfloat16, and their scale is 2): the int8 decoding copy then holds them in
  bfloat16, half the bytes a pass reads for them, with the same products."""
  scale = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
  loras = [v for block in params.get("blocks", {}).values() for part in block.values() if isinstance(part, dict)
           for name, v in part.items() if name.startswith("lora_")]

  def exact(x) -> bool:
    x = np.asarray(x, np.float32)
    return bool(np.array_equal(x, x.astype(ml_dtypes.bfloat16).astype(np.float32)))
  return bool(loras) and all(exact(lo["a"]) and exact(np.asarray(lo["b"], np.float32) * np.float32(scale))
                             for lo in loras)


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
