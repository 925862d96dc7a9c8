"""Continuous batching: requests join free slots as they arrive and leave when done.

One background thread owns the device state. Each turn it admits waiting
requests into free slots (those waiting together share prefills: a short
prefill costs its dispatch more than its tokens), runs one refinement pass
over all slots (with the finished blocks that wait for the cache, or, when
few wait, a pass half as long without them; constrained rows get the host's
grammar commits in the same program), and turns the new state into events
for each request: the current
draft (for clients watching the diffusion), text committed since the last
turn (a finished block never changes again), and the end. Cancelling a
request frees its slot at the next turn.

Everything a turn does to the device state is first written down as a `Turn`
(slots to free, requests to admit, the pass to run). With several processes
(one per host, the mesh spanning them all) process 0 plans each turn and
broadcasts it, and every process applies it, so the sharded state changes in
lockstep; the other processes run `follow()` instead of serving requests.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from mdlm_jax import kernels
from mdlm_jax.checkpoints.loading import LoadedModel
from mdlm_jax.data import fim
from mdlm_jax.data.tokenizer import never_generated
from mdlm_jax.model.spec import decoding_pair, next_token_view, resolve_decode_dtype
from mdlm_jax.model.transformer import INT8_ACTIVATION_BITS
from mdlm_jax.engine import slots as slots_lib
from mdlm_jax.engine.requests import ContextLengthExceeded, EngineClosed, Event, QueueFull, Request
from mdlm_jax.engine.handle import Handle
from mdlm_jax.engine.publishing import Snapshot, events_for
from mdlm_jax.engine.scheduling import (MIN_PREFILL_CHUNK, admit_groups, admit_sizes, pass_size, prompt_bucket,
                                        ride_with_head)
from mdlm_jax.engine.turns import Turn, decode as decode_turn, encode as encode_turn
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model.layers import FEW_ROWS
from mdlm_jax.sampling import grammar as grammar_lib
from mdlm_jax.sampling import presets, rule
from mdlm_jax.sampling.generate import MASK_TEXT
from mdlm_jax.sampling.samplers import RULES, ConfidenceSampler


# Passes one launch runs while no host decision falls between them: the host's
# work a turn (about 0.6 ms against a 16 ms pass of the packaged default on a
# 2-core CPU) is then paid once for four passes, and a waiting request or a
# stop string waits at most three passes more.
PASSES_PER_TURN = 4


def _heads_first(sampler) -> bool:
  """Whether a request's first head is proposed at admission (`slots.admit`'s
  `first`): it revises with copies and the table and without the model's
  drafts, as the one-shot generator's first head is."""
  return bool(getattr(sampler, "revises", False) and getattr(sampler, "lookup", 0)
              and not getattr(sampler, "model_drafts", True))


def run_ahead_pays() -> bool:
  """Whether an engine dispatches a pass before publishing the last by
  default. On an accelerator the host's work hides behind the device's. On
  the CPU backend XLA's threads already take every core, and the host's
  Python beside them preempts them: on two cores, 20 HumanEval chat answers
  of the packaged default at `medium` (one slot, w8a8, three interleaved
  rounds, the same 1,077 passes) took 12.4 ms a pass ahead against 11.3
  published first (docs/serving.md)."""
  return jax.default_backend() != "cpu"


class Engine:
  """Serves a block-diffusion (or MDLM) checkpoint from `num_slots` slots.

  `mesh`: run under this mesh, parameters as loaded onto it and slots sharded
  over 'data' x 'fsdp' (num_slots must divide); None: one device.
  `weight_layout`: serve from a copy of the weights in this layout. By
  default, on CPU, passes over a few slots read an [out, in] copy and larger
  passes and prefills the trained layout, each the faster there (the engine
  then holds the weights twice); elsewhere the weights as loaded.
  `decode_dtype="int8"` (or "w8a8"): the copy for passes over a few slots holds
  weight-only int8 weights (a quarter of the bytes a pass reads); on CPU it
  also serves prefills of up to the int8 kernel's rows (`int8_prefill_rows`),
  as the AR path's int8 copy does; "auto": the fastest where the weights live
  (`resolve_decode_dtype`; the server's default). `decode_dtype` holds the
  one in use.
  `grammar_policy`: how much of a constrained pass's grammatical prefix to
  commit (`grammar.Constraint.accept`).
  `admit_batch`: the most requests admitted in one turn that share a prefill
  (`admit_groups`); each size up to it compiles once per prompt bucket (the
  server's default is 4: on a CPU a short prefill costs its dispatch more
  than its tokens).
  `admit_wait_s`: an idle engine holds its first admission up to this long
  while more requests are `arriving` (announced by the server, still being
  parsed), so a burst shares one prefill instead of its first request
  going alone; a request that arrives by itself never waits.
  `max_context`: the tokens a slot's KV cache holds for one request (prompt,
  suffix and generation rounded up to blocks; default max_prompt +
  max_new_tokens). A request that needs more can never run here
  (ContextLengthExceeded); one that fits waits for a free slot. Each slot
  reserves the whole context: `kv_cache_bytes` is slots x (context + one
  block) x `KVCache.bytes_per_token`.
  `prefill_chunk`: prompts (with suffix) longer than this many tokens are
  encoded this many a turn, each turn's refinement pass for the other slots
  in between, so a long prompt delays the others by a chunk a pass rather
  than by its whole prefill (0: every prompt in one prefill). A chunk reads
  the chunks before it and itself: a prompt longer than a chunk is encoded
  block-causally in chunks rather than all bidirectionally (docs/serving.md).
  `run_ahead`: dispatch the next pass before publishing the last one when
  the next plan needs nothing from it (one process, no grammar, no
  log-probabilities), so planning, dispatch and publishing overlap the
  device's work; a finished request may then ride one more pass, whose
  tokens nobody sees. False: each pass is published before the next is planned.
  None (the default): on where an accelerator runs the passes
  (`run_ahead_pays`).
  `draft_table`: revising requests with `lookup` also draft from the model's
  table of its own answers, where it has one (`sampling.draft_table`); the
  text stays the base's, only the tokens a pass change.
  `passes_per_turn`: while every busy request revises and nothing else needs
  the host (no grammar, log-probabilities, streamed drafts or admissions),
  one launch runs up to this many passes, until a request ends
  (`_passes_for`): the host's launch, planning and publishing are paid once
  for them. Text then streams this many passes at a time, and a request that
  arrives for a free slot waits for the launch in flight. 1: a launch a pass.
  `head_width`: the columns of a revising request's verified head (None: what
  the presets verify on this backend, `presets.head_width_for`; 0: the
  block). A revising request's sampler names this width or 0.
  `pass_widths`: the widths a pass of revising heads alone may take, the
  narrowest that holds its drafts (`ThresholdSampler.pass_widths`; (): always
  the head's). A revising request's sampler names these or none."""

  def __init__(self, loaded: LoadedModel, *, num_slots: int = 8, max_prompt: int = 512,
               max_new_tokens: int = 512, block_size: int | None = None, max_queue: int = 256, mesh=None,
               weight_layout: str | None = None, grammar_policy: str = grammar_lib.ACCEPT_POLICIES[0],
               admit_batch: int = 1, max_context: int | None = None, admit_wait_s: float = 0.0,
               prefill_chunk: int = 0, decode_dtype: str = "float32", run_ahead: bool | None = None,
               draft_table: bool = True, passes_per_turn: int = PASSES_PER_TURN, head_width: int | None = None,
               pass_widths: tuple[int, ...] = ()):
    if loaded.spec.cfg.causal:  # an AR checkpoint: blocks of one token, each pass commits the next
      if block_size not in (None, 1):
        raise ValueError(f"an autoregressive checkpoint decodes one token a pass; block_size must be 1, got"
                         f" {block_size}")
      loaded, bs = next_token_view(loaded), 1
    else:
      bs = block_size or presets.block_size_for(loaded.config.diffusion.block_size)
    if max_new_tokens % bs:
      raise ValueError(f"max_new_tokens ({max_new_tokens}) must be a multiple of the block size ({bs})")
    if mesh is not None and num_slots % (mesh.shape["data"] * mesh.shape["fsdp"]):
      raise ValueError(f"{num_slots} slots do not divide over the mesh's data x fsdp axes")
    context = max_context or max_prompt + max_new_tokens
    if context < bs + 1:
      raise ValueError(f"max_context ({context}) must hold a prompt token and a block of {bs}")
    max_prompt = min(max_prompt, context - bs)
    self.decode_dtype = decode_dtype = resolve_decode_dtype(loaded, decode_dtype, weight_layout)
    few, many = decoding_pair(loaded, weight_layout, decode_dtype)
    tok = loaded.tokenizer
    self.loaded, self.tok, self.mesh = few, tok, mesh
    self.draft_table = loaded.draft_table if draft_table else None
    if head_width is None:
      head_width = presets.head_width_for(bs) if loaded.spec.cfg.clean_causal else 0
    self.sc = slots_lib.SlotConfig(num_slots, bs, max_prompt, min(max_new_tokens, (context - 1) // bs * bs),
                                   tok.mask_id, tok.eos_id, loaded.spec.cfg.vocab_size, context,
                                   read_only_ids=never_generated(tok), head_width=head_width,
                                   pass_widths=tuple(pass_widths))
    self.max_queue = max_queue
    if admit_batch < 1:
      raise ValueError(f"admit_batch must be positive, got {admit_batch}")
    self.admit_batch = min(admit_batch, num_slots)
    if admit_wait_s < 0:
      raise ValueError(f"admit_wait_s must be >= 0, got {admit_wait_s}")
    self.admit_wait_s = admit_wait_s
    if prefill_chunk < 0 or 0 < prefill_chunk < MIN_PREFILL_CHUNK:
      raise ValueError(f"prefill_chunk must be 0 (off) or at least {MIN_PREFILL_CHUNK} tokens, got {prefill_chunk}")
    # Off when no prompt this engine takes is longer than a chunk.
    self.prefill_chunk = prefill_chunk if 0 < prefill_chunk < max_prompt else 0
    self._arriving = 0
    self.run_ahead = run_ahead_pays() if run_ahead is None else run_ahead
    if passes_per_turn < 1:
      raise ValueError(f"passes_per_turn must be at least 1, got {passes_per_turn}")
    self.passes_per_turn = passes_per_turn
    self._view = None  # the last pass's `slots.published` array
    # and, on the device, what a guided or logprobs pass also returned (else None)
    self._guided_out = self._logprob_out = None
    if grammar_policy not in grammar_lib.ACCEPT_POLICIES:
      raise ValueError(f"grammar_policy must be one of {grammar_lib.ACCEPT_POLICIES}, got {grammar_policy!r}")
    self.grammar_policy = grammar_policy
    # A model trained with fill-in-the-middle reads the PSM prompt instead.
    self.fim = fim.format_for(loaded.config, tok)
    # The programs for passes and prefills over at most `_few_rows` token rows and for larger ones.
    self._few_rows = int8_prefill_rows(decode_dtype)
    self._few = slots_lib.compile_programs(few, self.sc)
    self._many = self._few if many is few else slots_lib.compile_programs(many, self.sc)
    self._min_rows = mesh.shape["data"] * mesh.shape["fsdp"] if mesh is not None else 1
    # Held packed (`packing`): a pass's launch costs host time per buffer.
    self._packing = self._few.packing
    state = slots_lib.init_slots(loaded.spec, self.sc)  # on this process's default device
    with self._mesh_context():
      if mesh is not None:  # each process places the rows of its own devices
        state = tuple(_place(x, _row_sharding(mesh, x, num_slots))
                      for x in self._packing.pack(jax.tree.map(np.asarray, state)))
      else:  # placed as every later state is (the programs' outputs): each program compiles once, not twice
        state = jax.device_put(self._packing.pack(state), _replicated_like(jax.tree.leaves(few.params)[0].sharding))
      self._state = state
      if self.draft_table is not None:  # placed once, whole on every device: no copy a pass
        whole = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
                 else _replicated_like(jax.tree.leaves(few.params)[0].sharding))
        self.draft_table = jax.tree.map(
            lambda x: _place(np.asarray(x), whole) if mesh is not None else jax.device_put(x, whole), self.draft_table)
    self._leader = jax.process_index() == 0
    self._release_next: list[int] = []  # rows found done by the last publish, freed on device next turn
    self._waiting: collections.deque[Handle] = collections.deque()
    self._slots: list[Handle | None] = [None] * num_slots
    # Host copy of which slots hold a finished block not yet in the cache
    # (read with every publish), and whether one waited through the last pass.
    self._head = np.zeros(num_slots, bool)
    self._head_waited = False
    # What the last guided pass proposed for the constrained rows (host copies).
    self._guided_view: tuple[np.ndarray, ...] | None = None
    self._lock = threading.Condition()
    self._closing = False
    self._stop = False
    self._thread: threading.Thread | None = None
    self.stats = collections.Counter()
    self._waited = 0.0  # seconds the last gather waited for the device
    # The distinct static signatures the programs were called with: one compiled program each.
    self._signatures = {"passes": set(), "prefills": set()}
    self._finish_reasons: collections.Counter[str] = collections.Counter()
    self.error: BaseException | None = None

  # -- public API -----------------------------------------------------------

  @property
  def weight_layouts(self) -> list[str]:
    """The weight layouts its passes read (two on CPU by default)."""
    return sorted({self._few.model.spec.cfg.weight_layout, self._many.model.spec.cfg.weight_layout})

  @property
  def num_slots(self) -> int:
    return self.sc.num_slots

  def queue_depth(self) -> int:
    with self._lock:
      return len(self._waiting)

  def active_requests(self) -> int:
    with self._lock:
      return sum(h is not None for h in self._slots)

  def finish_reasons(self) -> dict[str, int]:
    """How many requests ended each way: stop, length, cancelled, error."""
    with self._lock:
      return dict(self._finish_reasons)

  def start(self) -> "Engine":
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="mdlm-engine", daemon=True)
      self._thread.start()
    return self

  def warmup(self) -> "Engine":
    """Compiles the pass for every slot-count bucket and the prefill for every
    prompt-length bucket now, so early requests do not wait for compilation
    (for an AR model adapted to diffusion, its revising pass too; and the
    guided pass constrained requests run, structured outputs and tool calls,
    beside a revising request too). Call before start()."""
    if self._thread is not None:
      raise RuntimeError("warm up before start(): the engine thread owns the state once started")
    with self._mesh_context():
      for bucket in self._prefill_buckets():
        sizes = [(k, False) for k in admit_sizes(bucket, self.admit_batch)]
        for k, resume in sizes + ([(1, True)] if self.prefill_chunk else []):
          programs = self._programs_for(k * bucket)
          self._signatures["prefills"].add((id(programs.model), k, bucket, resume))
          ones = np.ones((k,), np.int32)
          self._state = programs.admit(programs.leaves, self._state, np.arange(k, dtype=np.int32),
                              np.full((k, bucket), self.tok.pad_id, np.int32),
                              np.broadcast_to(np.arange(bucket, dtype=np.int32), (k, bucket)), ones, ones, ones,
                              rule.Decoding.broadcast(k, threshold=1.0, min_tokens=1), np.zeros((k, 2), np.uint32),
                              np.ones((k,), bool), np.zeros((k,), bool), self.draft_table, resume=resume)
          self._deactivate(range(k))
      cfg = self.loaded.spec.cfg
      # An adapted AR model revises at its default effort: its first request would compile that pass.
      revises = cfg.clean_causal and cfg.shift_logits and not cfg.time_conditioning and self.sc.block_size >= 2
      for rows in sorted({self._rows_for(n) for n in range(1, self.num_slots + 1)}):
        for with_head in (True, False):  # idle slots: nothing changes
          self._run_pass(rows, with_head)
          self._run_pass(rows, with_head, guided=True)  # no guides: nothing is written
        if revises:
          for passes in sorted({1, self.passes_per_turn}):
            for head_only in (False, True) if not presets.model_drafts_pay() else (False,):
              self._run_pass(rows, True, revising=True, passes=passes, head_only=head_only)
          self._run_pass(rows, True, guided=True, revising=True)
      _request_key(0)  # the key derivation compiles too, where it runs on the device
      jax.block_until_ready(self._state)
    return self

  def _prefill_buckets(self) -> list[int]:
    """The padded lengths a prefill (or a prefill's chunk) can have."""
    cap = self.prefill_chunk or self.sc.max_prompt
    return sorted({prompt_bucket(n, cap) for n in range(1, cap + 1)})

  def pass_rows(self, busy: int) -> int:
    """How many slots a pass covers when slots [0, busy) hold requests."""
    return self._rows_for(busy)

  def pass_seconds(self, slots: int, with_head: bool, repeats: int = 10, guided: bool = False) -> float:
    """Seconds of one refinement pass over `slots` slots (rounded up to the
    pass size the engine would run), fastest of `repeats` after a warm-up: a
    pass costs the same whether its slots are busy or idle. `guided`: the
    pass that runs while a constrained request is busy. For benchmarks;
    call before start()."""
    if self._thread is not None:
      raise RuntimeError("time passes before start(): the engine thread owns the state once started")
    rows = self._rows_for(slots)
    best = float("inf")
    with self._mesh_context():
      for i in range(repeats + 1):
        t0 = time.perf_counter()
        self._run_pass(rows, with_head, guided)
        jax.block_until_ready(self._state)
        if i:  # the first compiles, or waits for whatever ran before
          best = min(best, time.perf_counter() - t0)
    return best

  def host_share(self) -> float:
    """Of the wall time of the turns that were a launch of passes and nothing
    else (no prefill), the share the host spent not waiting for them: planning,
    dispatch, publishing, grammar work (nan before any such turn). Published
    a pass late (`run_ahead`), that work overlaps the next pass, so this is
    the host's load, not time the device sat idle."""
    turns = self.stats["pass_turn_seconds"]
    return 1.0 - self.stats["pass_wait_seconds"] / turns if turns else float("nan")

  def pass_flops(self, slots: int, with_head: bool) -> float:
    """Model FLOPs of that pass: every slot's block reads the whole cache and
    is scored; a finished block is encoded (keys and values) but not scored."""
    from mdlm_jax.training import flops
    cfg = self.loaded.spec.cfg
    per_token = flops.forward_flops_per_token(cfg, self.sc.cache_len)
    scored = per_token * self.sc.block_size
    encoded = (per_token - 2 * cfg.embed_dim * cfg.vocab_size) * self.sc.block_size if with_head else 0.0
    return self._rows_for(slots) * (scored + encoded)

  def weight_layout_for(self, token_rows: int) -> str:
    """The weight layout a pass or prefill over this many token rows reads."""
    return self._programs_for(token_rows).model.spec.cfg.weight_layout

  @property
  def cache_buffer_bytes(self) -> int:
    """The bytes the slots' key and value buffers hold (`kv_cache_bytes` is the promise)."""
    return sum(self._packing.own_buffer(self._state, name).nbytes for name in ("cache.k", "cache.v"))

  @property
  def cache_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the slots' key and value buffers."""
    k, v = (self._packing.own_buffer(self._state, name) for name in ("cache.k", "cache.v"))
    return tuple(k.shape), tuple(v.shape)

  def pass_hlo(self, slots: int, with_head: bool, guided: bool = False) -> str:
    """The optimised HLO of the pass over `slots` slots, for inspection (what
    a pass copies or rewrites). Call before start()."""
    rows = self._rows_for(slots)
    programs = self._programs_for(rows * self.sc.block_size * (2 if with_head else 1))
    ops = self._guide_arrays(()) if guided else None
    with self._mesh_context():
      lowered = programs.step.lower(programs.leaves, self._state, ops, None, rows=rows, with_head=with_head)
      return lowered.compile().as_text()

  def compiled(self) -> dict[str, int]:
    """How many pass and prefill programs are compiled, over both weight
    layouts: the distinct shapes and static arguments they were called with."""
    return {kind: len(seen) for kind, seen in self._signatures.items()}

  def prepare(self, request: Request) -> Request:
    """The request as this engine decodes it: for a model trained with
    fill-in-the-middle, prefix and suffix become its PSM prompt (no suffix
    in the cache); otherwise unchanged."""
    if self.fim is None or not request.suffix_ids:
      return request
    ids = list(request.prompt_ids)
    bos = ids[0] if ids and ids[0] == self.tok.bos_id else None
    prompt = self.fim.prompt(bos, ids[1:] if bos is not None else ids, request.suffix_ids)
    return dataclasses.replace(request, prompt_ids=prompt, suffix_ids=())

  def submit(self, request: Request, *, want_drafts: bool = False) -> Handle:
    request = self.prepare(request)
    self._check(request)
    h = Handle(request, want_drafts)
    if request.grammar is not None:  # compiled here, off the engine thread; GrammarError on a bad one
      h.constraint = self.constraint_for(request)
    with self._lock:
      if self._closing:
        raise EngineClosed("the server is shutting down")
      if len(self._waiting) >= self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are already waiting")
      self._waiting.append(h)
      self._lock.notify_all()
    return h

  def close(self, deadline_s: float = 30.0) -> None:
    """Stops admitting; lets running requests finish until the deadline, then
    cancels what is left (waiting requests end with finish_reason "cancelled")."""
    with self._lock:
      self._closing = True
      waiting, self._waiting = list(self._waiting), collections.deque()
      self._lock.notify_all()
    for h in waiting:
      self._end(h, Event("done", "", "cancelled"))
    end = time.monotonic() + deadline_s
    while self.active_requests() and time.monotonic() < end and self._thread is not None and self._thread.is_alive():
      time.sleep(0.01)
    with self._lock:
      for h in self._slots:
        if h is not None:
          h.cancel()
      self._stop = True
      self._lock.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=10)

  def constraint_for(self, request: Request) -> grammar_lib.Constraint:
    """A fresh matcher for the request's grammar over this model's vocabulary
    (GrammarError naming the request's field if it does not compile)."""
    vocab = grammar_lib.vocabulary(self.tok, self.loaded.spec.cfg.vocab_size)
    return grammar_lib.Constraint(request.grammar, vocab, (self.tok.eos_id, *request.end_ids),
                                  policy=self.grammar_policy)

  # -- engine thread --------------------------------------------------------

  def encode(self, text: str, add_bos: bool = True) -> list[int]:
    """Token ids of `text` for a request (BOS first, as prompts start)."""
    return ([self.tok.bos_id] if add_bos and self.tok.adds_bos else []) + self.tok.encode(text)

  def sampler_for(self, effort: str = presets.DEFAULT_EFFORT, **overrides) -> ConfidenceSampler:
    """The decoding an effort means for this engine's model (`presets.for_model`),
    revising with copied drafts in heads of this engine's width, and passes
    of heads alone in its pass widths, unless `head_width` or `pass_widths`
    says otherwise."""
    smp = presets.for_model(effort, self.sc.block_size, in_order=self.loaded.spec.cfg.clean_causal, **overrides)
    fit = {}
    if smp.revises and smp.lookup and overrides.get("head_width") is None:
      fit["head_width"] = self.sc.head
    if smp.revises and smp.lookup and not smp.model_drafts and overrides.get("pass_widths") is None:
      fit["pass_widths"] = self.sc.pass_widths
    return dataclasses.replace(smp, **fit) if fit else smp

  @property
  def kv_cache_bytes(self) -> int:
    """The KV cache every slot reserves, all slots together."""
    return self.num_slots * self.sc.cache_len * KVCache.bytes_per_token(self.loaded.spec.cfg)

  def arriving(self, delta: int) -> None:
    """Counts requests on their way to `submit` (+1 when one starts, -1 once
    it is submitted or has failed): what an idle engine's admission waits for."""
    with self._lock:
      self._arriving += delta
      self._lock.notify_all()

  def kv_tokens_in_use(self) -> int:
    """KV-cache tokens the requests holding slots occupy (of num_slots x context)."""
    with self._lock:
      return sum(self.context_needed(h.request) for h in self._slots if h is not None)

  def context_needed(self, r: Request) -> int:
    """KV-cache tokens `r` occupies: prompt, suffix and its blocks of generation."""
    bs = self.sc.block_size
    return len(r.prompt_ids) + len(r.suffix_ids) + -(-r.max_tokens // bs) * bs

  def _check(self, r: Request) -> None:
    fixed = len(r.prompt_ids) + len(r.suffix_ids)
    what = "prompt and suffix have" if r.suffix_ids else "prompt has"
    if not r.prompt_ids or fixed > self.sc.max_prompt:
      raise ContextLengthExceeded(f"the {what} {fixed} tokens; this engine takes 1 to {self.sc.max_prompt}")
    if not 1 <= r.max_tokens <= self.sc.max_new_tokens:
      raise ValueError(f"max_tokens must be in [1, {self.sc.max_new_tokens}], got {r.max_tokens}")
    need = self.context_needed(r)
    if need > self.sc.context:
      raise ContextLengthExceeded(
          f"the {what} {fixed} tokens and max_tokens={r.max_tokens} needs {need} (in blocks of"
          f" {self.sc.block_size}); this engine's context is {self.sc.context} tokens per request")
    if r.logprobs is not None and not 0 <= r.logprobs <= slots_lib.TOP_LOGPROBS:
      raise ValueError(f"logprobs must be in [0, {slots_lib.TOP_LOGPROBS}], got {r.logprobs}")
    smp = r.sampler
    if not isinstance(smp, tuple(RULES.values())) or not smp.kv_cache or smp.block_size != self.sc.block_size:
      raise ValueError(f"the engine decodes with a KV-cached sampler of {', '.join(RULES)} in blocks of"
                       f" {self.sc.block_size} (engine.sampler_for builds one); got {smp!r}")
    smp.check_vocabulary(self.sc.vocab_size)
    # Without copied or table drafts a head never holds more than the block's drafts: any width decodes alike.
    if smp.revises and smp.lookup and (smp.head_width or self.sc.block_size) != self.sc.head:
      raise ValueError(f"this engine verifies heads of {self.sc.head} columns (Engine(head_width=...)); the"
                       f" request's sampler asks for head_width={smp.head_width} (0: the block,"
                       f" {self.sc.block_size}); engine.sampler_for builds one that fits")
    if smp.revises and smp.pass_widths and tuple(smp.pass_widths) != self.sc.pass_widths:
      raise ValueError(f"this engine's passes of heads alone take widths {self.sc.pass_widths or (self.sc.head,)}"
                       f" (Engine(pass_widths=...)); the request's sampler asks for pass_widths={smp.pass_widths};"
                       " engine.sampler_for builds one that fits")
    if smp.revises:
      if not self.loaded.spec.cfg.clean_causal:
        raise ValueError("revise keeps the drafts its base agrees with: it needs an AR model adapted to diffusion"
                         " (model.clean_causal)")
      if r.suffix_ids:
        raise ValueError("revise writes left to right: it cannot infill against a suffix")
      if r.grammar is not None:
        raise ValueError("revise does not run under a grammar (a taken-back token would unwind the grammar's state)")

  def _mesh_context(self):
    import contextlib
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _loop(self) -> None:
    # A pass dispatched and not yet published: (its view, the slots' requests
    # then). While it runs, the host plans and dispatches the next pass, then
    # publishes it (`_runs_ahead`): planning one pass late costs at most a
    # pass of a finished request, and the host's work hides behind the device's.
    pending = None
    try:
      with self._mesh_context():
        while True:
          with self._lock:
            if pending is None and not self._stop and not self._waiting and not any(self._slots):
              # Idle. With followers, an empty turn every half second keeps
              # them (and their collectives) from waiting indefinitely.
              self._lock.wait(timeout=0.5)
            idle = not self._stop and not self._waiting and not any(self._slots)
          if idle and pending is not None:
            self._publish_pending(pending)
            pending = None
            continue
          if idle and jax.process_count() == 1 and not self._release_next:
            continue
          self._await_burst()
          t0 = time.perf_counter()
          self._waited = 0.0
          turn = self._share(self._plan())
          ahead = self._runs_ahead(turn)
          if pending is not None and not ahead:
            self._publish_pending(pending)
            pending = None
          self._apply(turn)
          if turn.stop:
            if pending is not None:
              self._publish_pending(pending)
            return
          if turn.rows:
            self.stats["steps"] += 1
            self.stats["steps_with_head" if turn.with_head else "steps_without_head"] += 1
            self.stats["steps_guided"] += int(turn.guided)
            self.stats["steps_head_only"] += int(turn.head_only)
            self.stats["steps_run_ahead"] += int(ahead)
            dispatched = (self._view, list(self._slots))
            if ahead:
              if pending is not None:
                self._publish_pending(pending)
              pending = dispatched
            else:
              self._publish(self._gather(self._view, turn.guided, turn.logprobs), dispatched[1])
            if not turn.admits:  # a turn that is one pass and nothing else: where host work shows
              self.stats["pass_turns"] += 1
              self.stats["pass_turn_seconds"] += time.perf_counter() - t0
              self.stats["pass_wait_seconds"] += self._waited
          elif pending is not None:
            self._publish_pending(pending)
            pending = None
    except BaseException as e:  # the engine is dead: fail every request loudly
      self.error = e
      with self._lock:
        handles = [h for h in self._slots if h is not None] + list(self._waiting)
        self._waiting.clear()
        self._slots = [None] * self.num_slots
      for h in handles:
        self._end(h, Event("done", "", "error"))
      raise

  def _await_burst(self) -> None:
    """From idle, give announced requests up to admit_wait_s to be submitted,
    so they are admitted (and prefilled) together with the first."""
    if self.admit_wait_s <= 0:
      return
    with self._lock:
      if any(self._slots) or not self._waiting or not self._arriving:
        return
      self._lock.wait_for(lambda: self._stop or not self._arriving or len(self._waiting) >= self.admit_batch,
                          timeout=self.admit_wait_s)
      self.stats["admit_waits"] += 1

  def follow(self) -> None:
    """The loop of every process but 0 in a multi-process engine: apply the
    turns process 0 broadcasts, until it stops. Warm up first, as process 0 does."""
    if self._leader:
      raise RuntimeError("process 0 plans the turns: start() it instead")
    with self._mesh_context():
      while True:
        turn = self._share(None)
        self._apply(turn)
        if turn.stop:
          return
        if turn.rows:
          self._gather(self._view, turn.guided, turn.logprobs)

  def _plan(self) -> Turn:
    """Process 0's host bookkeeping for the next turn: done and cancelled slots
    are freed, waiting requests take free slots, and the busy prefix gets a pass."""
    turn = Turn(release=self._release_next)
    self._release_next = []
    with self._lock:
      if self._stop:
        turn.stop = True
        return turn
    for row, h in enumerate(self._slots):
      if h is not None and h.cancelled:
        turn.release.append(row)
        self._release(row, Event("done", h.emitted, "cancelled"))
    while True:
      with self._lock:
        free = [i for i, h in enumerate(self._slots) if h is None]
        if not free or not self._waiting:
          break
        h = self._waiting.popleft()
        if h.cancelled:
          self._end(h, Event("done", "", "cancelled"))
          continue
        row = free[0]
        self._slots[row] = h
        self._head[row] = False
      h.slot = row
      h.key = _request_key(h.request.seed)
      if not self.prefill_chunk or h.fixed_len <= self.prefill_chunk:
        turn.admits.append((row, h.request, h.key, 0, h.fixed_len))
        h.prefilled = h.fixed_len
      self.stats["admitted"] += 1
      if h.want_drafts:
        h._push(Event("draft", MASK_TEXT * h.request.max_tokens))
    # One chunk of the longest-waiting chunked prefill a turn.
    chunked = [h for h in self._slots if h is not None and h.prefilling and not h.cancelled]
    if chunked:
      h = min(chunked, key=lambda h: h.id)
      stop = min(h.prefilled + self.prefill_chunk, h.fixed_len)
      turn.admits.append((h.slot, h.request, h.key, h.prefilled, stop))
      h.prefilled = stop
      self.stats["prefill_chunks"] += 1
    admitted = {row for row, _, _, _, stop in turn.admits if stop == self._slots[row].fixed_len}
    turn.guides = [g for row, h in enumerate(self._slots)
                   if h is not None and h.constraint is not None and not h.cancelled and not h.prefilling
                   for g in [self._constrain(row, h, row in admitted)] if g is not None]
    self._guided_view = None
    busy = [i for i, h in enumerate(self._slots) if h is not None and not h.prefilling]
    if busy:
      turn.revising = any(self._slots[i].request.sampler.revises for i in busy)
      # Revising rows carry a head every pass: they never wait for one.
      turn.rows, turn.with_head = self._rows_for(busy[-1] + 1), self._pass_with_head(busy) or turn.revising
      turn.guided = any(self._slots[i].constraint is not None for i in busy)
      turn.logprobs = any(self._slots[i].request.logprobs is not None for i in busy)
      # Without the masked block when no busy request wants the model's drafts.
      turn.head_only = (not turn.logprobs and not turn.guided
                        and all(self._slots[i].request.sampler.revises
                                and not self._slots[i].request.sampler.model_drafts for i in busy))
      turn.passes = self._passes_for(turn, busy)
    return turn

  def _passes_for(self, turn: Turn, busy: list[int]) -> int:
    """Passes in this turn's launch: `passes_per_turn` when no host decision
    falls between them (every busy request revises, none is constrained,
    wants log-probabilities or drafts, no prompt is being admitted or
    announced for a free slot), else one. The launch ends after a pass in
    which a request ended, so a waiting request takes its slot as soon as it
    would have. A stop string shows up to a launch late (the request's
    `passes` counts those it rode), and what follows it is cut as always."""
    if self.passes_per_turn == 1 or turn.admits or turn.guided or turn.logprobs:
      return 1
    with self._lock:
      if self._arriving and None in self._slots:
        return 1
    if not all(self._slots[i].request.sampler.revises and not self._slots[i].want_drafts for i in busy):
      return 1
    return self.passes_per_turn

  def _constrain(self, row: int, h: Handle, admitted: bool):
    """The host's half of a constrained row's pass: the grammatical prefix of
    what the last pass proposed (or, just admitted, nothing yet), then any
    tokens the grammar forces, as a guide (row, tokens, new cursor, bitmask);
    None when the row did not move in the last pass."""
    c, bs = h.constraint, self.sc.block_size
    t0 = time.perf_counter()
    cursor = c.committed
    off = cursor % bs
    if admitted:
      taken = []
    else:
      if self._guided_view is None:
        return None
      proposal, picked, proposed = (a[row] for a in self._guided_view)
      if not proposed:
        return None
      taken = c.accept(proposal[off:], picked[off:])
      self.stats["grammar_proposed"] += bs - off
    proposed = len(taken)
    taken += c.forced(bs - off - len(taken))
    tokens = taken + [self.tok.eos_id] * (bs - off - len(taken)) if c.ended else taken
    allowed = np.zeros(self.sc.bitmask_words, np.uint32) if c.ended else c.allowed()
    self.stats["grammar_committed"] += len(taken)
    self.stats["grammar_seconds"] += time.perf_counter() - t0
    if tokens and off + len(tokens) == bs:  # the block fills: it waits for the cache, unless the request ends
      last = cursor // bs + 1 >= -(-h.request.max_tokens // bs)
      self._head[row] = not (c.ended or last)
    return row, tokens, cursor + len(tokens), allowed, proposed

  def _share(self, turn: Turn | None) -> Turn:
    """Process 0's turn on every process (itself when it runs alone)."""
    if jax.process_count() == 1:
      return turn
    from jax.experimental import multihost_utils
    arrays = encode_turn(turn if self._leader else Turn(), self.sc)
    return decode_turn(jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(arrays)), self.sc)

  def _apply(self, turn: Turn) -> None:
    """The turn's device work; every process runs exactly this."""
    self._deactivate(turn.release)
    rows_of = [tuple(a[start:stop] for a in r.fixed_row()) for _, r, _, start, stop in turn.admits]
    resumed = [start > 0 for _, _, _, start, _ in turn.admits]
    last = [stop == len(r.prompt_ids) + len(r.suffix_ids) for _, r, _, _, stop in turn.admits]
    cap = self.prefill_chunk or self.sc.max_prompt
    buckets = [prompt_bucket(len(tokens), cap) for tokens, _ in rows_of]
    ints = lambda values: np.asarray(list(values), np.int32)  # noqa: E731
    fresh = admit_groups([b for b, r in zip(buckets, resumed) if not r], self.admit_batch)
    index = [i for i, r in enumerate(resumed) if not r]
    groups = [(bucket, [index[j] for j in group], False) for bucket, group in fresh]
    groups += [(buckets[i], [i], True) for i, r in enumerate(resumed) if r]  # a slot's next chunk: alone
    for bucket, group, resume in groups:
      k = len(group)
      fixed = np.full((k, bucket), self.tok.pad_id, np.int32)
      pos = np.zeros((k, bucket), np.int32)
      for j, i in enumerate(group):
        tokens, positions = rows_of[i]
        fixed[j, :len(tokens)], pos[j, :len(tokens)] = tokens, positions
      requests = [turn.admits[i][1] for i in group]
      decoding = jax.tree.map(lambda *x: np.concatenate(x), *(r.sampler.decoding(1) for r in requests))
      programs = self._programs_for(k * bucket)
      self._signatures["prefills"].add((id(programs.model), k, bucket, resume))
      self.stats["prefills"] += 1
      self._state = programs.admit(programs.leaves, self._state, ints(turn.admits[i][0] for i in group), fixed, pos,
                          ints(len(rows_of[i][0]) for i in group), ints(len(r.prompt_ids) for r in requests),
                          ints(r.max_tokens for r in requests), decoding,
                          np.stack([turn.admits[i][2] for i in group]), np.asarray([last[i] for i in group]),
                          np.asarray([_heads_first(r.sampler) for r in requests]), self.draft_table, resume=resume)
    if turn.rows:
      self._run_pass(turn.rows, turn.with_head, turn.guided, turn.logprobs, turn.guides, turn.revising, turn.passes,
                     turn.head_only)

  def _guide_arrays(self, guides):
    """`slots.guide`'s operands for a turn's guides: tokens land at their
    offsets in the current block."""
    n, bs = self.num_slots, self.sc.block_size
    rows, tokens, take = np.zeros(n, bool), np.zeros((n, bs), np.int32), np.zeros((n, bs), bool)
    cursor, forced = np.zeros(n, np.int32), np.zeros((n, bs), bool)
    allowed = np.zeros((n, self.sc.bitmask_words), np.uint32)
    for row, toks, new_cursor, mask, proposed in guides:
      off = (new_cursor - len(toks)) % bs
      rows[row], cursor[row], allowed[row] = True, new_cursor, mask
      tokens[row, off:off + len(toks)] = toks
      take[row, off:off + len(toks)] = True
      forced[row, off + proposed:off + len(toks)] = True
    return rows, tokens, take, cursor, allowed, forced

  def _programs_for(self, token_rows: int) -> slots_lib.Programs:
    """The programs for a pass or prefill over this many token rows."""
    return self._few if token_rows <= self._few_rows else self._many

  def _run_pass(self, rows: int, with_head: bool, guided: bool = False, logprobs: bool = False,
                guides=(), revising: bool = False, passes: int = 1, head_only: bool = False) -> None:
    """One refinement pass over slots [0, rows): each carries its block, and
    with `with_head` the finished block before it too. `guided`: the pass
    for while a constrained request is busy, the host's `guides` for the
    constrained rows written first in the same program (one dispatch a pass).
    `revising`: a busy request revises (`slots.step`); `head_only`: every
    busy request revises without the model's drafts, and the pass carries
    their heads alone. `passes`: up to that many in the one launch
    (`_passes_for`)."""
    per_row = 1 if head_only else (2 if with_head else 1)
    programs = self._programs_for(rows * self.sc.block_size * per_row)
    ops = self._guide_arrays(guides) if guided else None
    self._signatures["passes"].add((id(programs.model), rows, with_head, logprobs, guided, revising, passes,
                                    head_only))
    self._state, self._view, self._guided_out, self._logprob_out = programs.step(
        programs.leaves, self._state, ops, self.draft_table if revising else None, rows=rows, with_head=with_head,
        logprobs=logprobs, revising=revising, passes=passes, head_only=head_only)

  def _deactivate(self, rows: Sequence[int]) -> None:
    if rows:
      mask = np.zeros(self.num_slots, bool)
      mask[list(rows)] = True
      self._state = self._few.release(self._state, mask)

  def _gather(self, view, guided: bool = False, logprobs: bool = False):
    """Host copies of what a publish reads (`view`: a pass's `slots.published`
    array), from every process's rows (after a guided pass also what it
    proposed for the constrained rows). After a logprobs pass, the
    log-probabilities: on one process left on the device for
    `Handle.logprob_entries` to read the rows it needs; with several,
    gathered (a collective every process runs alike). Guided and logprobs
    passes are gathered before the next pass runs."""
    arrays = (view,)
    if guided:
      arrays += tuple(self._guided_out)
    single = jax.process_count() == 1
    if logprobs and not single:
      arrays += tuple(self._logprob_out)
    t0 = time.perf_counter()
    if single:
      out = jax.device_get(arrays)
    else:
      from jax.experimental import multihost_utils
      out = tuple(np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in arrays)
    self._waited = time.perf_counter() - t0
    if guided:
      self._guided_view = tuple(out[1:4])
    lp = (tuple(self._logprob_out) if single else tuple(out[-3:])) if logprobs else None
    return Snapshot.of_slots(*slots_lib.unpack_published(out[0], self.sc), block_size=self.sc.block_size,
                             mask_id=self.sc.mask_id, logprobs=lp)

  def _runs_ahead(self, turn: Turn) -> bool:
    """Whether this turn's pass is published after the next one is dispatched:
    on one process, for a pass the next plan needs nothing from (no grammar
    guides, no log-probabilities left on the device)."""
    return (self.run_ahead and bool(turn.rows) and not turn.guided and not turn.logprobs
            and jax.process_count() == 1)

  def _publish_pending(self, pending: tuple) -> None:
    """Publishes a pass dispatched earlier: (its view, the slots' requests then)."""
    view, owners = pending
    self._publish(self._gather(view), owners)

  def _pass_with_head(self, busy: list[int]) -> bool:
    with_head, self._head_waited = ride_with_head(self._head[busy], self._head_waited)
    return with_head

  def _rows_for(self, n: int) -> int:
    return pass_size(n, self._min_rows, self.num_slots)

  def _release(self, row: int, ev: Event) -> None:
    with self._lock:
      h = self._slots[row]
      self._slots[row] = None
      self._lock.notify_all()
    self._end(h, ev)

  def _end(self, h: Handle, ev: Event) -> None:
    """Every request ends here, counted by finish reason."""
    with self._lock:
      self._finish_reasons[ev.finish_reason] += 1
    h._push(ev)
    self.stats["finished"] += 1

  def _publish(self, snap: Snapshot, owners: Sequence[Handle | None] | None = None) -> None:
    """Events from a pass's snapshot. `owners`: the request each slot held
    when the pass was dispatched; a slot whose request has since ended (or
    been replaced) is left alone."""
    self._head = snap.head & snap.active
    for row, h in enumerate(self._slots):
      if h is None or h.prefilling or (owners is not None and owners[row] is not h):
        continue
      events, done = events_for(h, row, snap, self.tok)
      for ev in events:
        h._push(ev)
      if done is not None:
        if snap.active[row]:
          self._release_next.append(row)
        self._release(row, done)


def int8_prefill_rows(decode_dtype: str) -> int:
  """The most token rows a pass or prefill reads from the few-rows copy: the
  int8 kernel's limit for an int8 copy on CPU (a 192-row chat prompt's
  prefill took 150 to 230 ms from the int8 copy against 285 to 345 from the
  float32 one, the packaged default, measured), else FEW_ROWS (a float32
  [out, in] copy is the faster only for a few rows)."""
  if decode_dtype in INT8_ACTIVATION_BITS and jax.default_backend() == "cpu" and kernels.native_kernel_ready():
    return kernels.int8.KERNEL_MAX_ROWS
  return FEW_ROWS


def _request_key(seed: int) -> np.ndarray:
  """A request's PRNG key data, from its seed: what `jax.random.key(seed)`
  holds, formed on the host for the default threefry keys (the seed's high
  and low 32 bits, of 32 or, with x64, 64). Formed on the device it waited
  for the running pass, a whole pass at every admission."""
  if jax.config.jax_default_prng_impl != "threefry2x32":
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
  bits = int(seed) % (1 << (64 if jax.config.jax_enable_x64 else 32))
  return np.array([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


def _row_sharding(mesh, x: Any, num_slots: int):
  """Slot-indexed arrays are split over the batch axes on their slot axis."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  batch = ("data", "fsdp")
  if x.ndim >= 2 and x.shape[1] == num_slots and x.ndim == 5:  # cache k/v: [layers, slots, ...]
    return NamedSharding(mesh, P(None, batch))
  if x.ndim >= 1 and x.shape[0] == num_slots:
    return NamedSharding(mesh, P(batch))
  return NamedSharding(mesh, P())


def _replicated_like(sharding):
  """Whole arrays where `sharding`'s arrays live: over its mesh when it has
  one (a jitted program's outputs come back so), else on its device."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return next(iter(sharding.device_set))


def _place(x: np.ndarray, sharding) -> jax.Array:
  """A host array every process holds in full, as a global array: each process
  places the slices of its own devices (device_put cannot span processes)."""
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
