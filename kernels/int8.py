"""Weight-only int8 decoding weights: one float32 scale per output row.

A decoding pass at batch 1 reads every weight once for a few token rows, so
its time is the bytes it reads: int8 weights read a quarter of float32's.
XLA:CPU does not fuse an int8 -> float32 convert into a dot (it writes a
float32 copy of the weight first, every pass), so on CPU the product runs in a
small C++ kernel (`int8_matmul.cc`) called through the XLA FFI. The kernel
forms integer dot products: each token row is rounded to int16 with its own
scale (a relative error of at most 2^-16 of the row's largest magnitude), and
its sums with the int8 weights are exact. It reads the weights in tiles of
32 output rows (`tile_weights`, made once by `quantize`). Widening the weights to float32
instead made the kernel bound by instructions, not bytes. It is compiled on
first use with the machine's C++ compiler (`$CXX`, else g++) into the cache
folder, in one library with the CPU decoding attention (`cpu_attention.py`);
without a compiler, and on other backends, the product is XLA's
convert-then-dot over the same rounded rows, slower and the same numbers to
float32 rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int8, Int32

# Up to this many token rows the kernel serves the product (8 rows a read of
# the weights); past it XLA's convert-then-dot, which converts every weight
# to float32 each call. SmolLM2's products at 32 rows (2026-11-26): the
# kernel 61 ms, XLA on the converted weights 221, float32 weights 75; at 64
# rows 128, 249 and 125. With the vectorized epilogue (2026-11-27, `bench
# kernels --int8-rows`): 68 rows 81 ms against XLA's 317, 128 rows 142
# against 394, 256 rows 280 against 549. The engine's int8 copies serve
# passes and prefills of up to this many rows (`engine.int8_prefill_rows`),
# longer prompts prefill from the float32 copy: a 448-row prefill of SmolLM2
# took 259 ms from the w8a8 copy against 447 from the float32 one (2026-11-28),
# and prefilling from the copy that decodes keeps the prompt's keys and values
# the bits the AR path computes (docs/sampling.md); the one-shot generator
# encodes a prompt and its first block in its decoding program (68 rows for
# a 64-token prompt). Prefills of SmolLM2 (one row of N tokens, forward_cached,
# 2026-11-28, another job on the machine, so read the ratios), w8a8 copy against
# the float32 [in, out] one: 512 tokens 853 against 1,246 ms, 1,024 1,434 against
# 2,673, 2,048 4,702 against 6,628, 4,096 12,847 against 15,772 (the attention
# kernel's share grows with the square of the prompt): the copy that decodes is
# the faster at every length measured. The limit is where a prompt's last row
# stops being the same bits at every buffer width: a 1,400-token prompt of
# SmolLM2 in w8a8 gives equal logits in buffers of 1,536 to 3,072 rows and other
# ones at 4,096 (an XLA operation's; the products, the attention kernel and
# RMSNorm were each checked equal at 4,096 rows), and the AR path pads prompts
# to powers of two.
KERNEL_MAX_ROWS = 2048
FFI_TARGET = "mdlm_jax_int8_matmul"
LORA_FFI_TARGET = "mdlm_jax_int8_lora_matmul"
A8_FFI_TARGET = "mdlm_jax_int8_a8_matmul"
A8_LORA_FFI_TARGET = "mdlm_jax_int8_a8_lora_matmul"
BF16 = "_bf16"  # suffix of the adapted products' targets for bfloat16 adapters
ATTENTION_FFI_TARGET = "mdlm_jax_cache_attention"  # kernels/cpu_attention.py
F32_ROWS_FFI_TARGET = "mdlm_jax_f32_rows_matmul"  # kernels/f32_rows.py
_HERE = os.path.dirname(os.path.abspath(__file__))
# The CPU kernels, built into one library: these products and the decoding attention.
_SOURCES = tuple(os.path.join(_HERE, name) for name in ("int8_matmul.cc", "cache_attention.cc", "f32_rows.cc"))
_HEADERS = (os.path.join(_HERE, "cpu_pool.h"),)


@struct.dataclass
class LowRank:
  """Low-rank adapters on the output rows of one [out, in] weight, joined so
  that one call forms the weight's product and theirs: adapter p acts on
  output rows [ends[p - 1], ends[p]) as x @ a_p @ b_p * scale. `at`
  [parts * rank, in] holds each a_p transposed, `b` [rank, out] each output
  row's column of its adapter's b times the scale, output rows along its
  rows so that the kernel forms sixteen outputs' updates at once
  (`join_adapters`). Both float32, or bfloat16 (half the bytes a pass reads
  for them; the products are formed in float32 either way)."""

  at: Float[Array, "pr k"]
  b: Float[Array, "r n"]
  ends: Int32[Array, "p"]

  def delta(self, x2d: Float[Array, "m k"]) -> Float[Array, "m n"]:
    """The adapters' update of every token row, with XLA's products."""
    m, parts, rank = x2d.shape[0], self.ends.shape[0], self.b.shape[0]
    u = (x2d @ self.at.astype(jnp.float32).T).reshape(m, parts, rank)
    part = jnp.searchsorted(self.ends, jnp.arange(self.b.shape[1]), side="right")
    return jnp.einsum("mnt,tn->mn", u[:, part], self.b.astype(jnp.float32))


def join_adapters(adapters: list[tuple[Array, Array]], scale: float, dtype=jnp.float32) -> LowRank:
  """`LowRank` of adapters (a [in, rank], b [rank, out_p]) whose outputs are
  the consecutive output rows of one weight, in order, held in `dtype`
  (float32 or bfloat16)."""
  at = jnp.concatenate([jnp.asarray(a, jnp.float32).T for a, _ in adapters], axis=0).astype(dtype)
  b = jnp.concatenate([jnp.asarray(b, jnp.float32) * scale for _, b in adapters], axis=1).astype(dtype)
  ends = jnp.cumsum(jnp.asarray([b_p.shape[1] for _, b_p in adapters], jnp.int32))
  return LowRank(at, b, ends)


KERNEL_TILE = 32  # output rows a tile holds (the kernel's kTile)
KERNEL_PAD = 8  # a tile's columns are padded to a multiple of this (kPad)
ACTIVATION_GROUP = 32  # columns of a token row sharing one 8-bit scale (kGroup)


def tile_weights(q2d: Int8[Array, "n k"], activation_bits: int = 16) -> Array:
  """An [out, in] int8 weight in the kernel's layout: tiles of KERNEL_TILE
  output rows, rows and columns padded with zeros. For int16 token rows each
  tile is [column pairs, rows, 2] (row o's columns 2i and 2i + 1 side by side
  at [i, o]), int8; for 8-bit rows [column quads, rows, 4], held as uint8
  w + 128 (vpdpbusd's unsigned operand), the columns padded to whole
  ACTIVATION_GROUPs."""
  if activation_bits not in (8, 16):
    raise ValueError(f"token rows are rounded to 8 or 16 bits, not {activation_bits}")
  n, k = q2d.shape
  wide, pad = (2, KERNEL_PAD) if activation_bits == 16 else (4, ACTIVATION_GROUP)
  t, kp = -(-n // KERNEL_TILE), -(-k // pad) * pad
  q = jnp.pad(q2d, ((0, t * KERNEL_TILE - n), (0, kp - k)))
  tiles = q.reshape(t, KERNEL_TILE, kp // wide, wide).transpose(0, 2, 1, 3)
  return tiles if activation_bits == 16 else (tiles.astype(jnp.int16) + 128).astype(jnp.uint8)


def untile_weights(tiles: Array, n: int, k: int) -> Int8[Array, "n k"]:
  """The [out, in] weight `tile_weights` made `tiles` from (either layout)."""
  t, groups, _, wide = tiles.shape
  if tiles.dtype == jnp.uint8:
    tiles = (tiles.astype(jnp.int16) - 128).astype(jnp.int8)
  return tiles.transpose(0, 2, 1, 3).reshape(t * KERNEL_TILE, wide * groups)[:n, :k]


@struct.dataclass
class QuantizedWeight:
  """A weight stored [out..., in...] as int8 `q` and the float32 `scale` of
  each output row (`scale.shape == q.shape[:scale.ndim]`): w = q * scale.

  It stands where a float weight array stands in a model's params (a Param's
  value), so it answers `w[...]`, `.shape` and a `.reshape` to the 2-D
  [out, in] form the product takes. `adapters`, when set, are low-rank
  adapters over its output rows that the product applies to chosen token
  rows in the same call. `tiles` (`tile_weights` of the [out, in] form) are
  what the CPU kernel reads; a weight only multiplied holds them alone
  (`without_rows`: `q` None, its shape kept), one also gathered from (an
  embedding table) both. Their layout says how the product rounds the token
  rows (`activation_bits`). With `layer` set, its arrays hold every layer's
  weight of this kind along a leading axis (`stack_layers`) and this is
  layer `layer` of them: the product reads that layer in place."""

  q: Int8[Array, "..."] | None
  scale: Float[Array, "..."]
  adapters: LowRank | None = None
  tiles: Int8[Array, "t p 32 2"] | None = None
  stored_shape: tuple[int, ...] = struct.field(pytree_node=False, default=())
  layer: int | None = struct.field(pytree_node=False, default=None)

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError("a QuantizedWeight is read whole (w[...])")
    return self

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.q.shape) if self.q is not None else self.stored_shape

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def activation_bits(self) -> int:
    """The bits the product rounds token rows to: 8 (in groups of
    ACTIVATION_GROUP columns) for uint8 tiles, else 16."""
    return 8 if self.tiles is not None and self.tiles.dtype == jnp.uint8 else 16

  def without_rows(self) -> "QuantizedWeight":
    """The same weight holding only its tiles (a weight no pass gathers from)."""
    if self.layer is not None:
      return self
    tiles = self.tiles if self.tiles is not None else tile_weights(self.matrix())
    return self.replace(q=None, tiles=tiles, stored_shape=self.shape)

  def one_layer(self) -> "QuantizedWeight":
    """This weight with arrays of its own (sliced out of a stack; itself if
    it is not one of a stack)."""
    if self.layer is None:
      return self
    take = lambda x: x[self.layer]  # noqa: E731
    adapters = None if self.adapters is None else jax.tree.map(take, self.adapters)
    return self.replace(scale=take(self.scale), tiles=take(self.tiles), adapters=adapters, layer=None)

  def matrix(self) -> Int8[Array, "n k"]:
    """The int8 values in the [out, in] form."""
    if self.layer is not None:
      return self.one_layer().matrix()
    n = self.scale.size
    if self.q is not None:
      return self.q.reshape(n, -1)
    return untile_weights(self.tiles, n, int(np.prod(self.shape)) // n)

  def reshape(self, *shape) -> "QuantizedWeight":
    """The [out, in] matrix form: its rows must be the output rows."""
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    total = int(np.prod(self.shape))
    rows = self.scale.size if self.layer is None else self.scale[0].size
    known = int(np.prod([d for d in shape if d != -1]))
    new = tuple(total // max(known, 1) if d == -1 else int(d) for d in shape)
    if len(new) != 2 or new[0] != rows or int(np.prod(new)) != int(np.prod(self.shape)):
      raise ValueError(f"a QuantizedWeight of {self.shape} reshapes to [out, in] with {rows} rows, not {shape}")
    q = None if self.q is None else self.q.reshape(new)
    scale = self.scale.reshape(-1) if self.layer is None else self.scale.reshape(self.scale.shape[0], -1)
    return self.replace(q=q, scale=scale, stored_shape=() if q is not None else new)

  def dequantize(self, dtype=jnp.float32) -> Array:
    if self.layer is not None:
      return self.one_layer().dequantize(dtype)
    q = self.matrix().reshape(self.shape)
    scale = self.scale.reshape(self.scale.shape + (1,) * (q.ndim - self.scale.ndim))
    return (q.astype(jnp.float32) * scale).astype(dtype)


def quantize(w: Float[Array, "..."], out_dims: int = 1, activation_bits: int = 16) -> QuantizedWeight:
  """Symmetric per-row int8 of a weight stored with its `out_dims` output
  dimensions first: each row's largest magnitude maps to 127. Its products
  round the token rows to `activation_bits` (8 or 16)."""
  w = jnp.asarray(w, jnp.float32)
  axes = tuple(range(out_dims, w.ndim))
  amax = jnp.max(jnp.abs(w), axis=axes)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(w / scale.reshape(scale.shape + (1,) * len(axes))), -127, 127).astype(jnp.int8)
  return QuantizedWeight(q, scale, tiles=tile_weights(q.reshape(scale.size, -1), activation_bits))


def stack_layers(weights: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
  """The same weights (one a layer, alike in shape, layout and adapters,
  holding their tiles only) as views of one stack of each of their arrays:
  weight i is layer i of it. A pass then hands XLA one operand per kind of
  weight instead of one per layer (a dispatch's cost grows with the count),
  and each product reads its layer in place."""
  if not weights:
    raise ValueError("no weights to stack")
  first = weights[0]
  for w in weights:
    if w.q is not None or w.layer is not None:
      raise ValueError("stack_layers takes weights holding their tiles alone (`without_rows`), none stacked yet")
    if (w.shape, w.tiles.dtype, w.adapters is None) != (first.shape, first.tiles.dtype, first.adapters is None):
      raise ValueError(f"stacked weights differ: {w.shape} {w.tiles.dtype} against {first.shape} {first.tiles.dtype}"
                       " (or one has adapters and another none)")
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *weights)
  return [stacked.replace(layer=i) for i in range(len(weights))]


ACTIVATION_MAX = 32767.0


def round_rows_to_int16(x2d: Float[Array, "m k"]) -> tuple[Float[Array, "m k"], Float[Array, "m"]]:
  """Each row as int16 values (held in float32) and its scale, as the kernel
  rounds it: the row's largest magnitude maps to 32767, halves to even."""
  amax = jnp.max(jnp.abs(x2d), axis=1)
  xs = jnp.where(amax > 0, amax / ACTIVATION_MAX, 1.0)
  return jnp.clip(jnp.round(x2d / xs[:, None]), -ACTIVATION_MAX, ACTIVATION_MAX), xs


def round_rows_to_int8_groups(x2d: Float[Array, "m k"]) -> tuple[Float[Array, "m kg"], Float[Array, "m g"]]:
  """Each row as int8 values (held in float32) in groups of ACTIVATION_GROUP
  columns, zeros past k, and each group's scale, as the 8-bit kernel rounds
  them: a group's largest magnitude maps to 127, halves to even."""
  m, k = x2d.shape
  kg = -(-k // ACTIVATION_GROUP) * ACTIVATION_GROUP
  xg = jnp.pad(x2d, ((0, 0), (0, kg - k))).reshape(m, kg // ACTIVATION_GROUP, ACTIVATION_GROUP)
  amax = jnp.max(jnp.abs(xg), axis=2)
  xs = jnp.where(amax > 0, amax / 127.0, 1.0)
  return jnp.clip(jnp.round(xg / xs[..., None]), -127.0, 127.0).reshape(m, kg), xs


def int8_matmul(x2d: Float[Array, "m k"], w: QuantizedWeight,
                adapter_rows: Bool[Array, "m"] | bool | None = None) -> Float[Array, "m n"]:
  """x2d [tokens, in], each row rounded to int16 (or to int8 in groups, as
  `w.activation_bits` says), times the 2-D [out, in] `w`:
  [tokens, out], float32. With `w.adapters`, the token rows `adapter_rows`
  says (None: all, False: none) also get the adapters' update, formed from the
  unrounded rows in float32."""
  if w.ndim != 2:
    raise ValueError(f"int8_matmul takes a 2-D [out, in] weight, got {w.shape}")
  x2d = x2d.astype(jnp.float32)
  layer = w.layer or 0
  use_kernel = x2d.shape[0] <= KERNEL_MAX_ROWS and jax.default_backend() == "cpu" and native_kernel_ready()
  if not use_kernel:
    w = w.one_layer()
  ad = None if adapter_rows is False else w.adapters
  rows = None
  if ad is not None:
    rows = (jnp.ones((x2d.shape[0],), jnp.float32) if adapter_rows is None
            else jnp.reshape(adapter_rows, (-1,)).astype(jnp.float32))

  bits = w.activation_bits

  def with_xla(x, q, scale):
    if bits == 16:
      xq, xs = round_rows_to_int16(x)
      y = jnp.einsum("mk,nk->mn", xq, q.astype(jnp.float32)) * xs[:, None] * scale
    else:
      xq, xs = round_rows_to_int8_groups(x)
      xr = (xq.reshape(*xs.shape, ACTIVATION_GROUP) * xs[..., None]).reshape(xq.shape)[:, :x.shape[1]]
      y = jnp.einsum("mk,nk->mn", xr, q.astype(jnp.float32)) * scale
    return y if ad is None else y + ad.delta(x) * rows[:, None]

  # Decided while tracing, not with lax.platform_dependent: its conditional
  # around every product kept XLA:CPU from running the passes at speed.
  if not use_kernel:
    return with_xla(x2d, w.matrix(), w.scale)
  out = jax.ShapeDtypeStruct((x2d.shape[0], w.shape[0]), jnp.float32)
  tiles = w.tiles if w.tiles is not None else tile_weights(w.q)  # made here, every call, for a bare weight
  plain, lora = (FFI_TARGET, LORA_FFI_TARGET) if bits == 16 else (A8_FFI_TARGET, A8_LORA_FFI_TARGET)
  if ad is None:
    return jax.ffi.ffi_call(plain, out)(x2d, tiles, w.scale, layer=np.int64(layer))
  if ad.at.dtype == jnp.bfloat16 and ad.b.dtype == jnp.bfloat16:
    lora += BF16
  elif ad.at.dtype != jnp.float32 or ad.b.dtype != jnp.float32:
    raise ValueError(f"adapters are held in float32 or bfloat16 alike, not {ad.at.dtype} and {ad.b.dtype}")
  return jax.ffi.ffi_call(lora, out)(x2d, tiles, w.scale, ad.at, ad.b, ad.ends, rows, layer=np.int64(layer))


_lock = threading.Lock()
_state: dict[str, object] = {}


def native_kernel_ready() -> bool:
  """Whether the C++ kernel is built and registered (building it on the first
  call); False, with one warning, where it cannot be built."""
  with _lock:
    if "ready" not in _state:
      try:
        lib = ctypes.cdll.LoadLibrary(_build())
        jax.ffi.register_ffi_target(FFI_TARGET, jax.ffi.pycapsule(lib.Int8Matmul), platform="cpu")
        jax.ffi.register_ffi_target(LORA_FFI_TARGET, jax.ffi.pycapsule(lib.Int8LoraMatmul), platform="cpu")
        jax.ffi.register_ffi_target(A8_FFI_TARGET, jax.ffi.pycapsule(lib.Int8A8Matmul), platform="cpu")
        jax.ffi.register_ffi_target(A8_LORA_FFI_TARGET, jax.ffi.pycapsule(lib.Int8A8LoraMatmul), platform="cpu")
        jax.ffi.register_ffi_target(LORA_FFI_TARGET + BF16, jax.ffi.pycapsule(lib.Int8Bf16LoraMatmul), platform="cpu")
        jax.ffi.register_ffi_target(A8_LORA_FFI_TARGET + BF16, jax.ffi.pycapsule(lib.Int8A8Bf16LoraMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_FFI_TARGET, jax.ffi.pycapsule(lib.CacheAttention), platform="cpu")
        jax.ffi.register_ffi_target(F32_ROWS_FFI_TARGET, jax.ffi.pycapsule(lib.F32RowsMatmul), platform="cpu")
        _state["f32_rows"] = bool(lib.F32RowsVectorized())
        _state["uses_amx"] = bool(lib.Int8ProductsUseAmx())
        _state["vectorized"] = bool(lib.CpuKernelsVectorized())
        _state["attention"] = bool(lib.CacheAttentionVectorized())
        _state["ready"] = True
      except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        print(f"the CPU kernels could not be built ({e}): int8 products use XLA's slower convert-then-dot"
              " (so --decode-dtype auto decodes in float32),"
              " decoding attention XLA's dots",
              file=sys.stderr)
        _state["ready"] = False
    return bool(_state["ready"])


def kernels_vectorized() -> bool:
  """Whether the built kernels run their vector paths (AVX-512 with VNNI).
  Without them their portable loops give the same values, slower: on an
  AVX2 CPU (AMD EPYC, 2 cores) the packaged default's revising pass of six
  columns took 119 ms in `w8a8` against 54 in float32 through XLA, and
  the attention of 512 queries over 1,024 slots 417 ms a layer against 23
  (docs/weight-layouts.md): the kernels are then not what runs by default."""
  return native_kernel_ready() and bool(_state.get("vectorized"))


def attention_ready() -> bool:
  """Whether the built decoding attention (`cpu_attention.py`) is vectorized
  (AVX2 with FMA, or AVX-512), so that it serves."""
  return native_kernel_ready() and bool(_state.get("attention"))


def f32_rows_ready() -> bool:
  """Whether the built float32 few-row products (`f32_rows.py`) are
  vectorized (AVX2 with FMA, or AVX-512), so that they serve."""
  return native_kernel_ready() and bool(_state.get("f32_rows"))


def products_use_amx() -> bool:
  """Whether the built kernel's 8-bit products of eight token rows or more run
  on Intel AMX's tile multiplies (the same bits as its VNNI path)."""
  return native_kernel_ready() and bool(_state.get("uses_amx"))


def _build(extra_flags: tuple[str, ...] = ()) -> str:
  """The compiled kernel's path in the cache, compiled (atomically) if absent.
  `extra_flags`: more compiler flags (the tests build the path without VNNI)."""
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not compiler:
    raise RuntimeError("no C++ compiler (set $CXX or install g++)")
  flags = ["-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17", "-w", *extra_flags]
  source = b""
  for name in _SOURCES + _HEADERS:
    with open(name, "rb") as f:
      source += f.read()
  key = hashlib.sha256(source + " ".join([compiler, *flags, jax.__version__]).encode()).hexdigest()[:16]
  root = os.environ.get("MDLM_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mdlm_jax")
  out_dir = os.path.join(root, "kernels")
  path = os.path.join(out_dir, f"cpu_kernels-{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(out_dir, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  try:
    subprocess.run([compiler, *flags, "-I", jax.ffi.include_dir(), "-I", _HERE, *_SOURCES, "-o", tmp], check=True,
                   capture_output=True, text=True)
    os.replace(tmp, path)
  except subprocess.CalledProcessError as e:
    raise RuntimeError(f"{compiler} failed: {e.stderr.strip()[-400:]}") from e
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path
