"""Revising requests in the engine: the base's own text, beside block-decoding requests in the same passes."""

import dataclasses

import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.engine.engine import Engine, Request
from mdlm_jax.sampling import draft_table, grammar, presets
from mdlm_jax.sampling.ar import ARSampler
from mdlm_jax.sampling.generate import ARGenerator, Generator
from tests.conftest import adapted_from

PROMPTS = ["def f(x):\n", "import os\nimport sys\n\nclass Thing:\n    "]


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
  ar = checkpoints.load(tiny_checkpoints["ar"])
  return ar, adapted_from(ar, block_size=4)


@pytest.fixture(scope="module")
def engine(models):
  e = Engine(models[1], num_slots=2, max_prompt=32, max_new_tokens=16).start()
  yield e
  e.close(deadline_s=1)


@pytest.mark.slow  # 20 s; the agreement test below runs revision in the engine against the generator
def test_revising_and_block_requests_share_passes_and_each_writes_its_own_text(models, engine):
  ar, adapted = models
  n = 14
  base = ARGenerator(ar).generate([PROMPTS[0]], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  revising = engine.sampler_for("medium", revise=True, temperature=0.0)
  block = engine.sampler_for("medium", temperature=0.0)
  a = engine.submit(Request(engine.encode(PROMPTS[0]), n, revising, seed=0, logprobs=2))
  b = engine.submit(Request(engine.encode(PROMPTS[1]), n, block, seed=0))
  got_a, got_b = a.result(timeout=300), b.result(timeout=300)
  assert got_a.text == base.completions[0].text
  want_b = Generator(adapted).generate([PROMPTS[1]], max_new_tokens=n, seed=0, sampler=block).completions[0]
  assert got_b.text == want_b.text
  # Greedy: every kept token is the base's most likely, and its log-probability is that of the top choice.
  for token, logp, alternatives in got_a.logprobs:
    assert alternatives[0][0] == token and np.isclose(alternatives[0][1], logp, atol=1e-5) and logp <= 0


@pytest.mark.slow  # a sampled generator compiles (CI: the greedy text against the base's)
def test_a_sampled_revising_request_draws_what_the_generator_draws(models, engine):
  sampler = engine.sampler_for("medium", revise=True, temperature=0.9)
  h = engine.submit(Request(engine.encode(PROMPTS[1]), 12, sampler, seed=5))
  want = Generator(models[1]).generate([PROMPTS[1]], max_new_tokens=12, seed=5, sampler=sampler).completions[0]
  assert h.result(timeout=300).text == want.text


def test_what_revise_cannot_do_is_refused(models, engine, tiny_checkpoints):
  revising = engine.sampler_for("medium", revise=True)
  with pytest.raises(ValueError, match="cannot infill"):
    engine.submit(Request(engine.encode("x"), 8, revising, suffix_ids=engine.encode("y", add_bos=False)))
  with pytest.raises(ValueError, match="grammar"):
    engine.submit(Request(engine.encode("x"), 8, revising, grammar=grammar.Grammar.json_object()))
  with pytest.raises(ValueError, match=f"verifies heads of {engine.sc.head} columns"):
    engine.submit(Request(engine.encode("x"), 8, dataclasses.replace(revising, lookup=2, head_width=engine.sc.head + 1)))
  with pytest.raises(ValueError, match="head_width must be 0 or at least the block size 4"):
    Engine(models[1], num_slots=1, max_prompt=32, max_new_tokens=16, head_width=3)
  heads_alone = engine.sampler_for("medium", revise=True, lookup=2, model_drafts=False)
  assert heads_alone.pass_widths == engine.sc.pass_widths == ()
  with pytest.raises(ValueError, match=rf"passes of heads alone take widths \({engine.sc.head},\)"):
    engine.submit(Request(engine.encode("x"), 8, dataclasses.replace(heads_alone, pass_widths=(1, engine.sc.head))))
  with pytest.raises(ValueError, match="pass_widths must increase from at least 1 to the head's width 4"):
    Engine(models[1], num_slots=1, max_prompt=32, max_new_tokens=16, head_width=0, pass_widths=(1, 3))
  narrow = Engine(models[1], num_slots=1, max_prompt=32, max_new_tokens=16, head_width=0)
  assert narrow.sampler_for("medium", revise=True, lookup=2).head_width == narrow.sc.head == 4
  assert engine.sampler_for("medium", revise=True, lookup=2).head_width == engine.sc.head
  plain = Engine(checkpoints.load(tiny_checkpoints["mdlm"]), num_slots=1, max_prompt=16, max_new_tokens=8, block_size=8)
  with pytest.raises(ValueError, match="adapted to diffusion"):
    plain.submit(Request(plain.encode("x"), 8, dataclasses.replace(revising, block_size=plain.sc.block_size, head_width=0)))


def test_drafts_show_what_a_revising_row_sends_ahead_and_a_taken_back_token_changing(models, engine):
  """Random adapters draft noise: some draft shows a token the base then replaces."""
  from mdlm_jax.sampling.generate import MASK_TEXT
  sampler = engine.sampler_for("medium", revise=True, temperature=0.0, threshold=0.0, model_drafts=True)
  h = engine.submit(Request(engine.encode(PROMPTS[0]), 16, sampler, seed=0), want_drafts=True)
  events = list(h.events(timeout=300))
  drafts = [ev.text for ev in events if ev.kind == "draft"]
  assert drafts[-1] == events[-1].text  # the last draft is the answer

  def revised(prev, cur):
    return any(p != MASK_TEXT and c != MASK_TEXT and p != c for p, c in zip(prev, cur))
  assert any(revised(a, b) for a, b in zip(drafts, drafts[1:]))


@pytest.mark.parametrize("model_drafts", [False, pytest.param(True, marks=pytest.mark.slow)])  # CI: the CPU presets'
# heads-only passes; the generator's tests run the model's drafts
def test_passes_with_and_without_the_masked_block_are_the_generators(models, engine, model_drafts):
  """Without the model's drafts a revising pass carries the heads alone (the CPU presets' choice), with them the
  masked block too: either way the engine writes the base's text in the generator's passes."""
  ar, adapted = models
  prompt, n = "x = 1\n" * 4, 16
  base = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  sampler = engine.sampler_for("medium", revise=True, temperature=0.0, lookup=1, model_drafts=model_drafts)
  heads_only = engine.stats["steps_head_only"]
  got = engine.submit(Request(engine.encode(prompt), n, sampler, seed=0)).result(timeout=300)
  want = Generator(adapted).generate([prompt], max_new_tokens=n, sampler=sampler)
  assert got.text == want.completions[0].text == base.completions[0].text
  assert got.passes == want.forward_passes
  assert (engine.stats["steps_head_only"] > heads_only) == (not model_drafts)


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_shorter_than_a_block_stops_where_it_asks(models, engine, n):
  """A revising request slides with its text, so it ends at max_tokens, not at the block's edge: one token is
  the prompt's pass and one more, in the engine and the generator alike."""
  ar, adapted = models
  base = ARGenerator(ar).generate([PROMPTS[0]], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  sampler = engine.sampler_for("medium", revise=True, temperature=0.0, lookup=1, model_drafts=False)
  got = engine.submit(Request(engine.encode(PROMPTS[0]), n, sampler, seed=0)).result(timeout=300)
  want = Generator(adapted).generate([PROMPTS[0]], max_new_tokens=n, sampler=sampler)
  assert got.text == want.completions[0].text == base.completions[0].text
  assert got.passes == want.forward_passes <= 1 + n
  if n == 1:
    assert got.passes == 2


def test_a_wide_head_beside_a_block_request_takes_the_generators_passes(models, engine):
  """A revising row's head wider than the block shares a pass with a row decoding blocks, whose finished block
  fills the head's first columns: each writes the generator's text, the revising row in the generator's passes
  (that a wide head keeps more a pass: the table test below, and the generator's tests)."""
  ar, adapted = models
  prompt, n = "x = 1\n" * 4, 16
  assert engine.sc.head > engine.sc.block_size or not presets.head_width_for(4)
  base = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  revising = engine.sampler_for("medium", revise=True, temperature=0.0, lookup=1, model_drafts=True,
                                head_width=engine.sc.head)
  block = engine.sampler_for("medium", revise=False, temperature=0.0)
  a = engine.submit(Request(engine.encode(prompt), n, revising, seed=0))
  b = engine.submit(Request(engine.encode(PROMPTS[1]), n, block, seed=0))
  got_a, got_b = a.result(timeout=300), b.result(timeout=300)
  want = Generator(adapted).generate([prompt], max_new_tokens=n, sampler=revising)
  assert got_a.text == want.completions[0].text == base.completions[0].text
  assert got_a.passes == want.forward_passes
  assert got_b.text == Generator(adapted).generate([PROMPTS[1]], max_new_tokens=n, sampler=block).completions[0].text


def test_a_biased_revising_request_starts_as_the_generator_does(models, engine):
  """Heads alone propose the base's first token at admission: with a logit bias that moves it, the engine's text
  and passes are still the generator's."""
  sampler = engine.sampler_for("medium", revise=True, temperature=0.0, lookup=1, model_drafts=False)
  plain = Generator(models[1]).generate([PROMPTS[0]], max_new_tokens=12, sampler=sampler).completions[0]
  biased = dataclasses.replace(sampler, logit_bias=((plain.tokens[0], -100.0),))
  got = engine.submit(Request(engine.encode(PROMPTS[0]), 12, biased, seed=0)).result(timeout=300)
  want = Generator(models[1]).generate([PROMPTS[0]], max_new_tokens=12, sampler=biased)
  assert got.text == want.completions[0].text and want.completions[0].tokens[0] != plain.tokens[0]
  assert got.passes == want.forward_passes


def test_a_request_with_agreement_decodes_as_the_generator(models, engine):
  """Lossy verification (drafts the base rates near its best are kept too) in the slots, as one-shot."""
  sampler = engine.sampler_for("medium", revise=True, temperature=0.0, agreement=0.4)
  h = engine.submit(Request(engine.encode(PROMPTS[1]), 12, sampler, seed=1))
  want = Generator(models[1]).generate([PROMPTS[1]], max_new_tokens=12, seed=1, sampler=sampler).completions[0]
  assert h.result(timeout=300).text == want.text


def test_revising_passes_run_several_a_launch_and_a_stop_string_still_ends_the_text(models, engine):
  """The engine's default: a revising request alone rides several passes a launch (its text is the base's,
  its passes the generator's: the tests above); a stop string found a launch late still cuts the text."""
  ar, _ = models
  n = 14
  base = ARGenerator(ar).generate([PROMPTS[0]], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  text = base.completions[0].text
  revising = engine.sampler_for("medium", revise=True, temperature=0.0)
  launches = engine.stats["steps"]
  got = engine.submit(Request(engine.encode(PROMPTS[0]), n, revising, seed=0)).result(timeout=300)
  assert got.text == text and engine.stats["steps"] - launches < got.passes
  stop = text[len(text) // 2:][:2]
  cut = engine.submit(Request(engine.encode(PROMPTS[0]), n, revising, seed=0, stop=[stop])).result(timeout=300)
  assert (cut.text, cut.finish_reason) == (text[:text.index(stop)], "stop")


@pytest.mark.slow  # two engines compile (CI: the one above)
def test_passes_in_one_launch_write_what_a_launch_a_pass_writes(models):
  """Several revising passes a launch: the same text, the same passes a request and the same end (a stop
  string too, found up to a launch late), in fewer launches; a block-decoding request gets a launch a pass."""
  _, adapted = models
  got = {}
  for k in (1, 3):
    e = Engine(adapted, num_slots=2, max_prompt=32, max_new_tokens=16, passes_per_turn=k).start()
    try:
      revising = e.sampler_for("medium", revise=True, temperature=0.0)
      first = e.submit(Request(e.encode(PROMPTS[0]), 16, revising, seed=0)).result(timeout=300)
      stop = first.text[len(first.text) // 2:][:2]
      hs = [e.submit(Request(e.encode(p), 16, revising, seed=0, stop=s)) for p, s in zip(PROMPTS, [[stop], []])]
      results = [first] + [h.result(timeout=300) for h in hs]
      launches = e.stats["steps"]
      block = e.submit(Request(e.encode(PROMPTS[1]), 8, e.sampler_for("medium", revise=False, temperature=0.0), seed=0))
      block_passes = block.result(timeout=300).passes
      block_launches = e.stats["steps"] - launches
    finally:
      e.close(deadline_s=1)
    got[k] = [(r.text, r.passes, r.finish_reason) for r in results], launches, block_passes, block_launches
  # The same text and end; the same passes, but for the request a stop string ended (it may ride more).
  assert [r[::2] for r in got[3][0]] == [r[::2] for r in got[1][0]]
  assert [got[k][0][i][1] for k in (1, 3) for i in (0, 2)] == [got[1][0][0][1], got[1][0][2][1]] * 2
  assert got[3][0][1][2] == "stop" and stop not in got[3][0][1][0]
  assert got[1][1] >= got[1][0][0][1] + max(got[1][0][1][1], got[1][0][2][1])  # a launch a pass
  assert got[3][1] < got[1][1]
  with pytest.raises(ValueError, match="passes_per_turn"):
    Engine(adapted, num_slots=1, max_prompt=32, max_new_tokens=16, passes_per_turn=0)
  assert got[3][3] >= got[3][2]  # block decoding: every pass launched by itself


@pytest.mark.slow  # 17 s; the generator's copied-draft tests run by default
@pytest.mark.parametrize("chunk", [0, 16])
def test_copied_drafts_take_the_passes_the_generator_takes(models, chunk):
  """With lookup the engine copies from the prompt it was given (whole or in chunks) and the text so far,
  as the one-shot generator does: the same text (the base's) in the same passes."""
  ar, adapted = models
  prompt, n = "x = 1\n" * 8, 16
  e = Engine(adapted, num_slots=1, max_prompt=64, max_new_tokens=n, prefill_chunk=chunk).start()
  try:
    sampler = e.sampler_for("medium", revise=True, temperature=0.0, lookup=1)
    got = e.submit(Request(e.encode(prompt), n, sampler, seed=0)).result(timeout=300)
  finally:
    e.close(deadline_s=1)
  want = Generator(adapted).generate([prompt], max_new_tokens=n, sampler=sampler)
  own = Generator(adapted).generate([prompt], max_new_tokens=n,
                                    sampler=dataclasses.replace(sampler, lookup=0, model_drafts=True))
  base = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  assert got.text == want.completions[0].text == own.completions[0].text == base.completions[0].text
  chunks = -(-len(e.encode(prompt)) // chunk) if chunk else 1  # each prefill chunk counts as a pass
  assert got.passes - (chunks - 1) == want.forward_passes < own.forward_passes


@pytest.mark.slow  # an engine of its own compiles (CI: sampling/test_revise.py's table test, in the generator)
def test_table_drafts_take_the_passes_the_generator_takes(models):
  """Drafts chained from the model's table of answers: the engine's passes and text are the generator's, the text
  the base's, in fewer passes than without the table."""
  ar, adapted = models
  prompt, n = "def add(a, b):\n", 16
  base = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  ids = Generator(adapted).encode_prompt(prompt) + base.completions[0].tokens
  adapted = dataclasses.replace(adapted, draft_table=draft_table.build([ids], adapted.spec.cfg.vocab_size))
  e = Engine(adapted, num_slots=1, max_prompt=32, max_new_tokens=n).start()
  try:
    sampler = e.sampler_for("medium", revise=True, temperature=0.0, lookup=2)
    got = e.submit(Request(e.encode(prompt), n, sampler, seed=0)).result(timeout=300)
  finally:
    e.close(deadline_s=1)
  want = Generator(adapted).generate([prompt], max_new_tokens=n, sampler=sampler)
  off = Generator(adapted, draft_table=False).generate([prompt], max_new_tokens=n, sampler=sampler)
  assert got.text == want.completions[0].text == off.completions[0].text == base.completions[0].text
  assert got.passes == want.forward_passes < off.forward_passes
  if sampler.head_width > sampler.block_size:  # the chain ran past the block
    narrow = Generator(adapted).generate([prompt], max_new_tokens=n, sampler=dataclasses.replace(sampler, head_width=0))
    assert want.forward_passes < narrow.forward_passes


@pytest.mark.slow  # an engine of its own compiles (CI: the generator's narrowed passes and table floor)
def test_narrow_passes_with_a_table_floor_take_the_generators_passes(models):
  """Chains cut where the table's shares multiply below the floor, and passes
  of heads alone as narrow as their drafts: the engine's passes and text are
  the generator's, the text the base's."""
  ar, adapted = models
  prompt, n = "def add(a, b):\n", 16
  base = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  ids = Generator(adapted).encode_prompt(prompt) + base.completions[0].tokens
  rng = np.random.default_rng()
  noise = [rng.integers(0, adapted.spec.cfg.vocab_size - 2, 30).tolist() for _ in range(4)]
  adapted = dataclasses.replace(adapted, draft_table=draft_table.build([ids] + noise, adapted.spec.cfg.vocab_size))
  e = Engine(adapted, num_slots=1, max_prompt=32, max_new_tokens=n, head_width=0, pass_widths=(1, 2, 4)).start()
  try:
    sampler = e.sampler_for("medium", revise=True, temperature=0.0, lookup=2, model_drafts=False, table_floor=0.5)
    assert sampler.pass_widths == (1, 2, 4) and sampler.head_width == 4
    got = e.submit(Request(e.encode(prompt), n, sampler, seed=0)).result(timeout=300)
  finally:
    e.close(deadline_s=1)
  want = Generator(adapted).generate([prompt], max_new_tokens=n, sampler=sampler)
  assert got.text == want.completions[0].text == base.completions[0].text
  assert got.passes == want.forward_passes


@pytest.mark.slow
def test_warmup_compiles_the_revising_pass(models):
  """An adapted model's first revising request compiles nothing after warmup."""
  import jax.monitoring
  _, adapted = models
  e = Engine(adapted, num_slots=1, max_prompt=32, max_new_tokens=8).warmup()
  # One slot: with a head, without, revising, revising passes_per_turn at once; on CPU each revising pass again
  # with the heads alone (the presets' choice there); guided with a head, without, and beside a revising request.
  assert e.compiled()["passes"] == 4 + 2 * (not presets.model_drafts_pay()) + 3
  compiles = []
  listener = lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  e.start()
  try:
    sampler = e.sampler_for("medium", temperature=0.0)
    assert sampler.revises
    e.submit(Request(e.encode(PROMPTS[0]), 8, sampler, seed=0)).result(timeout=300)
    # A constrained request (structured outputs, tool calls) alone, then beside a revising one.
    guided = Request(e.encode(PROMPTS[0]), 8, e.sampler_for("medium", temperature=0.0, revisable=False),
                     grammar=grammar.Grammar.json_object(layout="compact"))
    e.submit(guided).result(timeout=300)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
    e.close(deadline_s=1)
  assert not compiles
