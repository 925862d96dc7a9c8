"""python -m mdlm_jax.bench kernels [--json] [--lengths 1024,4096,16384] [--chunked-tiles 64,128,256,512]
    [--int8-rows 1,4,8] [--f32-rows 1,6,7 [--f32-from-cache]] [--cache-attention-fill 160,400]

On a GPU or TPU: time each kernel against its XLA reference (flash attention
forward and forward+backward, the fused confidence head), with achieved
TFLOP/s and the compiled programs' temporary memory (flash attention's is
linear in L, the reference's quadratic). On CPU: the kernels' numerics in
interpret mode on small shapes, and a note that timings need an accelerator.
--chunked-tiles times the plain-JAX chunked attention by tile size on any
backend (on CPU, the one that runs from CHUNKED_FROM queries).
--int8-rows times the int8 decoding products of SmolLM2-135M's shapes (its
121 weights, random values, jitted as one chain of layers) at those token
rows, without adapters and with rank-16 adapters on half the rows (an
adapted model's noisy rows): what a decoding pass spends in the int8 kernel;
--int8-activations 8 times them with 8-bit token rows (the w8a8 decode dtype).
--f32-rows times SmolLM2-135M's float32 decoding products (`kernels/f32_rows.cc`,
the few-row products of an AVX2 CPU's float32 decoding) at those token rows, each
kind of weight over its 30 layers' distinct copies and the vocabulary head, with
the read rate each reaches: how far a revising pass's rows sit from one row's
read-bound step; and a whole pass's products in the model's order, the row
counts timed in turn (`in_order`: only side by side do they compare on a
machine whose read rate drifts). --f32-from-cache reads one layer's copy 30 times instead (from
the cache: the arithmetic's own rate).
--cache-attention-fill times the CPU attention kernel over a decoding pass's
cache (SmolLM2-135M's 30 layers, 9 query and 3 key/value heads of 64, eight
token rows, a 512-slot buffer) with that many slots filled, and XLA's path
beside it (`xla`).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax import kernels
from mdlm_jax.bench import common
from mdlm_jax.kernels.f32_rows import MAX_ROWS as F32_MAX_ROWS

MASKS = {"bidirectional": kernels.AttentionMask(), "causal": kernels.AttentionMask(kind="causal")}


def _fastest_and_median_ms(fn, *args, repeats: int) -> dict:
  """{"ms": fastest, "median_ms": median} of `repeats` warm calls."""
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return {"ms": 1e3 * min(times), "median_ms": 1e3 * float(np.median(times))}


def _time(fn, *args, repeats: int) -> float:
  """Seconds of the fastest of `repeats` warm calls."""
  return _fastest_and_median_ms(fn, *args, repeats=repeats)["ms"] / 1e3


def _temp_bytes(fn, *args) -> int | None:
  try:
    return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
  except Exception:  # not every backend reports it
    return None


def _attention_fns(mask, impl):
  def fwd(q, k, v):
    return kernels.attention(q, k, v, mask=mask, implementation=impl)

  def fwd_bwd(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def time_attention(lengths, a) -> dict:
  dt = jnp.dtype(a.dtype)
  out = {}
  for name, mask in MASKS.items():
    for length in lengths:
      rng = np.random.default_rng(length)
      q, k, v = (jnp.asarray(rng.normal(size=(a.batch, length, a.heads, a.head_dim)), dt) for _ in range(3))
      flops = 4 * a.batch * a.heads * length * length * a.head_dim * (0.5 if name == "causal" else 1.0)
      row = {}
      for impl, label in (("pallas", "kernel"), ("xla", "reference")):
        fwd, fwd_bwd = _attention_fns(mask, impl)
        try:
          t_f = _time(fwd, q, k, v, repeats=a.repeats)
          t_fb = _time(fwd_bwd, q, k, v, repeats=a.repeats)
          row[label] = {"fwd_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_fb, "fwd_tflops": flops / t_f / 1e12,
                        "fwd_bwd_tflops": 3.5 * flops / t_fb / 1e12,  # backward ~2.5x the forward's matmuls
                        "fwd_temp_bytes": _temp_bytes(fwd, q, k, v),
                        "fwd_bwd_temp_bytes": _temp_bytes(fwd_bwd, q, k, v)}
        except Exception as e:  # e.g. the reference's [L, L] scores do not fit
          row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      if "fwd_ms" in row["kernel"] and "fwd_ms" in row["reference"]:
        row["speedup_fwd"] = row["reference"]["fwd_ms"] / row["kernel"]["fwd_ms"]
        row["speedup_fwd_bwd"] = row["reference"]["fwd_bwd_ms"] / row["kernel"]["fwd_bwd_ms"]
      out[f"{name}/L={length}"] = row
  return out


def time_head(lengths, a) -> dict:
  dt = jnp.dtype(a.dtype)
  out = {}
  impls = ("pallas", "triton") if kernels.kernel_backend() == "gpu" else ("pallas",)
  for length in lengths:
    rng = np.random.default_rng(length)
    hidden = jnp.asarray(rng.normal(size=(a.batch, length, a.embed_dim)), dt)
    w = jnp.asarray(rng.normal(size=(a.embed_dim, a.vocab)) / np.sqrt(a.embed_dim), dt)
    bits = jax.random.bits(jax.random.key(0), (a.batch, length, a.vocab), jnp.uint32)
    flops = 2 * a.batch * length * a.embed_dim * a.vocab
    row = {}
    for impl in impls + ("xla",):
      fn = jax.jit(lambda h, w, b, impl=impl: kernels.confidence_head(h, w, b, kernels.HeadSettings(1.0, (0,)),
                                                                      implementation=impl))
      try:
        t = _time(fn, hidden, w, bits, repeats=a.repeats)
        row[impl] = {"ms": 1e3 * t, "tflops": flops / t / 1e12, "temp_bytes": _temp_bytes(fn, hidden, w, bits)}
      except Exception as e:  # jax-triton missing, or out of memory
        row[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    out[f"L={length}"] = row
  return out


def time_chunked_tiles(lengths, tiles, a) -> dict:
  """The XLA chunked attention (the CPU path from CHUNKED_FROM queries),
  forward and backward, by tile size, for each mask kind; on any backend.
  The BD3 mask's length is its [x_t ; x_0] layout's (blocks of 8)."""
  from mdlm_jax.kernels.chunked_attention import chunked_attention
  dt = jnp.dtype(a.dtype)
  masks = dict(MASKS, block_diffusion=kernels.AttentionMask(kind="block_diffusion", block_size=8))
  out = {}
  for name, mask in masks.items():
    for length in lengths:
      rng = np.random.default_rng(length)
      q, k, v = (jnp.asarray(rng.normal(size=(a.batch, length, a.heads, a.head_dim)), dt) for _ in range(3))
      row = {}
      for tile in tiles:
        fn = jax.jit(jax.grad(lambda q, k, v, tile=tile, mask=mask: jnp.sum(
            chunked_attention(q, k, v, mask, block_q=tile, block_k=tile).astype(jnp.float32)), argnums=(0, 1, 2)))
        row[f"tile={tile}"] = {"fwd_bwd_ms": 1e3 * _time(fn, q, k, v, repeats=a.repeats)}
      out[f"{name}/L={length}"] = row
  return out


def check_numerics() -> dict:
  """Max errors of the interpreted kernels against the references on small shapes."""
  rng = np.random.default_rng(0)
  b, l, h, d = 1, 40, 2, 16
  q, k, v = (jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.float32) for _ in range(3))
  masks = dict(MASKS, block_diffusion=kernels.AttentionMask(kind="block_diffusion", block_size=4),
               prefix=kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(rng.integers(1, l + 1, (b, l)), jnp.int32),
                                            kv_valid=jnp.ones((b, l), bool)))
  blocks = kernels.BlockSizes(16, 16, 16, 16, 16, 16)
  out = {}
  for name, mask in masks.items():
    def loss(fn):
      return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))
    got = loss(lambda q, k, v: kernels.flash_attention(q, k, v, mask, block_sizes=blocks, interpret=True))(q, k, v)
    ref = loss(lambda q, k, v: kernels.attention_reference(q, k, v, mask=mask))(q, k, v)
    out[f"attention/{name}"] = {
        "loss_rel_err": abs(float(got[0]) - float(ref[0])) / abs(float(ref[0])),
        "grad_max_abs_err": max(float(jnp.abs(x - y).max()) for x, y in zip(got[1], ref[1]))}
  hidden = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(32, 300)) / 6, jnp.float32)
  bits = jax.random.bits(jax.random.key(1), (2, 8, 300), jnp.uint32)
  st = kernels.HeadSettings(1.0, (0,))
  got = jax.jit(lambda h: kernels.confidence_head_pallas(h, w, bits, st, interpret=True))(hidden)
  ref = kernels.confidence_head_reference(hidden, w, bits, st)
  out["confidence_head"] = {"tokens_equal": bool((np.asarray(got[0]) == np.asarray(ref[0])).all()),
                            "prob_max_abs_err": float(jnp.abs(got[1] - ref[1]).max())}
  return out


# SmolLM2-135M: per layer the joined q/k/v, o, the joined gate/up and down
# weights ([out, in], adapter parts), then the vocabulary head.
SMOLLM2_LAYER = {"qkv": (960, 576, 3), "o": (576, 576, 1), "gate_up": (3072, 576, 2), "down": (576, 1536, 1)}
SMOLLM2_LAYERS, SMOLLM2_HEAD = 30, (49152, 576)


def time_int8_products(rows_list, repeats: int, rank: int = 16, layers: int = SMOLLM2_LAYERS,
                       activation_bits: int = 16) -> dict:
  """Milliseconds of SmolLM2-135M's int8 products at each token-row count
  (fastest of `repeats` and the median), plain and with adapters on the
  second half of the rows, and the multiply-accumulates a second; `layers`
  fewer than its 30 for a quick look; token rows rounded to
  `activation_bits` (16, or 8 as the "w8a8" decode dtype)."""
  from mdlm_jax.kernels import int8
  rng = np.random.default_rng(0)

  def weight(n, k, parts, adapted):
    w = int8.quantize(jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32),
                      activation_bits=activation_bits).without_rows()
    if adapted and parts:
      pieces = [(rng.standard_normal((k, rank)).astype(np.float32) * 0.05,
                 rng.standard_normal((rank, n // parts)).astype(np.float32) * 0.05) for _ in range(parts)]
      w = w.replace(adapters=int8.join_adapters(pieces, 1.0))
    return w

  def chain(x, layers, head, rows):
    for w in layers:  # the products' dependencies as a model's, with cheap nonlinearities between them
      h = int8.int8_matmul(x, w["qkv"], rows)[:, :x.shape[1]]
      h = int8.int8_matmul(jnp.tanh(h), w["o"], rows)
      g = int8.int8_matmul(h, w["gate_up"], rows)
      half = g.shape[1] // 2
      x = x + int8.int8_matmul(jnp.tanh(g[:, :half]) * g[:, half:], w["down"], rows)
    return int8.int8_matmul(x, head, False)

  chain = jax.jit(chain)
  macs = layers * sum(n * k for n, k, _ in SMOLLM2_LAYER.values()) + SMOLLM2_HEAD[0] * SMOLLM2_HEAD[1]
  out = {"weights": macs, "layers": layers, "activation_bits": activation_bits,
         "native_kernel": int8.native_kernel_ready(), "amx": int8.products_use_amx()}
  head = weight(*SMOLLM2_HEAD, 0, False)
  for adapted in (False, True):
    stack = [{name: weight(*shape, adapted) for name, shape in SMOLLM2_LAYER.items()} for _ in range(layers)]
    for m in rows_list:
      x = jnp.asarray(rng.standard_normal((m, SMOLLM2_HEAD[1])), jnp.float32)
      timed = _fastest_and_median_ms(chain, x, stack, head, jnp.arange(m) >= m // 2, repeats=repeats)
      out[f"{'adapted' if adapted else 'plain'}_rows{m}"] = {**timed, "gmac_per_s": macs * m / timed["ms"] / 1e6}
  return out


def time_f32_products(rows_list, repeats: int, layers: int = SMOLLM2_LAYERS, from_cache: bool = False) -> dict:
  """Milliseconds (fastest of `repeats` and the median) and GB/s read of
  SmolLM2-135M's float32 few-row products at each token-row count: each kind
  of weight over `layers` distinct copies (one copy read `layers` times with
  `from_cache`), the vocabulary head, and their sum as a pass reads them."""
  from mdlm_jax.kernels import f32_rows
  if not f32_rows.serves(jnp.zeros((1, 8), jnp.float32), jnp.zeros((8, 8), jnp.float32)):
    raise ValueError("--f32-rows: the float32 few-row kernel does not serve on this machine"
                     " (a CPU whose kernels build with AVX2 and FMA or AVX-512)")
  bad = [m for m in rows_list if m > f32_rows.MAX_ROWS]
  if bad:
    raise ValueError(f"--f32-rows: the kernel takes 1 to {f32_rows.MAX_ROWS} token rows, got {bad[0]}")
  rng = np.random.default_rng(0)
  product = jax.jit(lambda x, ws: sum(f32_rows.matmul(x, w)[0, 0] for w in ws))
  kinds = {name: (n, k) for name, (n, k, _) in SMOLLM2_LAYER.items()}
  out = {"layers": layers, "from_cache": from_cache}
  for name, (n, k) in {**kinds, "head": SMOLLM2_HEAD}.items():
    copies = 1 if name == "head" else layers
    stack = [jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32) for _ in range(1 if from_cache else copies)]
    stack = stack * (copies // len(stack))
    for m in rows_list:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
      timed = _fastest_and_median_ms(product, x, stack, repeats=repeats)
      out.setdefault(f"rows{m}", {})[name] = {**timed, "gb_per_s": copies * n * k * 4 / timed["ms"] / 1e6}
  for m in rows_list:
    row = out[f"rows{m}"]
    row["pass_ms"] = sum(v["ms"] for v in row.values())
  out["in_order"] = time_f32_pass_in_order(rows_list, repeats, layers, from_cache, rng)
  return out


def time_f32_pass_in_order(rows_list, repeats: int, layers: int, from_cache: bool, rng) -> dict:
  """Milliseconds (fastest and median) of a whole pass's float32 products in
  the model's order (each layer's q/k/v, output, gate/up and down, then the
  head, each product's input made from the last one's output) at each row
  count, the row counts timed in turn for `repeats` rounds: this machine's
  read rate drifts by half between minutes, so only counts timed side by
  side compare. A revising pass of m columns runs m + 1 rows through the
  head (`vs_rows1`: its time over one row's, the AR step's)."""
  from mdlm_jax.kernels import f32_rows
  kinds = list(SMOLLM2_LAYER.items())
  copies = 1 if from_cache else layers
  stack = [[jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.float32) for _, (n, k, _) in kinds]
           for _ in range(copies)]
  weights = [w for layer in range(layers) for w in stack[layer % copies]]
  head = jnp.asarray(rng.standard_normal(SMOLLM2_HEAD) * 0.05, jnp.float32)

  def chain(x, weights, head):
    h = x
    for w in weights:
      y = f32_rows.matmul(jnp.resize(h, (h.shape[0], w.shape[1])), w)
      h = x + 1e-3 * y[:, :x.shape[1]]
    rows = jnp.concatenate([h, h[:1]]) if h.shape[0] > 1 else h
    return f32_rows.matmul(rows, head)[:, 0].sum()

  chain = jax.jit(chain)
  xs = {m: jnp.asarray(rng.standard_normal((m, SMOLLM2_HEAD[1])), jnp.float32) for m in rows_list}
  times = {m: [] for m in rows_list}
  for m in rows_list:
    jax.block_until_ready(chain(xs[m], weights, head))  # compile and warm up
  for _ in range(repeats):
    for m in rows_list:
      t0 = time.perf_counter()
      jax.block_until_ready(chain(xs[m], weights, head))
      times[m].append(time.perf_counter() - t0)
  out = {f"rows{m}": {"ms": 1e3 * min(t), "median_ms": 1e3 * float(np.median(t))} for m, t in times.items()}
  if 1 in rows_list:
    for m in rows_list:
      out[f"rows{m}"]["vs_rows1"] = float(np.median(times[m]) / np.median(times[1]))
  return out


def time_cache_attention(fills, repeats: int, rows: int = 8, layers: int = SMOLLM2_LAYERS) -> dict:
  """Milliseconds of the CPU cache-attention kernel for one pass of
  SmolLM2-135M's shapes (fastest of `repeats` and the median) with each
  count of filled slots: `rows` queries ending at the last filled slot, as a
  revising pass's block reads the prompt and the answer so far; beside it
  (`xla`), the same attention through XLA's path (the layer's filled span
  sliced out, dots and a softmax), the two timed in turn."""
  from mdlm_jax.kernels import cpu_attention
  heads, groups, dim, slots = 9, 3, 64, 512
  rng = np.random.default_rng(0)
  keys = jnp.asarray(rng.standard_normal((layers, 1, groups, dim, slots)), jnp.float32)
  values = jnp.asarray(rng.standard_normal((layers, 1, groups, slots, dim)), jnp.float32)

  def chain(attend):
    def run(q, keys, values, mask):
      for layer in range(layers):  # each layer's queries depend on the last's output, as in a pass
        q = q + 1e-3 * attend(q, keys, values, layer, mask)
      return q
    return jax.jit(run)

  kernel = chain(cpu_attention.cpu_cache_attention)
  xla = chain(lambda q, k, v, layer, mask: kernels._xla_cache_attention(
      q, k, v, mask, layer=layer, causal=False, implementation="xla", block_sizes=None))
  bad = [f for f in fills if not rows <= f <= slots]
  if bad:  # before any compiles
    raise ValueError(f"--cache-attention-fill: each count must be in [{rows}, {slots}], got {bad[0]}")
  out = {"layers": layers, "rows": rows, "slots": slots}
  for filled in fills:
    q = jnp.asarray(rng.standard_normal((1, rows, heads, dim)), jnp.float32)
    mask = kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(filled - rows + 1 + np.arange(rows))[None],
                                 kv_valid=jnp.asarray(np.arange(slots) < filled)[None])
    times = {"kernel": [], "xla": []}
    for fn in (kernel, xla):
      jax.block_until_ready(fn(q, keys, values, mask))  # compile and warm up
    for _ in range(repeats):
      for name, fn in (("kernel", kernel), ("xla", xla)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, keys, values, mask))
        times[name].append(time.perf_counter() - t0)
    ms = {name: {"ms": 1e3 * min(t), "median_ms": 1e3 * float(np.median(t))} for name, t in times.items()}
    out[f"filled{filled}"] = {**ms["kernel"], "xla": ms["xla"]}
  return out


def main(argv):
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.bench kernels",
                              description="Pallas / jax-triton kernels against their XLA references.")
  p.add_argument("--lengths", default="1024,4096,16384", help="sequence lengths to time (accelerators only)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--embed-dim", type=int, default=1024, help="confidence head: hidden size")
  p.add_argument("--vocab", type=int, default=32768, help="confidence head: vocabulary size")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--chunked-tiles", default=None,
                 help="also time the XLA chunked attention (forward+backward) at these tile sizes, e.g."
                      " 64,128,256,512, on any backend, at --lengths")
  p.add_argument("--int8-rows", default=None,
                 help="also time SmolLM2-135M's int8 decoding products at these token rows, e.g. 1,4,8 (CPU)")
  p.add_argument("--int8-layers", type=int, default=SMOLLM2_LAYERS, help="layers of those products (default: all 30)")
  p.add_argument("--int8-activations", type=int, choices=(8, 16), default=16,
                 help="bits those products round the token rows to: 16 (the int8 decode dtype) or 8 (w8a8)")
  p.add_argument("--f32-rows", default=None,
                 help="also time SmolLM2-135M's float32 few-row products at these token rows, e.g. 1,6,7 (CPU)")
  p.add_argument("--f32-from-cache", action="store_true",
                 help="those products over one layer's weights read 30 times (from the cache), not 30 copies")
  p.add_argument("--cache-attention-fill", default=None,
                 help="also time the CPU attention kernel over a decoding pass's cache with these slots filled,"
                      " e.g. 160,400 (CPU)")
  common.add_output_flags(p)
  a = p.parse_args(argv)
  lengths = common.positive_ints(p, "--lengths", a.lengths)
  tiles = common.positive_ints(p, "--chunked-tiles", a.chunked_tiles) if a.chunked_tiles else None
  if tiles and any(n % 16 for n in lengths):
    p.error(f"--chunked-tiles times the BD3 mask over [x_t ; x_0] in blocks of 8: --lengths must be multiples"
            f" of 16, got {a.lengths}")
  for flag in ("batch", "heads", "head_dim", "embed_dim", "vocab", "repeats", "int8_layers"):
    if getattr(a, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(a, flag)}")
  if a.f32_from_cache and not a.f32_rows:
    p.error("--f32-from-cache times the products --f32-rows names: give --f32-rows too")
  f32_rows = common.positive_ints(p, "--f32-rows", a.f32_rows) if a.f32_rows else []
  if f32_rows and max(f32_rows) > F32_MAX_ROWS:  # before any compiles
    p.error(f"--f32-rows: the kernel takes 1 to {F32_MAX_ROWS} token rows, got {max(f32_rows)}")
  result = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind)}
  if kernels.kernel_backend() is None:
    result.update(timed=False, note="timings need a GPU or TPU; on this backend the kernels' numerics were"
                                    " checked in Pallas interpret mode instead", numerics=check_numerics())
  else:
    result.update(timed=True, dtype=a.dtype, attention=time_attention(lengths, a), confidence_head=time_head(lengths, a))
  if tiles:
    result["chunked_attention"] = time_chunked_tiles(lengths, tiles, a)
  if a.int8_rows:
    result["int8_products"] = time_int8_products(common.positive_ints(p, "--int8-rows", a.int8_rows),
                                                 max(a.repeats, 10), layers=a.int8_layers,
                                                 activation_bits=a.int8_activations)
  if a.f32_rows:
    try:
      result["f32_products"] = time_f32_products(f32_rows, max(a.repeats, 10), from_cache=a.f32_from_cache)
    except ValueError as e:
      p.error(str(e))
  if a.cache_attention_fill:
    fills = common.positive_ints(p, "--cache-attention-fill", a.cache_attention_fill)
    try:
      result["cache_attention"] = time_cache_attention(fills, max(a.repeats, 50))
    except ValueError as e:
      p.error(str(e))
  common.emit(result, a)
