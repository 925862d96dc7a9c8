"""The continuous-batching engine: the same tokens as the one-shot generator,
per-request settings in one batch, drafts, cancellation, a mesh."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from mdlm_jax.parallel import sharding
from mdlm_jax import checkpoints
from mdlm_jax.model.spec import model_spec
from mdlm_jax.data.tokenizer import never_generated
from mdlm_jax.engine.engine import MASK_TEXT, Engine, EngineClosed, QueueFull, Request
from mdlm_jax.engine.scheduling import ride_with_head
from mdlm_jax.model.layers import FEW_ROWS
from mdlm_jax.sampling.generate import Generator
from mdlm_jax.sampling.samplers import LowConfidenceSampler, ThresholdSampler
from tests.conftest import adapted_from

PROMPTS = ["def f(x):\n", "import os\nimport sys\n\nclass Thing:\n    ", "x = "]
SETTINGS = [dict(threshold=0.9, min_tokens=2), dict(threshold=0.5, min_tokens=4), dict(threshold=1.0, min_tokens=1)]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints):
  return checkpoints.load(tiny_checkpoints["mdlm"])


@pytest.fixture(scope="module")
def engine(loaded):
  # Ahead, as on an accelerator: the tests below check its published-late passes too.
  e = Engine(loaded, num_slots=4, max_prompt=32, max_new_tokens=24, block_size=8, run_ahead=True).start()
  yield e
  e.close(deadline_s=1)


def _request(loaded, prompt, *, max_tokens, seed=0, stop=(), suffix="", **settings):
  """An engine request with the cached threshold rule in blocks of 8 and `settings`."""
  gen = Generator(loaded)
  sampler = ThresholdSampler(block_size=8, kv_cache=True, **settings)
  suffix_ids = gen.tok.encode(suffix) if suffix else ()
  return Request(gen.encode_prompt(prompt), max_tokens, sampler, seed=seed, stop=stop, suffix_ids=suffix_ids)


def test_greedy_matches_the_generator_with_mixed_settings(loaded, engine):
  """Requests with different settings and prompt lengths, sharing passes, give
  exactly the one-shot cached block sampler's tokens for each alone."""
  gen = Generator(loaded)
  handles = [engine.submit(_request(loaded, p, max_tokens=20, **kw)) for p, kw in zip(PROMPTS, SETTINGS)]
  for h, p, kw in zip(handles, PROMPTS, SETTINGS):
    done = h.result(timeout=120)
    want = gen.generate([p], max_new_tokens=20, seed=0,
                        sampler=ThresholdSampler(block_size=8, kv_cache=True, **kw)).completions[0]
    assert done.text == want.text
    assert done.finish_reason == want.finish_reason
  # Threshold 1.0 with one token a pass takes 8 passes a block: both pass kinds ran.
  assert engine.stats["steps_with_head"] > 0 and engine.stats["steps_without_head"] > 0
  assert engine.stats["pass_turns"] > 0 and 0 <= engine.host_share() < 1


@pytest.mark.slow  # sampled passes compile (CI: server's low-confidence test, and mixed settings greedy here)
def test_low_confidence_and_threshold_rules_share_passes_and_decode_as_alone(loaded, engine):
  """LLaDA's schedule (k of a block's masks a pass, `steps` passes a block) served in the same passes as
  the threshold rule, sampled: each request's tokens are the one-shot cached sampler's for it alone."""
  gen = Generator(loaded)
  rng = np.random.default_rng()
  seeds = rng.integers(0, 2 ** 30, size=3).tolist()
  samplers = [LowConfidenceSampler(steps=3, temperature=0.8, block_size=8, kv_cache=True),
              ThresholdSampler(threshold=0.6, min_tokens=2, temperature=0.8, block_size=8, kv_cache=True),
              LowConfidenceSampler(steps=8, block_size=8, kv_cache=True)]
  gen_ids = [gen.encode_prompt(p) for p in PROMPTS]
  handles = [engine.submit(Request(ids, 16, smp, seed=seed)) for ids, smp, seed in zip(gen_ids, samplers, seeds)]
  results = [h.result(timeout=120) for h in handles]
  for done, p, smp, seed in zip(results, PROMPTS, samplers, seeds):
    want = gen.generate([p], max_new_tokens=16, seed=seed, sampler=smp).completions[0]
    assert done.text == want.text
  # steps=3 over blocks of 8 takes 3 passes a block (k = 3, 3, 2), after the prompt's.
  first = results[0]
  assert first.passes == 1 + 3 * -(-max(first.completion_tokens, 1) // 8)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_infilling_matches_the_generator_and_respects_max_tokens(loaded, engine):
  """A fill-in-the-middle request in the slots gives the one-shot cached
  sampler's middle for the same suffix, seed and settings (two code paths,
  one rule), sampled as well as greedy; the middle never exceeds max_tokens."""
  gen = Generator(loaded)
  cases = [("def f(x):\n", "\n    return y\n", 11, {}), ("x = ", "\nprint(x)\n", 16, dict(temperature=1.0))]
  handles = [engine.submit(_request(loaded, p, max_tokens=n, suffix=suf, seed=3, **kw)) for p, suf, n, kw in cases]
  for h, (p, suf, n, kw) in zip(handles, cases):
    done = h.result(timeout=120)
    want = gen.generate([p], max_new_tokens=n, seed=3, suffixes=[suf],
                        sampler=ThresholdSampler(block_size=8, kv_cache=True, **kw)).completions[0]
    assert done.text == want.text and done.completion_tokens == len(want.tokens) <= n


@pytest.mark.slow
def test_a_shifted_head_matches_the_generator(loaded):
  """A model scoring token i from state i - 1 (shift_logits) decodes the same in
  the engine, whose slots keep each row's last state, as in the one-shot sampler."""
  import dataclasses
  spec = model_spec(dataclasses.replace(loaded.spec.cfg, shift_logits=True), None)
  shifted = dataclasses.replace(loaded, spec=spec)
  gen = Generator(shifted)
  e = Engine(shifted, num_slots=2, max_prompt=32, max_new_tokens=16, block_size=8).start()
  try:
    handles = [e.submit(_request(shifted, p, max_tokens=16, **kw)) for p, kw in zip(PROMPTS[:2], SETTINGS[:2])]
    for h, p, kw in zip(handles, PROMPTS, SETTINGS):
      want = gen.generate([p], max_new_tokens=16, seed=0,
                          sampler=ThresholdSampler(block_size=8, kv_cache=True, **kw)).completions[0]
      assert h.result(timeout=120).text == want.text
  finally:
    e.close(deadline_s=1)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_passes_over_some_slots_match_the_generator(loaded, engine):
  """Two requests in 4 slots run passes over the first 2 only (rows sliced
  out of the state, written back in place, the cache by its written window)."""
  gen = Generator(loaded)
  before = engine.stats["steps_with_head"]
  handles = [engine.submit(_request(loaded, p, max_tokens=20, **kw)) for p, kw in zip(PROMPTS[:2], SETTINGS[:2])]
  for h, p, kw in zip(handles, PROMPTS, SETTINGS):
    want = gen.generate([p], max_new_tokens=20, seed=0,
                        sampler=ThresholdSampler(block_size=8, kv_cache=True, **kw)).completions[0]
    assert h.result(timeout=120).text == want.text
  assert engine.stats["steps_with_head"] > before


def test_finished_blocks_ride_when_half_wait_or_one_waited():
  first = ride_with_head(np.array([True, False, False, False]), False)
  assert first == (False, True)  # one of four waits: the others run a short pass
  assert ride_with_head(np.array([True, False, False, False]), first[1]) == (True, False)  # it waits at most one
  assert ride_with_head(np.array([True, True, False, False]), False) == (True, False)
  assert ride_with_head(np.array([True]), False) == (True, False)  # alone, a waiting block always rides
  assert ride_with_head(np.zeros(4, bool), True) == (False, False)


def test_passes_pick_the_weight_layout_by_size(loaded):
  """On CPU few token rows read the [out, in] copy, more the trained layout;
  one layout when asked for."""
  e = Engine(loaded, num_slots=8, max_prompt=32, max_new_tokens=16, block_size=8)
  assert e.weight_layout_for(FEW_ROWS) == "out_in" and e.weight_layout_for(FEW_ROWS + 1) == "in_out"
  assert e.weight_layouts == ["in_out", "out_in"]
  one = Engine(loaded, num_slots=8, max_prompt=32, max_new_tokens=16, block_size=8, weight_layout="in_out")
  assert one.weight_layout_for(8) == one.weight_layout_for(128) == "in_out" and one.weight_layouts == ["in_out"]


def test_an_int8_copy_serves_prefills_up_to_its_kernels_rows(loaded):
  """With int8 weights (and the CPU kernel) prefills of up to the kernel's
  rows read the int8 copy, as the AR path's do; longer ones the trained
  layout in float32."""
  from mdlm_jax import kernels
  if not kernels.native_kernel_ready():
    pytest.skip("no C++ compiler on this machine: int8 products take XLA's path")
  e = Engine(loaded, num_slots=2, max_prompt=32, max_new_tokens=16, block_size=8, decode_dtype="int8")
  rows = kernels.int8.KERNEL_MAX_ROWS
  assert rows > FEW_ROWS
  assert e.weight_layout_for(rows) == "out_in" and e.weight_layout_for(rows + 1) == "in_out"


@pytest.mark.slow  # compiles and reads a pass's HLO (about 14 s)
def test_passes_do_not_copy_the_cache(loaded):
  """A pass (over the first slots, or all) must update the slot state in
  place: a copy of the whole per-row cache costs more than the pass itself."""
  import re
  e = Engine(loaded, num_slots=8, max_prompt=32, max_new_tokens=16, block_size=8)
  full = "|".join(",".join(str(d) for d in shape) for shape in e.cache_shapes)
  # Passes over some slots, with and without finished blocks, and over all
  # (a guided one writes the host's commits first, in the same program).
  for rows, with_head, guided in ((1, True, False), (1, False, False), (8, False, False), (8, True, True)):
    hlo = e.pass_hlo(rows, with_head, guided)
    copies = re.findall(rf"= f32\[(?:{full})\]\S* copy\(", hlo)
    assert not copies, f"rows={rows}, with_head={with_head}, guided={guided}: {len(copies)} copies of the cache"
    if rows == e.num_slots:
      # Each row's new keys land by one scatter; a dynamic-update-slice
      # producing the whole buffer here rewrites a whole layer of it.
      rewrites = re.findall(rf"dynamic-update-slice\S* = f32\[(?:{full})\]", hlo)
      assert not rewrites, f"rows={rows}, with_head={with_head}: {len(rewrites)} whole-layer rewrites"


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_sampled_tokens_do_not_depend_on_company(loaded, engine):
  req = _request(loaded, PROMPTS[0], max_tokens=16, temperature=1.0, seed=7, threshold=0.8, min_tokens=2)
  alone = engine.submit(req).result(timeout=120).text
  crowd = [engine.submit(_request(loaded, p, max_tokens=24, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)]
  again = engine.submit(req)
  assert again.result(timeout=120).text == alone
  for h in crowd:
    h.result(timeout=120)
  other = engine.submit(_request(loaded, PROMPTS[0], max_tokens=16, temperature=1.0, seed=8, threshold=0.8,
                                 min_tokens=2)).result(timeout=120).text
  assert other != alone or len(alone) == 0


def test_tiny_top_p_is_greedy(loaded, engine):
  greedy = engine.submit(_request(loaded, PROMPTS[0], max_tokens=16)).result(timeout=120).text
  nucleus = engine.submit(_request(loaded, PROMPTS[0], max_tokens=16, temperature=1.5, top_p=1e-6, seed=5))
  assert nucleus.result(timeout=120).text == greedy


def test_drafts_sharpen_and_end_at_the_answer(loaded, engine):
  h = engine.submit(_request(loaded, PROMPTS[1], max_tokens=24, min_tokens=1, threshold=1.0), want_drafts=True)
  events = list(h.events(timeout=120))
  drafts = [e.text for e in events if e.kind == "draft"]
  deltas = "".join(e.text for e in events if e.kind == "delta")
  done = events[-1]
  assert done.kind == "done" and drafts[0] == MASK_TEXT * 24
  assert drafts[-1] == done.text == deltas
  masks = [d.count(MASK_TEXT) for d in drafts]
  assert all(a >= b for a, b in zip(masks, masks[1:])) and masks[-1] == 0
  assert len(drafts) > 3  # one token a pass: many drafts


def test_stop_strings_and_length(loaded, engine):
  free = engine.submit(_request(loaded, PROMPTS[0], max_tokens=24)).result(timeout=120)
  if len(free.text) >= 3:
    stop = free.text[1:3]
    cut = engine.submit(_request(loaded, PROMPTS[0], max_tokens=24, stop=(stop,))).result(timeout=120)
    assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.find(stop)]
    assert cut.completion_tokens < free.completion_tokens  # the tokens of the text returned, no more
  short = engine.submit(_request(loaded, PROMPTS[0], max_tokens=5)).result(timeout=120)
  assert short.completion_tokens <= 5


def test_an_end_listener_is_called_once_with_every_event_waiting(loaded, engine):
  """A caller that wants only the end (a response sent whole, `result`) is
  woken once, at the end, and every event is still there in order; a
  listener to every event is called once an event."""
  h = engine.submit(_request(loaded, PROMPTS[1], max_tokens=16, threshold=1.0, min_tokens=1), want_drafts=True)
  calls = {"end": 0, "every": 0}
  h.add_listener(lambda: calls.__setitem__("end", calls["end"] + 1), end_only=True)
  h.add_listener(lambda: calls.__setitem__("every", calls["every"] + 1))
  done = h.result(timeout=120)
  assert done.kind == "done" and calls["end"] == 1
  assert calls["every"] >= 3  # one draft a pass, over at least two blocks, and the end
  late = []  # a listener added after the end is called at once
  h.add_listener(lambda: late.append(1), end_only=True)
  assert late == [1]
  again = engine.submit(_request(loaded, PROMPTS[1], max_tokens=16, threshold=1.0, min_tokens=1), want_drafts=True)
  polled, ended = [], threading.Event()
  again.add_listener(lambda: (polled.append(again.poll()), ended.set()), end_only=True)
  assert ended.wait(120)
  kinds = [e.kind for e in polled[0]]  # drafts, deltas and the end: all at once
  assert kinds[-1] == "done" and {"draft", "delta"} <= set(kinds) and polled[0][-1].text == done.text


def test_a_faster_effort_takes_fewer_passes(loaded, engine):
  """The same prompt at each effort, as the server maps reasoning_effort: each
  faster preset commits more per pass, so it spends fewer passes, and no
  preset spends more than its min_tokens allow."""
  from mdlm_jax.sampling.presets import EFFORTS
  prompt = Generator(loaded).encode_prompt(PROMPTS[1])
  passes, tokens = {}, {}
  for effort in EFFORTS:
    sampler = engine.sampler_for(effort)
    done = engine.submit(Request(prompt, 24, sampler, seed=0)).result(timeout=120)
    passes[effort], tokens[effort] = done.passes, done.completion_tokens
    assert done.passes <= 1 + 3 * -(-8 // sampler.min_tokens), effort  # the prefill, then 3 blocks of 8
  assert passes["instant"] < passes["medium"] < passes["high"], passes
  assert passes["instant"] <= passes["low"] <= passes["medium"], passes


def test_cancel_frees_the_slot_and_errors_are_clear(loaded):
  e = Engine(loaded, num_slots=1, max_prompt=32, max_new_tokens=24, block_size=8, max_queue=1).start()
  try:
    slow = e.submit(_request(loaded, PROMPTS[0], max_tokens=24, min_tokens=1, threshold=1.0))
    deadline = time.monotonic() + 60
    while slow.slot is None and time.monotonic() < deadline:  # admitted: the queue is empty again
      time.sleep(0.001)
    waiting = e.submit(_request(loaded, PROMPTS[2], max_tokens=8))
    with pytest.raises(QueueFull):
      e.submit(_request(loaded, PROMPTS[2], max_tokens=8))
    slow.cancel()
    assert slow.result(timeout=60).finish_reason == "cancelled"
    assert waiting.result(timeout=60).finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="max_tokens"):
      e.submit(_request(loaded, PROMPTS[0], max_tokens=25))
    with pytest.raises(ValueError, match="prompt has"):
      e.submit(Request([1] * 33, 8, ThresholdSampler(block_size=8, kv_cache=True)))
    with pytest.raises(ValueError, match="prompt and suffix have .* tokens; this engine takes 1 to 32"):
      e.submit(_request(loaded, PROMPTS[0], max_tokens=8, suffix="x" * 40))
    with pytest.raises(ValueError, match="blocks of 8"):
      e.submit(Request([1], 8, ThresholdSampler(block_size=16, kv_cache=True)))
  finally:
    e.close(deadline_s=1)
  with pytest.raises(EngineClosed):
    e.submit(_request(loaded, PROMPTS[0], max_tokens=8))


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_a_request_is_held_to_the_context_its_slot_reserves(loaded):
  """max_context bounds prompt + suffix + generation (in blocks), whatever
  each bound alone allows; the cache holds just that, and a request that fits
  exactly decodes as the one-shot sampler does."""
  from mdlm_jax.engine.engine import ContextLengthExceeded
  gen = Generator(loaded)
  prompt = gen.encode_prompt(PROMPTS[1])
  p = len(prompt)
  e = Engine(loaded, num_slots=2, max_prompt=32, max_new_tokens=24, block_size=8, max_context=p + 24)
  assert e.kv_cache_bytes == e.cache_buffer_bytes  # what the slots really hold
  assert e.cache_buffer_bytes < Engine(loaded, num_slots=2, max_prompt=32, max_new_tokens=24,
                                       block_size=8).cache_buffer_bytes
  e.start()
  try:
    smp = ThresholdSampler(block_size=8, kv_cache=True, threshold=0.9, min_tokens=2)
    with pytest.raises(ContextLengthExceeded, match=f"{p + 1} tokens and max_tokens=17 needs {p + 25} .*context is"
                                                    f" {p + 24}"):
      e.submit(Request(prompt + [prompt[-1]], 17, smp))
    h = e.submit(Request(prompt, 24, smp, seed=3))
    deadline = time.monotonic() + 60
    while h.slot is None and time.monotonic() < deadline:
      time.sleep(0.001)
    assert e.kv_tokens_in_use() in (p + 24, 0)  # 0: already done
    done = h.result(timeout=120)
    want = gen.generate([PROMPTS[1]], max_new_tokens=24, seed=3, sampler=smp).completions[0]
    assert done.text == want.text
    assert e.kv_tokens_in_use() == 0
  finally:
    e.close(deadline_s=1)
  with pytest.raises(ValueError, match="max_context"):
    Engine(loaded, num_slots=1, max_prompt=32, max_new_tokens=24, block_size=8, max_context=8)


@pytest.mark.slow
def test_mesh_engine_matches_one_device(tiny_checkpoints, loaded, engine):
  mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
  sharded = checkpoints.load(tiny_checkpoints["mdlm"], mesh=mesh)
  e = Engine(sharded, num_slots=4, max_prompt=32, max_new_tokens=24, block_size=8, mesh=mesh, admit_batch=4)
  try:
    reqs = [_request(loaded, p, max_tokens=16, temperature=1.0, seed=3, **kw) for p, kw in zip(PROMPTS, SETTINGS)]
    handles = [e.submit(r) for r in reqs]  # waiting together: their prefills batch over the sharded slots
    e.start()
    got = [h.result(timeout=120).text for h in handles]
  finally:
    e.close(deadline_s=1)
  want = [h.result(timeout=120).text for h in [engine.submit(r) for r in reqs]]
  assert got == want and e.stats["prefills"] < len(reqs)


def test_passes_published_a_pass_late_reuse_slots_cleanly(loaded, engine):
  """The engine dispatches each pass before publishing the last
  (`run_ahead`): five requests of two lengths through four slots, the
  later ones taking slots freed while a pass of their last holder was still
  unpublished, each give exactly the one-shot sampler's text."""
  gen = Generator(loaded)
  before = engine.stats["steps_run_ahead"]
  jobs = [(p, 8) for p in PROMPTS] + [(p, 16) for p in PROMPTS[:2]]
  handles = [engine.submit(_request(loaded, p, max_tokens=n, **SETTINGS[1])) for p, n in jobs]
  sampler = ThresholdSampler(block_size=8, kv_cache=True, **SETTINGS[1])
  for h, (p, n) in zip(handles, jobs):
    want = gen.generate([p], max_new_tokens=n, seed=0, sampler=sampler).completions[0]
    done = h.result(timeout=120)
    assert (done.text, done.finish_reason) == (want.text, want.finish_reason)
  assert engine.stats["steps_run_ahead"] > before
  # By default only an accelerator's passes run ahead: on CPU the host's work takes their cores.
  assert Engine(loaded, num_slots=1, max_prompt=32, max_new_tokens=8, block_size=8).run_ahead == (
      jax.default_backend() != "cpu")


@pytest.mark.slow
def test_warmup_compiles_then_serves_the_same(loaded, engine):
  """After warmup, serving a request compiles nothing (XLA's compile events,
  not jit's dispatch caches, which may add entries for programs it has)."""
  import jax.monitoring
  from mdlm_jax.sampling.grammar import Grammar
  e = Engine(loaded, num_slots=4, max_prompt=32, max_new_tokens=24, block_size=8).warmup()
  # Rows 1, 2, 3, 4 x head or not x guided or not; prompts 16, 24, 32.
  assert e.compiled() == {"passes": 16, "prefills": 3}
  req = _request(loaded, PROMPTS[1], max_tokens=16)
  compiles = []
  listener = lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  e.start()
  try:
    got = e.submit(req).result(timeout=120).text
    e.submit(dataclasses.replace(req, grammar=Grammar.json_object(layout="compact"))).result(timeout=120)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
    e.close(deadline_s=1)
  assert not compiles
  assert got == engine.submit(req).result(timeout=120).text
  with pytest.raises(RuntimeError, match="before start"):
    e.warmup()


def test_pass_flops_and_timing(loaded):
  """pass_flops counts every matmul of a pass from the weights' shapes (an
  independent count), and pass_seconds times real passes, only before start()."""
  import numpy as np
  e = Engine(loaded, num_slots=4, max_prompt=32, max_new_tokens=16, block_size=8, weight_layout="in_out")
  cfg, s = loaded.spec.cfg, e.sc.cache_len
  blocks = loaded.params["blocks"]
  per_layer = [sum(int(np.prod(w.shape)) for part in b.values() for name, w in part.items() if w.ndim >= 2
                   and name != "scale") for b in blocks.values()]
  head = int(np.prod(loaded.params["head"].shape)) if "head" in loaded.params else cfg.vocab_size * cfg.embed_dim
  attention = 4 * s * cfg.num_heads * cfg.resolved_head_dim  # q k^T and p v over the whole cache, per layer
  encode = sum(2 * n + attention for n in per_layer)
  for slots, rows in ((1, 1), (3, 3), (4, 4)):
    assert e.pass_flops(slots, False) == pytest.approx(rows * 8 * (encode + 2 * head))
    assert e.pass_flops(slots, True) == pytest.approx(rows * 8 * (2 * encode + 2 * head))
  assert 0 < e.pass_seconds(1, True, repeats=2) < 60
  e.start()
  try:
    with pytest.raises(RuntimeError, match="before start"):
      e.pass_seconds(1, True)
  finally:
    e.close(deadline_s=1)


def test_passes_run_over_few_idle_slots(loaded):
  e = Engine(loaded, num_slots=16, max_prompt=32, max_new_tokens=16, block_size=8)
  assert [e.pass_rows(n) for n in range(1, 17)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16]


def test_prompt_buckets_pad_at_most_a_third():
  from mdlm_jax.engine.scheduling import prompt_bucket
  sizes = sorted({16 << k for k in range(8)} | {24 << k for k in range(8)})
  for n in range(1, 2000):
    want = min(s for s in sizes if s >= n)
    assert prompt_bucket(n, 10_000) == want
    assert n < 16 or (want - n) / want < 1 / 3
    assert prompt_bucket(n, 100) == min(want, 100)


@pytest.fixture(scope="module")
def fim_loaded(tmp_path_factory):
  """A tiny model trained two steps with fill-in-the-middle (its tokenizer,
  trained by the run, has the FIM pieces)."""
  from mdlm_jax.training import trainer
  from tests.conftest import load_config
  c = load_config("tiny")
  c.data.update(tokenizer="", tokenizer_max_chars=300_000, fim_rate=0.5)
  c.train.update(num_steps=2, checkpoint_every=2, log_every=1, eval_batches=1)
  workdir = str(tmp_path_factory.mktemp("fim"))
  trainer.train(c, workdir)
  return checkpoints.load(workdir)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_a_fim_trained_model_infills_from_its_psm_prompt(fim_loaded):
  """Prefix and suffix go into the prompt in the order the model was trained
  on, not into the cache: in the engine and in the one-shot generator alike."""
  from mdlm_jax.data import fim
  tok = fim_loaded.tokenizer
  gen = Generator(fim_loaded)
  sampler = ThresholdSampler(block_size=8, kv_cache=True, threshold=0.9, min_tokens=2)
  req = Request(gen.encode_prompt("x = ["), 8, sampler, seed=1, suffix_ids=tok.encode("]\nprint(x)\n"))
  e = Engine(fim_loaded, num_slots=2, max_prompt=64, max_new_tokens=16, block_size=8).start()
  try:
    prepared = e.prepare(req)
    assert list(prepared.suffix_ids) == [] and list(prepared.prompt_ids) == (
        [tok.bos_id, tok.piece_id(fim.PREFIX)] + tok.encode("x = [") + [tok.piece_id(fim.SUFFIX)] +
        tok.encode("]\nprint(x)\n") + [tok.piece_id(fim.MIDDLE)])
    done = e.submit(req).result(timeout=120)
  finally:
    e.close(deadline_s=1)
  want = gen.generate(["x = ["], suffixes=["]\nprint(x)\n"], max_new_tokens=8, sampler=sampler, seed=1)
  assert done.text == want.completions[0].text and done.completion_tokens <= 8


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "v": {"const": 3},
        "size": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/small"}]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/small"}, "maxItems": 2},
    },
    "required": ["ok", "kind", "v", "size", "tags"],
    "additionalProperties": False,
    "$defs": {"small": {"enum": [1, 2, 3]}},
}


@pytest.fixture(scope="module")
def guided_engine(loaded):
  e = Engine(loaded, num_slots=4, max_prompt=32, max_new_tokens=64, block_size=8).start()
  yield e
  e.close(deadline_s=1)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_constrained_outputs_validate_and_others_decode_as_alone(loaded, guided_engine):
  """JSON-schema requests (greedy and sampled) share passes with a plain one:
  each output parses and validates (jsonschema is the referee), and the
  plain request's tokens are exactly the one-shot sampler's."""
  import json

  import jsonschema

  from mdlm_jax.sampling.grammar import Grammar
  gen = Generator(loaded)
  # Compact: a tiny model would spend its tokens on whatever whitespace a layout allows.
  grammar = Grammar.json_schema(GUIDED_SCHEMA, layout="compact")
  guided = [guided_engine.submit(dataclasses.replace(_request(loaded, "x = ", max_tokens=64, seed=seed, **kw),
                                                     grammar=grammar))
            for seed, kw in [(0, {}), (1, dict(temperature=1.0)), (2, dict(temperature=1.0, threshold=0.5))]]
  plain = guided_engine.submit(_request(loaded, PROMPTS[0], max_tokens=20, **SETTINGS[0]))
  for h in guided:
    done = h.result(timeout=120)
    assert done.finish_reason == "stop", done
    jsonschema.validate(json.loads(done.text), GUIDED_SCHEMA)
  want = gen.generate([PROMPTS[0]], max_new_tokens=20, seed=0,
                      sampler=ThresholdSampler(block_size=8, kv_cache=True, **SETTINGS[0])).completions[0]
  assert plain.result(timeout=120).text == want.text
  assert guided_engine.stats["steps_guided"] > 0
  # Grammatical drafts commit more than one token a pass.
  assert guided_engine.stats["grammar_committed"] >= guided_engine.stats["steps_guided"]


def test_a_constrained_output_cut_by_max_tokens_is_a_prefix_with_length(loaded, guided_engine):
  import re

  from mdlm_jax.sampling.grammar import Grammar
  tok = loaded.tokenizer
  r = dataclasses.replace(_request(loaded, "x = ", max_tokens=6, temperature=1.0), grammar=Grammar.regex("[a-z]{20}"))
  done = guided_engine.submit(r).result(timeout=120)
  assert done.finish_reason == "length" and done.completion_tokens == 6
  assert re.fullmatch("[a-z]+", done.text) and len(tok.encode(done.text)) <= 6
  r = dataclasses.replace(_request(loaded, "x = ", max_tokens=12, temperature=1.0),
                          grammar=Grammar.regex("(yes|no)[0-9]"))
  done = guided_engine.submit(r).result(timeout=120)
  assert done.finish_reason == "stop" and re.fullmatch("(yes|no)[0-9]", done.text)


def test_top_logprobs_match_a_float64_log_softmax():
  from mdlm_jax.engine.slots import TOP_LOGPROBS, top_logprobs_of
  rng = np.random.default_rng()
  logits = rng.normal(size=(3, 5, 97)) * 3
  never = tuple(sorted(rng.choice(97, size=3, replace=False).tolist()))
  vals, ids = (np.asarray(x) for x in top_logprobs_of(jax.numpy.asarray(logits, jax.numpy.float32), never))
  z = np.delete(logits, never, axis=-1)
  lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
  ref = logits - lse[..., None]
  ref[..., never] = -np.inf
  want_ids = np.argsort(-ref, axis=-1, kind="stable")[..., :TOP_LOGPROBS]
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(vals, np.take_along_axis(ref, want_ids, -1), rtol=1e-5, atol=1e-5)


def test_logprobs_of_forced_and_proposed_tokens(loaded, guided_engine):
  """Under a grammar, tokens it forces are certain (log-probability 0) and the
  drawn ones are the top of the distribution under the bitmask (greedy)."""
  from mdlm_jax.sampling.grammar import Grammar
  r = dataclasses.replace(_request(loaded, "x = ", max_tokens=12), grammar=Grammar.regex("(yes|no)[0-9]"), logprobs=2)
  events = list(guided_engine.submit(r).events(timeout=120))
  entries = [e for ev in events for e in ev.logprobs or []]
  assert len(entries) == events[-1].completion_tokens
  tok = loaded.tokenizer
  assert tok.decode([i for i, _, _ in entries]) == events[-1].text
  for i, lp, alts in entries:
    assert alts[0][0] == i and abs(alts[0][1] - lp) < 1e-5 and lp <= 0
  text = events[-1].text
  forced = {"yes": "es", "no": "o"}[text[:-1]]  # after the first letter the word is forced
  forced_ids = tok.encode(forced)
  assert any(lp == 0.0 and alts == [(i, 0.0)] for i, lp, alts in entries if i in forced_ids)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_requests_admitted_together_share_prefills_and_decode_as_alone(loaded, engine):
  """Four requests waiting when an engine starts (prompts of different
  lengths, one infilling) are prefilled in fewer forwards than requests, and
  each decodes exactly what it decodes admitted alone."""
  cases = [(PROMPTS[0], "", SETTINGS[0]), (PROMPTS[1], "", SETTINGS[1]),
           ("def g(a, b):\n    ", "\n    return c\n", SETTINGS[0]), ("y = [", "", SETTINGS[2])]
  reqs = [_request(loaded, p, max_tokens=16, suffix=suf, seed=i, **kw) for i, (p, suf, kw) in enumerate(cases)]
  e = Engine(loaded, num_slots=4, max_prompt=32, max_new_tokens=24, block_size=8, admit_batch=4)
  handles = [e.submit(r) for r in reqs]
  e.start()
  try:
    got = [h.result(timeout=120).text for h in handles]
  finally:
    e.close(deadline_s=1)
  assert e.stats["admitted"] == len(cases) and e.stats["prefills"] < len(cases)
  alone = []
  for r in reqs:  # the module's engine, one request at a time
    alone.append(engine.submit(r).result(timeout=120).text)
  assert got == alone


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_an_idle_engine_waits_for_announced_requests_and_admits_them_together(loaded):
  """Four requests announced at once, submitted over 100 ms: the first waits
  for the others and all four share one prefill; a lone request does not wait."""
  import threading
  e = Engine(loaded, num_slots=4, max_prompt=32, max_new_tokens=24, block_size=8, admit_batch=4,
             admit_wait_s=30.0).start()  # far above a first-use compile on a loaded machine
  try:
    reqs = [_request(loaded, p, max_tokens=8, seed=i) for i, p in enumerate(("x = ", "y = [", "z = 1 +", "w = 2"))]
    e.arriving(+4)
    handles = [e.submit(reqs[0])]
    e.arriving(-1)

    def later():
      time.sleep(0.1)
      for r in reqs[1:]:
        handles.append(e.submit(r))
        e.arriving(-1)

    t = threading.Thread(target=later)
    t.start()
    t.join()
    for h in handles:
      assert h.result(timeout=120).finish_reason in ("stop", "length")
    assert e.stats["prefills"] == 1 and e.stats["admit_waits"] == 1
    t0 = time.monotonic()
    e.submit(reqs[0]).result(timeout=120)  # nothing else announced: straight in
    assert e.stats["admit_waits"] == 1 and time.monotonic() - t0 < 30.0
  finally:
    e.close(deadline_s=1)
  with pytest.raises(ValueError, match="admit_wait_s"):
    Engine(loaded, num_slots=1, max_prompt=32, max_new_tokens=24, block_size=8, admit_wait_s=-1)


@pytest.mark.parametrize("seed", range(3))
def test_admit_groups_cover_every_request_once_with_bounded_padding(seed):
  from mdlm_jax.engine.scheduling import ADMIT_TOKENS, admit_groups, admit_sizes, prompt_bucket
  rng = np.random.default_rng(seed)
  buckets = [prompt_bucket(int(n), 512) for n in rng.integers(1, 513, size=int(rng.integers(1, 17)))]
  groups = admit_groups(buckets, 8)
  assert sorted(i for _, g in groups for i in g) == list(range(len(buckets)))
  for bucket, g in groups:
    assert bucket == max(buckets[i] for i in g) and all(2 * buckets[i] >= bucket for i in g)
    assert len(g) in admit_sizes(bucket, 8) and len(g) * bucket <= max(ADMIT_TOKENS, bucket)
  # By hand: six short prompts go as 4 + 2, a long one alone, a 16 never beside a 64.
  assert admit_groups([16] * 6, 8) == [(16, [0, 1, 2, 3]), (16, [4, 5])]
  assert admit_groups([512, 16], 8) == [(512, [0]), (16, [1])]
  assert [len(g) for _, g in admit_groups([64, 16, 48, 64], 4)] == [2, 1, 1]
  assert admit_sizes(96, 8) == [1, 2, 4] and admit_sizes(512, 8) == [1]


def _first_block_logprobs(loaded, prompt, bs, chunk):
  """Float64 log-softmax (the never-generated ids excluded) of the first block's logits, all
  [MASK], from the uncached forward: prompt rows read the prompt up to the end
  of their chunk (all of it when `chunk` is None), block rows read everything."""
  from mdlm_jax import kernels
  from mdlm_jax.model.spec import bind
  p = len(prompt)
  tokens = np.asarray([list(prompt) + [loaded.tokenizer.mask_id] * bs], np.int32)
  rows = np.arange(p + bs)
  q_end = np.where(rows < p, p if chunk is None else np.minimum((rows // (chunk or 1) + 1) * (chunk or 1), p), p + bs)
  mask = kernels.AttentionMask(kind="prefix", q_end=jax.numpy.asarray(q_end[None], np.int32))
  logits = np.asarray(bind(loaded.spec, loaded.params)(tokens, mask=mask), np.float64)[0, p:]
  logits[:, list(never_generated(loaded.tokenizer))] = -np.inf
  return logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
      - logits.max(-1, keepdims=True)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_chunked_prefill_reads_earlier_chunks_and_lets_others_decode_meanwhile(loaded):
  """A prompt longer than prefill_chunk is encoded a chunk a turn: its first
  block's distribution is the uncached model's with the prompt read
  chunk-causally (which the reference tells apart from reading it all
  bidirectionally, as one prefill does), and a short request admitted beside
  it finishes before the long prompt's last chunk."""
  bs, chunk = 8, 16
  gen = Generator(loaded)
  long_prompt = gen.encode_prompt("import os\nimport sys\n" * 12)[:90]
  smp = ThresholdSampler(block_size=bs, kv_cache=True, threshold=1.0, min_tokens=bs)
  e = Engine(loaded, num_slots=2, max_prompt=96, max_new_tokens=bs, block_size=bs, prefill_chunk=chunk)
  long = e.submit(Request(long_prompt, bs, smp, logprobs=5))
  short = e.submit(Request(gen.encode_prompt(PROMPTS[0]), bs, smp))
  chunks_when_short_ended = []
  short.add_listener(lambda: chunks_when_short_ended.append(e.stats["prefill_chunks"]) if short.finished else None)
  e.start()
  try:
    entries = [x for ev in long.events(timeout=120) for x in ev.logprobs or []]
    short.result(timeout=120)
  finally:
    e.close(deadline_s=1)
  assert entries, "the long request returned no tokens to compare"
  n_chunks = -(-len(long_prompt) // chunk)
  assert e.stats["prefill_chunks"] == n_chunks
  assert chunks_when_short_ended[0] < n_chunks  # the short request did not wait for the whole prefill
  want = _first_block_logprobs(loaded, long_prompt, bs, chunk)
  for j, (tok, logp, alts) in enumerate(entries):
    np.testing.assert_allclose(logp, want[j, tok], atol=2e-4)
    np.testing.assert_allclose([v for _, v in alts], np.sort(want[j])[::-1][:5], atol=2e-4)
  whole = _first_block_logprobs(loaded, long_prompt, bs, None)
  assert max(abs(lp - whole[j, t]) for j, (t, lp, _) in enumerate(entries)) > 1e-3


def test_prefill_chunk_is_checked(loaded):
  with pytest.raises(ValueError, match="prefill_chunk"):
    Engine(loaded, num_slots=1, max_prompt=32, max_new_tokens=8, block_size=8, prefill_chunk=4)
  # Off when no prompt is longer than a chunk.
  assert Engine(loaded, num_slots=1, max_prompt=32, max_new_tokens=8, block_size=8, prefill_chunk=64).prefill_chunk == 0


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_logit_moves_match_the_generator_row_by_row(loaded, engine):
  """Penalties and logit_bias apply to their own rows of a shared pass: each
  request gives the one-shot sampler's tokens alone, and a request without
  them decodes as if nobody had asked."""
  gen = Generator(loaded)
  free = gen.generate([PROMPTS[0]], max_new_tokens=16, seed=0,
                      sampler=ThresholdSampler(block_size=8, kv_cache=True, threshold=0.9, min_tokens=2))
  common = max(set(free.completions[0].tokens), key=free.completions[0].tokens.count)
  moves = [dict(frequency_penalty=2.0, presence_penalty=0.5), dict(logit_bias=((common, -100.0),)), {}]
  handles = [engine.submit(_request(loaded, PROMPTS[0], max_tokens=16, threshold=0.9, min_tokens=2, **kw))
             for kw in moves]
  got = [h.result(timeout=120).text for h in handles]
  for text, kw in zip(got, moves):
    want = gen.generate([PROMPTS[0]], max_new_tokens=16, seed=0,
                        sampler=ThresholdSampler(block_size=8, kv_cache=True, threshold=0.9, min_tokens=2, **kw))
    assert text == want.completions[0].text
  assert got[2] == free.completions[0].text and got[0] != got[2]
  with pytest.raises(ValueError, match="outside the vocabulary"):
    engine.submit(_request(loaded, "x", max_tokens=8, logit_bias=((loaded.spec.cfg.vocab_size, 1.0),)))


@pytest.mark.slow  # an engine of its own (about 20 s)
def test_a_reused_slot_hides_the_last_requests_keys(loaded):
  """Admission writes only the prompt's slots of a cache row: what a longer
  earlier request left past them must stay unread, and its own slots hold its keys."""
  gen = Generator(loaded)
  e = Engine(loaded, num_slots=1, max_prompt=64, max_new_tokens=16, block_size=8).start()
  try:
    for prompt in (PROMPTS[1] * 2, "x = ", PROMPTS[1], "def f(x):\n"):
      done = e.submit(_request(loaded, prompt, max_tokens=16, threshold=0.9, min_tokens=2)).result(timeout=120)
      want = gen.generate([prompt], max_new_tokens=16, seed=0,
                          sampler=ThresholdSampler(block_size=8, kv_cache=True, threshold=0.9, min_tokens=2))
      assert done.text == want.completions[0].text, prompt
  finally:
    e.close(deadline_s=1)


@pytest.mark.slow  # an AR engine of its own (about 19 s)
def test_an_autoregressive_checkpoint_decodes_as_its_ar_sampler(tiny_checkpoints):
  """An AR checkpoint in the engine (blocks of one token, its head read shifted) writes
  exactly the KV-cached AR sampler's greedy tokens, requests sharing passes."""
  from mdlm_jax.sampling.generate import generator_for
  from mdlm_jax.sampling.ar import ARSampler
  ar = checkpoints.load(tiny_checkpoints["ar"])
  with pytest.raises(ValueError, match="block_size must be 1"):
    Engine(ar, num_slots=2, max_prompt=32, max_new_tokens=16, block_size=8)
  e = Engine(ar, num_slots=3, max_prompt=32, max_new_tokens=16).start()
  try:
    assert e.sc.block_size == 1
    gen = generator_for(ar)
    handles = [e.submit(Request(e.encode(p), 12, e.sampler_for(effort), seed=0))
               for p, effort in zip(PROMPTS, ("instant", "medium", "high"))]
    for h, p in zip(handles, PROMPTS):
      done = h.result(timeout=120)
      want = gen.generate([p], max_new_tokens=12, sampler=ARSampler(12, temperature=0.0)).completions[0]
      assert done.text == want.text and done.finish_reason == want.finish_reason
  finally:
    e.close(deadline_s=1)


@pytest.mark.slow  # CI: tests/diffusion/test_a2d.py checks the cached pass, tests/sampling the in-order rule
def test_an_adapted_ar_model_decodes_in_the_engine_as_in_the_generator(tiny_checkpoints):
  """A causal-clean model with adapters on its noisy rows (an AR model adapted to
  diffusion), its adapters random: the engine's passes write the one-shot sampler's
  tokens, efforts decoding in order."""
  adapted = adapted_from(checkpoints.load(tiny_checkpoints["ar"]))
  gen = Generator(adapted)
  e = Engine(adapted, num_slots=2, max_prompt=32, max_new_tokens=16).start()
  try:
    for effort in ("medium", "instant"):
      sampler = e.sampler_for(effort)
      assert sampler.in_order and sampler.block_size == 2
      h = e.submit(Request(e.encode(PROMPTS[0]), 12, sampler, seed=0))
      want = gen.generate([PROMPTS[0]], max_new_tokens=12, seed=0, sampler=sampler).completions[0]
      assert h.result(timeout=120).text == want.text
  finally:
    e.close(deadline_s=1)


@pytest.mark.parametrize("x64", [False, True])
def test_request_keys_formed_on_the_host_are_jaxs_keys_of_the_seeds(x64):
  """An admission forms its request's key on the host (on the device it
  waited for the running pass): the key data `jax.random.key` gives, for
  fresh seeds of every size and sign."""
  from mdlm_jax.engine.engine import _request_key
  rng = np.random.default_rng()
  seeds = [0, 1, -1, 2 ** 31 - 1, -2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, -2 ** 63]
  seeds += [int(rng.integers(-2 ** 63, 2 ** 63 - 1)) for _ in range(8)] + [int(rng.integers(0, 2 ** 31))]
  with jax.enable_x64(x64):
    for seed in seeds:
      want = np.asarray(jax.random.key_data(jax.random.key(seed)))
      got = _request_key(seed)
      assert got.dtype == np.uint32 and got.tolist() == want.tolist(), f"seed {seed}"
