"""Text in, text out: tokenizes prompts, builds the canvas, runs a sampler
under jit (compiled once per sampler and canvas shape), and trims the result
at EOS and stop strings."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax import kernels
from mdlm_jax.parallel import sharding
from mdlm_jax.checkpoints.loading import LoadedModel
from mdlm_jax.data import fim
from mdlm_jax.data.tokenizer import never_generated
from mdlm_jax.model.spec import bind, decoding_pair, for_decoding, resolve_decode_dtype
from mdlm_jax.model.layers import FEW_ROWS
from mdlm_jax.sampling.canvas import Canvas, bucket, make_canvas
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.finish import finish
from mdlm_jax.sampling.samplers import AncestralSampler, Layout, block_causal_mask


@dataclasses.dataclass
class Completion:
  text: str
  tokens: list[int]
  finish_reason: str  # "stop" (EOS or a stop string) or "length"
  prompt_tokens: int
  drafts: list[str] | None = None


@dataclasses.dataclass
class Result:
  completions: list[Completion]
  forward_passes: int
  steps: int
  seconds: float


MASK_TEXT = "\u2591"  # how a [MASK] shows in a draft


def draft_text(tok, ids, mask_text: str = MASK_TEXT) -> str:
  """A partially masked token row as text, each [MASK] shown as `mask_text`."""
  pieces, run = [], []
  for t in np.asarray(ids).tolist():
    if t == tok.mask_id:
      if run:
        pieces.append(tok.decode(run))
        run = []
      pieces.append(mask_text)
    else:
      run.append(t)
  if run:
    pieces.append(tok.decode(run))
  return "".join(pieces)


class Generator:
  """Samples from a loaded MDLM checkpoint (any diffusion sampler)."""

  def __init__(self, loaded: LoadedModel, mesh=None, weight_layout: str | None = None,
               decode_dtype: str = "float32", draft_table: bool = True):
    """`mesh`: run under this mesh (params as loaded onto it, the batch of
    rows sharded over 'data' x 'fsdp'); None: wherever the params live.
    `weight_layout`: decode from a copy of the weights in this layout. By
    default, on CPU, calls whose passes carry few token rows read an [out, in]
    copy and larger ones the trained layout (`model.spec.decoding_pair`).
    `decode_dtype="int8"` (or "w8a8"): that few-row copy holds int8 weights;
    "auto": the fastest where the weights live (`resolve_decode_dtype`).
    `draft_table`: revising samplers with `lookup` also draft from the
    model's table of its own answers, where it has one (`sampling.draft_table`)."""
    self.decode_dtype = decode_dtype = resolve_decode_dtype(loaded, decode_dtype, weight_layout)
    self._few, self._many = decoding_pair(loaded, weight_layout, decode_dtype)
    loaded = self._few
    self.loaded, self.mesh = loaded, mesh
    self.tok = loaded.tokenizer
    self.draft_table = loaded.draft_table if draft_table else None
    self.time_conditioned = bool(loaded.spec.cfg.time_conditioning)
    if loaded.spec.cfg.causal:
      raise ValueError("this checkpoint is an autoregressive model; use the AR sampler")
    # The compiled decoding of one canvas: (params, tokens, valid, positions, keys; sampler, layout,
    # record, stream, many) -> the sampler's outputs. `generate` builds the canvas and calls it.
    self.decode_canvas = jax.jit(self._decode_canvas,
                                 static_argnames=("sampler", "layout", "record", "stream", "many"))
    self.fim = fim.format_for(loaded.config, self.tok)  # infill in the FIM format a checkpoint was trained with
    self._on_step = None  # the current call's draft handler (see `stream`)

  def weight_layout_for(self, token_rows: int) -> str:
    """The weight layout a call reads whose passes carry this many token rows."""
    return (self._many if token_rows > FEW_ROWS else self._few).spec.cfg.weight_layout

  def _emit(self, step, tokens):
    """The one host callback compiled into streaming programs; it forwards to
    the current call's handler, so streaming calls reuse one compilation."""
    if self._on_step is not None:
      self._on_step(step, tokens)

  def _decode_canvas(self, params, tokens, valid, positions, keys, table=None, *, sampler, layout, record,
                     stream=False, many=False):
    """`many`: `params` are those of the model for passes over many rows."""
    emit = self._emit if stream else None
    spec = (self._many if many else self._few).spec
    model = bind(spec, params)
    B, L = tokens.shape
    if getattr(sampler, "is_block_causal", False):
      attn_mask = block_causal_mask(valid, layout, sampler.block_size)
    else:
      attn_mask = kernels.AttentionMask(kv_valid=valid)  # never attend to padding
    tc, cfg = self.time_conditioned, spec.cfg

    class Denoiser:
      """The model as the samplers see it: full-canvas passes, or cached blocks."""

      def __call__(self, toks, t):
        return model(toks, t if tc else None, positions, attn_mask)

      def cached(self, toks, pos, cache, commit, valid_new, commit_len=None, new_block=0, head=False,
                 **prefill):
        """`prefill`: forward_cached's `last_only` and `clean`."""
        frac = jnp.mean(toks == layout.mask_id, axis=-1).astype(jnp.float32)
        return model.forward_cached(toks, pos, cache, commit=commit, valid_new=valid_new,
                                    t=frac if tc else None, commit_len=commit_len, new_block=new_block, head=head,
                                    **prefill)

      def speculative(self, toks, pos, cache, head_valid, widths=(), need=None):
        return model.forward_speculative(toks, pos, cache, head_valid, widths, need)

      def new_cache(self, batch, max_len, per_row=False):
        return KVCache.init(cfg, batch, max_len, per_row=per_row)

    denoiser = Denoiser()
    denoiser.positions = positions  # the canvas's RoPE positions, for cached blocks
    denoiser.draft_table = table
    return sampler.run(denoiser, tokens, valid, keys, layout, record, emit)

  def encode_prompt(self, text: str, add_bos: bool = True) -> list[int]:
    return ([self.tok.bos_id] if add_bos and self.tok.adds_bos else []) + self.tok.encode(text)

  def generate(self, prompts: Sequence[str], *, max_new_tokens: int, sampler, seed: int = 0,
               suffixes: Sequence[str] | None = None, stop: Sequence[str] = (), record_drafts: bool = False,
               add_bos: bool = True, on_draft=None) -> Result:
    """`on_draft(step, drafts)`, if given, is called on the host after every
    refinement step with each row's generation region as text ([MASK] as a
    shaded block), while the loop is still running."""
    ids = [self.encode_prompt(p, add_bos) for p in prompts]
    suf = [self.tok.encode(s) for s in suffixes] if suffixes is not None else None
    if suf is not None and self.fim is not None:  # trained with FIM: the PSM prompt, no suffix in view
      ids = [self.fim.prompt(self.tok.bos_id if add_bos and self.tok.adds_bos else None, self.tok.encode(p), s)
             for p, s in zip(prompts, suf)]
      suf = None
    gen_len = max_new_tokens
    cached = getattr(sampler, "kv_cache", False)
    if getattr(sampler, "is_block_causal", False):
      if suf is not None and any(suf) and not cached:
        raise ValueError("uncached block-causal decoding cannot see a suffix; infill with kv_cache=True (the"
                         " suffix is encoded into the cache) or with a bidirectional sampler")
      if sampler.block_size <= 0:
        raise ValueError("block-causal decoding needs block_size > 0")
      if not getattr(sampler, "revise", False):  # a revising pass slides with the text: it ends anywhere
        gen_len = -(-max_new_tokens // sampler.block_size) * sampler.block_size  # whole blocks; cut below
    canvas = make_canvas(ids, gen_len, mask_id=self.tok.mask_id, pad_id=self.tok.pad_id, suffixes=suf)
    suffix_len = 0
    if suf is not None and any(suf):
      end = canvas.gen_start + canvas.gen_len
      suffix_len = canvas.shape[1] - end if cached else 0
      # The suffix starts right after max_new_tokens (the blocks' extra tokens are cut).
      canvas.positions[:, end:] -= gen_len - max_new_tokens
    layout = Layout(canvas.gen_start, canvas.gen_len, self.tok.mask_id, self.tok.eos_id, suffix_len,
                    read_only_ids=never_generated(self.tok))
    if on_draft is not None:
      def on_step(step, tokens):
        tokens = np.asarray(tokens)
        on_draft(int(step), [self.draft_text(self.region(canvas, tokens, r)) for r in range(len(prompts))])
      self._on_step = on_step
    # Row i draws from seed + i: the same as a request with that seed alone (the engine's, or n > 1).
    keys = np.asarray(rule.row_keys(seed + np.arange(len(prompts))))
    arrays = [jnp.asarray(x) for x in (canvas.tokens, canvas.valid, canvas.positions, keys)]
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
      if self.mesh is not None:
        stack.enter_context(jax.set_mesh(self.mesh))
        rows = sharding.batch_sharding(self.mesh)
        if len(prompts) % (self.mesh.shape["data"] * self.mesh.shape["fsdp"]):
          raise ValueError(f"{len(prompts)} rows do not divide over the mesh's data x fsdp axes")
        arrays = [jax.device_put(x, rows) for x in arrays]
      # A cached block pass carries the block and the finished one before it;
      # an uncached pass the whole canvas.
      per_row = 2 * sampler.block_size if getattr(sampler, "kv_cache", False) else canvas.tokens.shape[1]
      many = len(prompts) * per_row > FEW_ROWS
      try:
        table = self.draft_table if getattr(sampler, "revise", False) and getattr(sampler, "lookup", 0) else None
        out = self.decode_canvas((self._many if many else self._few).params, *arrays, table, sampler=sampler,
                                 layout=layout,
                                record=record_drafts, stream=on_draft is not None, many=many)
        out = jax.device_get(out)
      finally:
        self._on_step = None
    seconds = time.perf_counter() - t0
    completions = [self._finish(canvas, out, i, ids[i], stop, record_drafts, max_new_tokens)
                   for i in range(len(prompts))]
    return Result(completions, int(out["nfe"]), int(out["steps"]), seconds)

  def nelbo_per_token(self, rows: Sequence[Sequence[int]], *, time_samples: int = 16, seed: int = 0) -> np.ndarray:
    """NELBO (nats/token) of each token row under the model's own objective,
    at fixed (seeded, stratified) times: comparable across rows and calls."""
    from mdlm_jax.training.evaluation import Scorer
    key = (time_samples, seed)
    if getattr(self, "_scorer_key", None) != key:  # whole-row passes: the layout for many rows
      self._scorer = Scorer.for_model(self._many, time_samples=time_samples, seed=seed)
      self._scorer_key = key
    nll, count = self._scorer(rows)
    return nll / count

  def infill(self, prefix: str, suffix: str, *, sampler, lengths: Sequence[int] = (8, 16, 32, 64), seed: int = 0,
             time_samples: int = 16) -> tuple[Completion, dict[int, float]]:
    """Fills the middle at each candidate length and keeps the one whose whole
    text (prefix + middle + suffix) the model finds most likely per token."""
    if not lengths or min(lengths) < 1:
      raise ValueError(f"infill lengths must be positive, got {list(lengths)}")
    results = {n: self.generate([prefix], max_new_tokens=n, sampler=sampler, seed=seed, suffixes=[suffix])
               for n in lengths}
    rows = [self.encode_prompt(prefix) + r.completions[0].tokens + self.tok.encode(suffix) for r in results.values()]
    scores = dict(zip(results, self.nelbo_per_token(rows, time_samples=time_samples, seed=seed).tolist()))
    best = min(scores, key=scores.get)
    return results[best].completions[0], scores

  def region(self, canvas: Canvas, tokens: np.ndarray, row: int) -> np.ndarray:
    return tokens[row, canvas.gen_start:canvas.gen_start + canvas.gen_len]

  def _finish(self, canvas, out, row, prompt_ids, stop, record, max_new_tokens) -> Completion:
    gen = self.region(canvas, out["tokens"], row)[:max_new_tokens]
    end = finish(self.tok, gen[gen != self.tok.mask_id], max_tokens=max_new_tokens, stop=stop)
    drafts = None
    if record:
      drafts = [self.draft_text(self.region(canvas, out["drafts"][i], row))
                for i in range(int(out["num_drafts"]))]
    return Completion(end.text, end.tokens, end.reason, len(prompt_ids), drafts)

  def draft_text(self, region: np.ndarray, mask_text: str = MASK_TEXT) -> str:
    return draft_text(self.tok, region, mask_text)


def prompt_width(length: int) -> int:
  """The padded prompt width of an AR call: the next multiple of 16, as the
  diffusion canvas pads its prompts (`canvas.bucket`), so that an AR base and
  its adapted model pay the same prefill for one prompt. (A power of two
  shared programs among more lengths, but a 155-token prompt prefilled 256.)"""
  return bucket(length, 16)


class ARGenerator:
  """The AR twin behind the same text-in/text-out interface (KV-cached decoding)."""

  def __init__(self, loaded: LoadedModel, mesh=None, weight_layout: str | None = None,
               decode_dtype: str = "float32", draft_table: bool = True):
    if not loaded.spec.cfg.causal:
      raise ValueError("this checkpoint is a diffusion model; use Generator")
    self.decode_dtype = decode_dtype = resolve_decode_dtype(loaded, decode_dtype, weight_layout)
    loaded = for_decoding(loaded, weight_layout, decode_dtype)
    self.loaded, self.mesh, self.tok = loaded, mesh, loaded.tokenizer
    self.fim = fim.format_for(loaded.config, self.tok)  # a twin trained with FIM infills from the PSM prompt

  def encode_prompt(self, text: str, add_bos: bool = True, suffix: str | None = None) -> list[int]:
    if suffix is None:
      return ([self.tok.bos_id] if add_bos and self.tok.adds_bos else []) + self.tok.encode(text)
    if self.fim is None:
      raise ValueError("this autoregressive checkpoint was not trained with fill-in-the-middle (data.fim_rate),"
                       " so it cannot infill: leave out the suffix")
    bos = self.tok.bos_id if add_bos and self.tok.adds_bos else None
    return self.fim.prompt(bos, self.tok.encode(text), self.tok.encode(suffix))

  def generate(self, prompts: Sequence[str], *, max_new_tokens: int, sampler=None, seed: int = 0,
               stop: Sequence[str] = (), add_bos: bool = True, temperature: float = 0.0,
               top_p: float = 1.0, suffixes: Sequence[str] | None = None, **unused) -> Result:
    from mdlm_jax.sampling.ar import ARSampler
    sampler = sampler or ARSampler(max_new_tokens, temperature=temperature, top_p=top_p)
    sampler = dataclasses.replace(sampler, never=tuple(sorted({*sampler.never, *never_generated(self.tok)})))
    if suffixes is not None and len(suffixes) != len(prompts):
      raise ValueError(f"{len(suffixes)} suffixes for {len(prompts)} prompts")
    ids = [self.encode_prompt(p, add_bos, None if suffixes is None else suffixes[i]) for i, p in enumerate(prompts)]
    width = prompt_width(max(len(i) for i in ids))
    tokens = np.full((len(ids), width), self.tok.pad_id, np.int32)
    valid = np.zeros((len(ids), width), bool)
    for r, row in enumerate(ids):
      tokens[r, width - len(row):], valid[r, width - len(row):] = row, True
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
      arrays = [jnp.asarray(tokens), jnp.asarray(valid)]
      if self.mesh is not None:
        stack.enter_context(jax.set_mesh(self.mesh))
        arrays = [jax.device_put(x, sharding.batch_sharding(self.mesh)) for x in arrays]
      out = jax.device_get(sampler.generate(self.loaded.spec, self.loaded.params, *arrays, jax.random.PRNGKey(seed),
                                            eos_id=self.tok.eos_id, pad_id=self.tok.pad_id))
    seconds = time.perf_counter() - t0
    completions = []
    for r in range(len(ids)):
      # The row's tokens, then the EOS that ended it (if any), then padding.
      end = finish(self.tok, out["tokens"][r], max_tokens=sampler.max_new_tokens, stop=stop)
      completions.append(Completion(end.text, end.tokens, end.reason, len(ids[r])))
    n = int(out["num_forward_passes"])
    return Result(completions, n, n, seconds)


def generator_for(loaded: LoadedModel, mesh=None, decode_dtype: str = "float32"):
  cls = ARGenerator if loaded.spec.cfg.causal else Generator
  return cls(loaded, mesh, decode_dtype=decode_dtype)


__all__ = ["ARGenerator", "generator_for", "Generator", "Completion", "Result", "AncestralSampler"]
