"""Diffusion samplers: invariants, determinism, the p(x0) cache, EOS, infilling."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.compiles import compilations
from tests.conftest import load_config
from mdlm_jax.parallel import sharding
from mdlm_jax.checkpoints.loading import LoadedModel
from mdlm_jax.model.spec import init_params, model_spec
from mdlm_jax.model import ModelConfig
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.canvas import make_canvas
from mdlm_jax.sampling.generate import Generator
from mdlm_jax.sampling.samplers import AncestralSampler, Layout, LowConfidenceSampler, ThresholdSampler
from mdlm_jax.data.tokenizer import Tokenizer

SAMPLERS = [
    AncestralSampler(steps=12, temperature=1.0),
    LowConfidenceSampler(steps=4, block_size=8, temperature=0.7),
    LowConfidenceSampler(steps=6, block_size=0, temperature=0.0),
    ThresholdSampler(threshold=0.05, block_size=8, temperature=1.0),
    ThresholdSampler(threshold=0.1, block_size=8, temperature=1.0, kv_cache=True),
    LowConfidenceSampler(steps=4, block_size=8, kv_cache=True),
]


@pytest.fixture(scope="module")
def generator(tiny_tokenizer_path):
  return _generator(tiny_tokenizer_path, shift_logits=False)


@pytest.fixture(scope="module")
def shifted_generator(tiny_tokenizer_path):
  return _generator(tiny_tokenizer_path, shift_logits=True)


def _generator(tiny_tokenizer_path, shift_logits):
  tok = Tokenizer.from_file(tiny_tokenizer_path)
  cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64,
                    shift_logits=shift_logits)
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1}), jax.devices()[:1])
  spec = model_spec(cfg, mesh)
  params = init_params(spec, seed=3)
  return Generator(LoadedModel(spec, params, tok, load_config("tiny"), 0, False))


def committed_never_change(drafts, mask_id):
  for a, b in zip(drafts[:-1], drafts[1:]):
    keep = a != mask_id
    if not np.array_equal(a[keep], b[keep]):
      return False
  return True


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: type(s).__name__)
def test_invariants(generator, sampler):
  tok = generator.tok
  prompts = ["def add(a, b):\n", "import os\nimport sys\n\n"]
  suffixes = ["\n    return c\n", ""] if not getattr(sampler, "is_block_causal", False) else ["", ""]
  ids = [generator.encode_prompt(p) for p in prompts]
  canvas = make_canvas(ids, 24, mask_id=tok.mask_id, pad_id=tok.pad_id, suffixes=[tok.encode(s) for s in suffixes])
  layout = Layout(canvas.gen_start, canvas.gen_len, tok.mask_id, tok.eos_id)
  out = generator.decode_canvas(generator.loaded.params, jnp.asarray(canvas.tokens), jnp.asarray(canvas.valid),
                                jnp.asarray(canvas.positions), rule.row_keys(jnp.arange(2)), sampler=sampler,
                                layout=layout, record=True)
  out = jax.device_get(out)
  final = out["tokens"]
  # Prompt, suffix and padding are never changed.
  np.testing.assert_array_equal(final[canvas.fixed], canvas.tokens[canvas.fixed])
  drafts = out["drafts"][:int(out["num_drafts"])]
  assert len(drafts) == int(out["steps"]) + 1
  np.testing.assert_array_equal(drafts[0], canvas.tokens)
  np.testing.assert_array_equal(drafts[-1], final)
  # A committed token is never changed again, and the masks only decrease.
  assert committed_never_change(drafts, tok.mask_id)
  masks = [(d == tok.mask_id).sum() for d in drafts]
  assert all(a >= b for a, b in zip(masks[:-1], masks[1:]))
  # Every position before a row's first EOS is filled.
  for row in range(2):
    gen = final[row, canvas.gen_start:canvas.gen_start + canvas.gen_len]
    eos = np.flatnonzero(gen == tok.eos_id)
    head = gen[:eos[0]] if eos.size else gen
    assert not np.any(head == tok.mask_id)
    assert not np.any(gen == tok.pad_id) or eos.size


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: type(s).__name__)
def test_deterministic_for_a_seed(generator, sampler):
  a = generator.generate(["x = "], max_new_tokens=16, sampler=sampler, seed=5)
  b = generator.generate(["x = "], max_new_tokens=16, sampler=sampler, seed=5)
  assert a.completions[0].tokens == b.completions[0].tokens
  if sampler.temperature > 0:
    outs = {tuple(generator.generate(["x = "], max_new_tokens=16, sampler=sampler, seed=s).completions[0].tokens)
            for s in range(4)}
    assert len(outs) > 1


def test_px0_cache_changes_cost_not_samples(generator):
  # Many more steps than tokens: most steps unmask nothing and reuse p(x0).
  cached = generator.generate(["def f():\n"], max_new_tokens=8, sampler=AncestralSampler(steps=64), seed=2)
  plain = generator.generate(["def f():\n"], max_new_tokens=8, sampler=AncestralSampler(steps=64, cache=False),
                             seed=2)
  assert cached.completions[0].tokens == plain.completions[0].tokens
  assert plain.forward_passes == 64
  assert cached.forward_passes < 20


def test_step_counts(generator):
  r = generator.generate(["a"], max_new_tokens=16, sampler=LowConfidenceSampler(steps=4, block_size=8), seed=0)
  assert r.steps == 8 and r.forward_passes == 8  # 2 blocks x 4 steps
  r = generator.generate(["a"], max_new_tokens=16, sampler=ThresholdSampler(threshold=0.0, block_size=8), seed=0)
  assert r.steps == 2  # threshold 0 commits a whole block per step


@pytest.mark.parametrize("min_tokens,steps", [(3, 6), (4, 4), (8, 2), (1, 16)])
def test_threshold_floor_commits_min_tokens_per_pass(min_tokens, steps):
  """Nothing reaches threshold 1: each pass commits exactly the floor (what
  is left of the block at its end), the most confident positions first."""
  vocab, mask_id, eos_id = 12, 4, 2
  tokens = jnp.full((1, 18), mask_id, jnp.int32).at[0, :2].set(jnp.array([1, 7]))
  target = jnp.full((1, 18), 9, jnp.int32)
  lay = Layout(gen_start=2, gen_len=16, mask_id=mask_id, eos_id=eos_id)
  out = ThresholdSampler(threshold=1.0, min_tokens=min_tokens, block_size=8).run(
      _fake_denoise(target, vocab), tokens, jnp.ones((1, 18), bool), rule.row_keys(jnp.zeros(1)), lay, record=True)
  assert int(out["steps"]) == steps
  drafts = np.asarray(out["drafts"][:int(out["num_drafts"])])
  masks = [int((d == mask_id).sum()) for d in drafts]
  per_pass = [a - b for a, b in zip(masks[:-1], masks[1:])]
  want = [min(min_tokens, 8 - j * min_tokens) for j in range(-(-8 // min_tokens))] * 2
  assert per_pass == want
  assert np.all(drafts[-1][0, 2:] == 9)


def _fake_denoise(target, vocab):
  logits = jnp.where(jax.nn.one_hot(target, vocab, dtype=bool), 10.0, 0.0)
  return lambda tokens, t: jnp.broadcast_to(logits, tokens.shape + (vocab,))


def test_block_decoding_stops_rows_at_eos():
  vocab, mask_id, eos_id = 12, 4, 2
  tokens = jnp.full((1, 16), mask_id, jnp.int32).at[0, :2].set(jnp.array([1, 7]))
  valid = jnp.ones((1, 16), bool)
  target = jnp.full((1, 16), 9, jnp.int32).at[0, 7].set(eos_id)
  lay = Layout(gen_start=2, gen_len=14, mask_id=mask_id, eos_id=eos_id)
  out = LowConfidenceSampler(steps=2, block_size=4).run(_fake_denoise(target, vocab), tokens, valid,
                                                        rule.row_keys(jnp.zeros(1)), lay)
  # Blocks [2,6) and [6,10) are decoded; EOS at column 7 ends the row there.
  assert int(out["steps"]) == 4
  np.testing.assert_array_equal(np.asarray(out["tokens"][0, 2:10]), np.asarray(target[0, 2:10]))
  assert np.all(np.asarray(out["tokens"][0, 10:]) == mask_id)


def test_generator_trims_at_eos_and_stop_strings(generator):
  r = generator.generate(["def"], max_new_tokens=12, sampler=LowConfidenceSampler(steps=12, block_size=0), seed=0)
  text = r.completions[0].text
  assert text and r.completions[0].finish_reason in ("length", "stop")
  stop = text[len(text) // 2:len(text) // 2 + 1]
  r2 = generator.generate(["def"], max_new_tokens=12, sampler=LowConfidenceSampler(steps=12, block_size=0), seed=0,
                          stop=[stop])
  assert r2.completions[0].text == text[:text.find(stop)]
  assert r2.completions[0].finish_reason == "stop"
  # The tokens reported are those of the returned text, not those past the stop string.
  kept = r2.completions[0].tokens
  assert kept == r.completions[0].tokens[:len(kept)]
  assert generator.tok.decode(kept).startswith(r2.completions[0].text)
  assert len(generator.tok.decode(kept[:-1])) < len(r2.completions[0].text) or not kept


def test_canvas_layout():
  c = make_canvas([[1, 5, 6], [1]], 4, mask_id=9, pad_id=0, suffixes=[[7], [7, 8]], multiple=4)
  assert c.gen_start == 4 and c.tokens.shape == (2, 12)
  np.testing.assert_array_equal(c.tokens[0], [0, 1, 5, 6, 9, 9, 9, 9, 7, 0, 0, 0])
  np.testing.assert_array_equal(c.tokens[1], [0, 0, 0, 1, 9, 9, 9, 9, 7, 8, 0, 0])
  np.testing.assert_array_equal(c.positions[1, 3:10], np.arange(7))
  assert not c.fixed[:, 4:8].any() and c.fixed[:, :4].all() and c.fixed[:, 8:].all()
  with pytest.raises(ValueError, match=">= 1"):
    make_canvas([[1]], 0, mask_id=9, pad_id=0)


@pytest.mark.slow
def test_same_tokens_on_a_4_device_mesh(tiny_config, tmp_path):
  """Params sharded by the training rules, rows over 'data': same samples."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host devices")
  from mdlm_jax.training import trainer
  from mdlm_jax import checkpoints
  tiny_config.train.update(num_steps=2, checkpoint_every=2, log_every=1, eval_batches=1)
  trainer.train(tiny_config, str(tmp_path))
  one = Generator(checkpoints.load(str(tmp_path)))
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 2, "fsdp": 1, "tensor": 2}))
  four = Generator(checkpoints.load(str(tmp_path), mesh=mesh), mesh=mesh)
  wqkv = four.loaded.params["blocks"][0]["attn"]["wqkv"]  # decoded from [q/k/v heads, kv, embed] on CPU
  assert four.loaded.spec.cfg.weight_layout == "out_in"
  assert wqkv.sharding.spec == jax.sharding.PartitionSpec("tensor", None, "fsdp")
  prompts = ["def f(x):\n", "class A:\n", "import re\n", "x = 1\n"]
  for sampler in (AncestralSampler(steps=8), ThresholdSampler(threshold=0.3, block_size=8, temperature=1.0)):
    a = one.generate(prompts, max_new_tokens=16, sampler=sampler, seed=4)
    b = four.generate(prompts, max_new_tokens=16, sampler=sampler, seed=4)
    assert [c.tokens for c in a.completions] == [c.tokens for c in b.completions]


def test_infill_searches_lengths_and_keeps_prefix_suffix(generator):
  sampler = ThresholdSampler(threshold=0.2, block_size=0, temperature=1.0)
  completion, scores = generator.infill("def f(x):\n    y = ", "\n    return y\n", sampler=sampler,
                                        lengths=(2, 4, 8), seed=1)
  assert set(scores) == {2, 4, 8}
  assert len(completion.tokens) == min(scores, key=scores.get) or completion.finish_reason == "stop"
  # Scores are seeded: the same call gives the same numbers.
  rows = [generator.encode_prompt("x = 1"), generator.encode_prompt("import os")]
  np.testing.assert_array_equal(generator.nelbo_per_token(rows, seed=3), generator.nelbo_per_token(rows, seed=3))
  with pytest.raises(ValueError, match="positive"):
    generator.infill("a", "b", sampler=sampler, lengths=())


@pytest.mark.parametrize("which,sampler", [
    pytest.param("generator", LowConfidenceSampler(steps=4, block_size=8, temperature=1.0), marks=pytest.mark.slow),
    pytest.param("generator", ThresholdSampler(threshold=0.2, block_size=8, temperature=1.0), marks=pytest.mark.slow),
    ("shifted_generator", ThresholdSampler(threshold=0.2, block_size=8, temperature=1.0)),
], ids=["low_confidence", "threshold", "threshold_shifted_head"])
def test_kv_cached_blocks_equal_uncached_block_causal(request, which, sampler):
  import dataclasses
  generator = request.getfixturevalue(which)
  prompts = ["def f(x):\n", "import os\nimport re\n"]
  cached = generator.generate(prompts, max_new_tokens=20, sampler=dataclasses.replace(sampler, kv_cache=True),
                              seed=7)
  full = generator.generate(prompts, max_new_tokens=20, sampler=dataclasses.replace(sampler, block_causal=True),
                            seed=7)
  assert [c.tokens for c in cached.completions] == [c.tokens for c in full.completions]
  assert cached.steps == full.steps
  # One prefill and one pass per step: a finished block is encoded into the
  # cache by the first pass of the next block.
  assert cached.forward_passes == cached.steps  # the prompt rides along with the first block
  with pytest.raises(ValueError, match="uncached block-causal decoding cannot see a suffix"):
    generator.generate(prompts, max_new_tokens=8, sampler=dataclasses.replace(sampler, block_causal=True),
                       suffixes=["x", "y"])


@pytest.mark.slow
def test_cached_infilling_reads_the_suffix(generator):
  """Cached infilling keeps max_new_tokens, and a block's logits read the
  suffix encoded into the cache at the positions after the middle."""
  sampler = ThresholdSampler(threshold=1.0, min_tokens=1, block_size=8, kv_cache=True)
  out = generator.generate(["def f(x):\n"], max_new_tokens=11, sampler=sampler, suffixes=["\n    return x\n"])
  assert len(out.completions[0].tokens) <= 11
  # The logits of a block read the suffix: compare the first pass's proposals directly.
  tok = generator.tok
  from mdlm_jax.model.kv_cache import KVCache
  model = generator.loaded.model
  prompt = generator.encode_prompt("def f(x):\n")
  blk = [tok.mask_id] * 8
  def first_logits(suffix_ids):
    toks = jnp.asarray([suffix_ids + prompt + blk], jnp.int32)
    pos = jnp.asarray([[len(prompt) + 8 + i for i in range(len(suffix_ids))] + list(range(len(prompt) + 8))],
                      jnp.int32)
    cache = KVCache.init(model.cfg, 1, toks.shape[1])
    logits, _ = model.forward_cached(toks, pos, cache, commit=True, commit_len=len(suffix_ids) + len(prompt),
                                     new_block=8)
    return np.asarray(logits)
  a, b = first_logits(tok.encode("return 1")), first_logits(tok.encode("class Z:"))
  assert not np.allclose(a, b)


def test_presets_adapt_to_block_diffusion_models():
  from mdlm_jax.sampling.presets import PRESETS, adapt_to_model, sampler_for
  medium = sampler_for("medium")
  assert medium == PRESETS["medium"] and medium.kv_cache and medium.block_size == 32
  bd3 = adapt_to_model(medium, 16)
  assert bd3.block_size == 16 and bd3.kv_cache and bd3.threshold == medium.threshold
  assert adapt_to_model(medium, 0) == medium
  full = sampler_for("medium", kv_cache=False)
  assert adapt_to_model(full, 16) == full  # full-canvas passes keep their blocks
  assert adapt_to_model(AncestralSampler(), 16) == AncestralSampler()
  assert sampler_for("high", min_tokens=3).min_tokens == 3
  with pytest.raises(ValueError, match="--steps does not apply"):
    sampler_for("high", steps=8)
  with pytest.raises(ValueError, match="min_tokens must be >= 1"):
    sampler_for("medium", min_tokens=0)
  with pytest.raises(ValueError, match="unknown effort"):
    sampler_for("max")


def test_models_trained_on_whole_sequences_decode_exactly_by_default():
  """LLaDA, Dream and plain MDLM models get full-canvas passes (what their reference
  implementations run) unless the caller opts into cached blocks; BD3-LM models keep them."""
  from mdlm_jax.sampling.presets import for_model
  for effort in ("instant", "medium"):
    assert not for_model(effort, 0).kv_cache and for_model(effort, 0).block_size == 32
    assert for_model(effort, 0, kv_cache=True).kv_cache
    assert for_model(effort, 8).kv_cache and for_model(effort, 8).block_size == 8
  low = for_model("medium", 0, sampler="low_confidence", steps=8)
  assert isinstance(low, LowConfidenceSampler) and not low.kv_cache


def test_presets_commit_nested_sets():
  """From instant to high, each preset's threshold is at least the one before
  and its minimum at most: on the same confidences, each commits a subset of
  what the faster one commits, so the presets are ordered in speed."""
  from mdlm_jax.sampling.presets import EFFORTS, PRESETS
  assert EFFORTS == ("instant", "low", "medium", "high")
  for fast, slow in zip(EFFORTS, EFFORTS[1:]):
    assert PRESETS[fast].threshold <= PRESETS[slow].threshold, (fast, slow)
    assert PRESETS[fast].min_tokens >= PRESETS[slow].min_tokens, (fast, slow)
  assert len({(p.threshold, p.min_tokens) for p in PRESETS.values()}) == len(PRESETS)


def test_streaming_drafts_compile_once(generator):
  """Each call's draft handler is reached through one compiled callback."""
  sampler = ThresholdSampler(threshold=0.3, block_size=8)
  seen, compiled = [], []
  for i in range(3):
    with compilations() as names:
      generator.generate(["y = "], max_new_tokens=8, sampler=sampler, seed=i,
                         on_draft=lambda step, drafts, i=i: seen.append((i, step, drafts[0])))
    compiled.append(names)
  assert compiled[1] == compiled[2] == []  # no recompilation for a new handler
  for i in range(3):
    drafts = [d for j, _, d in seen if j == i]
    assert drafts[0] == "\u2591" * 8 and "\u2591" not in drafts[-1]


def test_in_order_floor_commits_the_leftmost_candidates():
  """rule.commit with in_order: the floor is the leftmost undecided positions, not the
  most confident; the threshold still adds any sure enough. Against a loop over rows."""
  from mdlm_jax.sampling import rule
  rng = np.random.default_rng()
  conf = rng.random((6, 9)).astype(np.float32)
  candidates = rng.random((6, 9)) < 0.6
  threshold = rng.choice([0.5, 0.9, 1.0], size=6).astype(np.float32)
  floor = rng.integers(1, 4, size=6)
  in_order = rng.random(6) < 0.5
  got = np.asarray(rule.commit(jnp.asarray(conf), jnp.asarray(candidates), jnp.asarray(threshold),
                               jnp.asarray(floor), jnp.asarray(in_order)))
  for r in range(6):
    cols = np.flatnonzero(candidates[r])
    ranked = cols if in_order[r] else cols[np.argsort(-conf[r, cols], kind="stable")]
    want = np.zeros(9, bool)
    want[ranked[:floor[r]]] = True
    want |= candidates[r] & (conf[r] >= threshold[r])
    np.testing.assert_array_equal(got[r], want, err_msg=str(r))


def test_the_steps_floor_is_lladas_schedule_row_by_row():
  """rule.floor: rows with `steps` commit LLaDA's get_num_transfer_tokens (n // steps each pass, the
  first n % steps passes one more), from the masks the block has left; rows without keep min_tokens."""
  from mdlm_jax.sampling import rule
  rng = np.random.default_rng()
  rows, width = 8, 16
  steps = rng.integers(0, 7, size=rows)
  d = rule.Decoding.broadcast(rows, threshold=rule.NEVER, min_tokens=3).replace(steps=steps.astype(np.int32))
  n = rng.integers(1, width + 1, size=rows)
  schedule = [[n[r] // k + (i < n[r] % k) for i in range(k)] if (k := steps[r]) else [3] * 6 for r in range(rows)]
  for step in range(6):
    spent = np.asarray([sum(sch[:step]) if steps[r] else 0 for r, sch in enumerate(schedule)])
    left = np.arange(width)[None] < (n - spent)[:, None]
    got = np.asarray(rule.floor(d, jnp.asarray(left), step))
    for r in range(rows):
      if step < len(schedule[r]):
        assert got[r] == schedule[r][step], (r, step, schedule[r])


def test_adapted_ar_models_decode_in_order_with_the_floors_share_of_the_block():
  from mdlm_jax.sampling.presets import for_model
  medium, instant = for_model("medium", 2, in_order=True, revise=False), for_model("instant", 2, in_order=True)
  assert (medium.block_size, medium.min_tokens, medium.in_order, medium.threshold) == (2, 1, True, 0.9)
  assert (instant.min_tokens, instant.in_order) == (2, True)
  # medium and high keep the base's guarantee at any block (one token in order, more only when sure).
  for effort in ("medium", "high"):
    assert for_model(effort, 4, in_order=True).min_tokens == 1 and for_model(effort, 8, in_order=True).min_tokens == 1
  assert for_model("instant", 4, in_order=True).min_tokens == 4 and for_model("low", 4, in_order=True).min_tokens == 2
  assert for_model("high", 8).min_tokens == 2 and not for_model("high", 8).in_order
  assert for_model("medium", 2, in_order=True, min_tokens=2).min_tokens == 2  # an explicit floor is kept


def test_medium_and_high_revise_a_prompts_answer_on_an_adapted_model_and_nothing_else():
  from mdlm_jax.sampling.presets import DRAFT_THRESHOLD, for_model
  for effort in ("medium", "high"):
    s = for_model(effort, 4, in_order=True)
    assert s.revise and s.threshold == DRAFT_THRESHOLD and s.kv_cache
    assert for_model(effort, 4, in_order=True, threshold=0.7).threshold == 0.7
    assert not for_model(effort, 4, in_order=True, revisable=False).revise  # a suffix or a grammar
    assert not for_model(effort, 4).revise  # not an adapted model
  assert not for_model("low", 4, in_order=True).revise and for_model("low", 4, in_order=True, revise=True).revise
  with pytest.raises(ValueError, match="adapted to diffusion"):
    for_model("medium", 4, revise=True)
  with pytest.raises(ValueError, match="cannot infill"):
    for_model("medium", 4, in_order=True, revise=True, revisable=False)
  with pytest.raises(ValueError, match="threshold sampler"):
    for_model("medium", 4, in_order=True, revise=True, sampler="low_confidence")


def test_revision_drafts_from_the_model_where_a_pass_reads_the_weights_once(monkeypatch):
  """The presets leave the masked block out of revising passes on CPU (copies and the table draft), keep it on
  an accelerator, and keep it wherever nothing else would draft (lookup 0); a caller may choose either."""
  from mdlm_jax.sampling import presets
  for backend, pays in (("cpu", False), ("gpu", True), ("tpu", True)):
    monkeypatch.setattr(presets.jax, "default_backend", lambda b=backend: b)
    assert presets.model_drafts_pay() == pays
    assert presets.for_model("medium", 4, in_order=True).model_drafts == pays
    assert presets.for_model("medium", 4, in_order=True, lookup=0).model_drafts
    assert presets.for_model("high", 4, in_order=True, model_drafts=True).model_drafts
  with pytest.raises(ValueError, match="model_drafts=False"):
    presets.for_model("medium", 4, in_order=True, lookup=0, model_drafts=False)
  with pytest.raises(ValueError, match="model_drafts=False"):
    ThresholdSampler(block_size=4, kv_cache=True, model_drafts=False)
