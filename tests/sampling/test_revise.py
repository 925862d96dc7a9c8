"""Revising decoding (ThresholdSampler(revise=True)): the base's own text whatever the drafts, and the passes
a hand count predicts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import checkpoints
from mdlm_jax.data.tokenizer import never_generated
from mdlm_jax.model.spec import bind
from mdlm_jax.sampling.ar import ARSampler
from mdlm_jax.sampling.generate import ARGenerator, Generator
from mdlm_jax.sampling import draft_table, rule
from mdlm_jax.sampling.samplers import Layout, ThresholdSampler
from tests.conftest import adapted_from

V, MASK, EOS = 11, 10, 9


class Oracle:
  """A stand-in model whose base always proposes `text` and whose diffusion
  block drafts `text` except at the columns in `wrong`."""

  def __init__(self, text, wrong, gen_start):
    self.text, self.wrong, self.gs = np.asarray(text), set(wrong), gen_start
    self.positions = jnp.arange(gen_start + len(text))[None]

  def _one_hot(self, cols, draft):
    y = jnp.asarray(self.text)[jnp.clip(cols, 0, len(self.text) - 1)]
    if draft:
      bad = jnp.isin(cols, jnp.asarray(sorted(self.wrong) or [-1]))
      y = jnp.where(bad, (y + 1) % (V - 2), y)
    return jax.nn.one_hot(y, V) * 5.0

  def new_cache(self, batch, max_len, per_row=False):
    return jnp.zeros((batch,), jnp.int32)

  def cached(self, toks, pos, cache, commit, valid_new, commit_len=None, new_block=0, last_only=False,
             clean=False):
    if last_only:  # a prefill: the prompt's last state scores the first generated token
      return self._one_hot(pos[:, -1:] + 1 - self.gs, False), cache
    cols = pos[:, -new_block:] - self.gs
    first = self._one_hot(cols[:, :1], False)
    return jnp.concatenate([first, self._one_hot(cols[:, 1:], True)], 1), cache

  def speculative(self, toks, pos, cache, head_valid):
    h = head_valid.shape[1]
    cols = pos - self.gs
    if cols.shape[1] == h:  # heads alone: the base's next token follows the last valid head column
      cols = jnp.concatenate([cols, cols[:, :1] + jnp.sum(head_valid, axis=1, keepdims=True)], 1)
    logits = jnp.concatenate([self._one_hot(cols[:, :h + 1], False), self._one_hot(cols[:, h + 1:], True)], 1)

    class Pending:
      def commit(self, keep):
        return cache + keep
    return logits, Pending()


def revising(block_size=4, threshold=0.5, **kw):
  return ThresholdSampler(**{"block_size": block_size, "threshold": threshold, "kv_cache": True, "revise": True, **kw})


def _decode(text, wrong, block_size, gen_len=None, threshold=0.5, **kw):
  gen_len = gen_len or len(text)
  gs = 2
  tokens = jnp.concatenate([jnp.array([[1, 2]]), jnp.full((1, gen_len), MASK)], 1)
  lay = Layout(gen_start=gs, gen_len=gen_len, mask_id=MASK, eos_id=EOS)
  oracle = Oracle(text, wrong, gs)
  out = revising(block_size, threshold, **kw).run(oracle, tokens, jnp.ones_like(tokens, bool),
                                                  jnp.zeros((1, 2), jnp.uint32), lay)
  return np.asarray(out["tokens"][0, gs:]), int(out["nfe"])


@pytest.mark.parametrize("wrong, passes", [
    ((), 4),  # the prompt's pass drafts 1-3; each later pass keeps 4: 0-3, 4-7, 8-11
    ((2,), 6),  # 0-1 kept, 2 taken back (the base's token: nothing drafted after it); 3-6, 7-10, 11
    # 0; 1 alone (drafts 2-4); 2-4; 5 alone (6-8); 6-8; 9 alone (10-12); 10-11
    ((1, 5, 9), 8),
])
def test_passes_keep_the_held_drafts_and_the_base_token_after_them(wrong, passes):
  text = np.random.default_rng(len(wrong)).integers(0, 8, 12)
  out, nfe = _decode(text, wrong, 4)
  np.testing.assert_array_equal(out, text)
  assert nfe == passes


@pytest.mark.parametrize("gen_len, passes", [
    (1, 2),  # the prompt's pass drafts t0-3; the next keeps t0 alone, all that was asked
    (3, 2),  # t0-2 of the head's four
    (6, 3),  # t0-3; t4-5
])
def test_a_generation_ends_where_it_asks_not_at_the_blocks_edge(gen_len, passes):
  text = np.random.default_rng(gen_len).integers(0, 8, 12)
  out, nfe = _decode(text, (), 4, gen_len=gen_len)
  np.testing.assert_array_equal(out, text[:gen_len])
  assert nfe == passes


def test_every_draft_wrong_is_one_token_a_pass_after_the_first():
  text = np.random.default_rng(3).integers(0, 8, 9)
  out, nfe = _decode(text, range(20), 3)
  np.testing.assert_array_equal(out, text)
  assert nfe == 1 + len(text)


def test_the_text_ends_at_eos_and_nothing_after_it_is_kept():
  text = np.array([3, 4, EOS, 5, 6, 7, 1, 2])
  out, nfe = _decode(text, (), 4)
  np.testing.assert_array_equal(out[:3], text[:3])
  assert np.all(out[3:] == MASK) and nfe == 2


def test_drafts_below_the_threshold_are_not_offered():
  text = np.random.default_rng(4).integers(0, 8, 8)
  out, nfe = _decode(text, (), 4, threshold=1.0)  # every draft is just short of certain
  np.testing.assert_array_equal(out, text)
  assert nfe == 1 + len(text)


# The oracle's base gives its token logit 5 and the other V - 2 allowed tokens 0: a wrong draft is
# exp(-5) = 0.0067 as likely as the base's choice.
@pytest.mark.parametrize("agreement, kept_wrong", [(1.0, False), (0.01, False), (0.006, True)])
def test_agreement_keeps_a_draft_the_base_rates_close_enough(agreement, kept_wrong):
  text = np.random.default_rng().integers(0, 8, 12)
  out, nfe = _decode(text, (2,), 4, agreement=agreement)
  want = text.copy()
  if kept_wrong:  # the draft at 2 stays, and with it every pass keeps a whole block
    want[2] = (text[2] + 1) % (V - 2)
  np.testing.assert_array_equal(out, want)
  assert nfe == (4 if kept_wrong else 6)


def test_settings_that_cannot_work_are_refused():
  for bad in ({"block_size": 1}, {"kv_cache": False}, {"fused_head": True}):
    with pytest.raises(ValueError, match="revise decodes against a KV cache"):
      revising(**bad)
  for bad in (0.0, 1.5):
    with pytest.raises(ValueError, match="agreement must be in"):
      revising(agreement=bad)
  with pytest.raises(ValueError, match="needs revise=True"):
    ThresholdSampler(agreement=0.5)


@pytest.mark.slow  # CI: the engine's agreement request decodes as the generator (tests/engine/test_revise.py)
def test_with_agreement_every_kept_token_is_one_the_base_rates_near_its_best(tiny_checkpoints):
  """Checked against the AR base's own full forward pass over each answer, in float64."""
  ar = checkpoints.load(tiny_checkpoints["ar"])
  adapted = adapted_from(ar, block_size=4)
  prompts, n = ["def add(a, b):\n", "x = 1\ny"], 24
  agreement = float(10 ** np.random.default_rng().uniform(-3, -2))  # this base is sure: its runner-up is far
  gen = Generator(adapted)
  exact = gen.generate(prompts, max_new_tokens=n, sampler=revising(4, threshold=0.0))  # every draft offered
  near = gen.generate(prompts, max_new_tokens=n, sampler=revising(4, threshold=0.0, agreement=agreement))
  assert near.forward_passes < exact.forward_passes  # the random adapters' drafts: kept only when not exact
  model = bind(ar.spec, ar.params)
  for prompt, c in zip(prompts, near.completions):
    ids = list(gen.encode_prompt(prompt)) + list(c.tokens)
    logits = np.asarray(model(np.asarray([ids], np.int32), None), np.float64)[0]
    logits[:, [i for i in never_generated(adapted.tokenizer) if i < logits.shape[1]]] = -np.inf
    start = len(ids) - len(c.tokens)
    for j, tok in enumerate(c.tokens):
      row = logits[start + j - 1]
      assert row[tok] - row.max() >= np.log(agreement) - 1e-3, (j, tok)


@pytest.mark.parametrize("block_size, lookup, head_width, decode_dtype, model_drafts", [
    pytest.param(2, 0, 0, "float32", True, marks=pytest.mark.slow), (4, 0, 0, "float32", True),
    (4, 2, 0, "float32", True), (4, 2, 8, "float32", True), (4, 2, 8, "w8a8", True), (4, 2, 0, "float32", False),
    (4, 2, 8, "w8a8", False)])
def test_an_adapted_model_writes_its_bases_greedy_text(tiny_checkpoints, block_size, lookup, head_width,
                                                       decode_dtype, model_drafts):
  """Random adapters draft noise, copied drafts may be wrong, a head wider
  than the block verifies more of them, and passes without the masked block
  verify copies alone; the text is still the base's, token for token. Also
  from int8 weights: a revising pass's rows round as the AR step's one row
  does, so the base they verify against is the AR path's."""
  ar = checkpoints.load(tiny_checkpoints["ar"])
  adapted = adapted_from(ar, block_size=block_size)
  prompts = ["def add(a, b):\n", "x = 1\ny"]
  n = 23  # not whole blocks: the text ends mid-block, where it was asked to
  want = ARGenerator(ar, decode_dtype=decode_dtype).generate(prompts, max_new_tokens=n,
                                                              sampler=ARSampler(n, temperature=0.0))
  got = Generator(adapted, decode_dtype=decode_dtype).generate(
      prompts, max_new_tokens=n, sampler=revising(block_size, lookup=lookup, head_width=head_width,
                                                   model_drafts=model_drafts))
  for w, g in zip(want.completions, got.completions):
    assert g.tokens == w.tokens
  assert got.forward_passes <= n + 1


@pytest.mark.parametrize("model_drafts", [True, False])
def test_one_token_asked_is_the_prompts_pass_and_one_more(tiny_checkpoints, model_drafts):
  """A revising generation slides with its text: it stops at max_new_tokens, not at the end of a block (the
  prompt's pass still drafts a whole masked block after the prompt)."""
  ar = checkpoints.load(tiny_checkpoints["ar"])
  adapted = adapted_from(ar, block_size=4)
  want = ARGenerator(ar).generate(["def add(a, b):\n"], max_new_tokens=1, sampler=ARSampler(1, temperature=0.0))
  got = Generator(adapted).generate(["def add(a, b):\n"], max_new_tokens=1,
                                    sampler=revising(4, lookup=2, model_drafts=model_drafts))
  assert got.completions[0].tokens == want.completions[0].tokens and len(want.completions[0].tokens) == 1
  assert got.forward_passes == 2


def test_the_base_and_the_adapted_model_prefill_a_prompt_padded_alike():
  """The AR path pads a prompt as the diffusion canvas does, so a comparison of
  the two pays one prefill for one prompt (a power of two made a 155-token
  prompt 256 rows for the base against 160 for the adapted model)."""
  from mdlm_jax.sampling.canvas import make_canvas
  from mdlm_jax.sampling.generate import prompt_width
  for n in [1, 15, 16, 17, 155] + list(np.random.default_rng().integers(1, 2000, size=20)):
    canvas = make_canvas([[3] * int(n)], 8, mask_id=1, pad_id=0)
    assert prompt_width(int(n)) == canvas.gen_start >= n, n


def test_a_model_that_is_not_an_adapted_ar_model_is_refused(tiny_checkpoints):
  with pytest.raises(ValueError, match="adapted AR model"):
    Generator(checkpoints.load(tiny_checkpoints["mdlm"])).generate(["x"], max_new_tokens=8,
                                                                   sampler=revising())


def test_logit_bias_moves_the_base_as_the_ar_sampler_moves_it(tiny_checkpoints):
  """The base's proposals carry the request's logit_bias: the text is the AR base's under the same bias."""
  ar = checkpoints.load(tiny_checkpoints["ar"])
  prompt, n = "def add(a, b):\n", 16
  plain = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  first = plain.completions[0].tokens[0]
  bias = ((first, -100.0), (int(np.random.default_rng().integers(5, 300)), 4.0))
  want = ARGenerator(ar).generate([prompt], max_new_tokens=n, sampler=ARSampler(n, temperature=0.0, logit_bias=bias))
  got = Generator(adapted_from(ar, block_size=4)).generate([prompt], max_new_tokens=n,
                                                             sampler=revising(4, logit_bias=bias))
  assert got.completions[0].tokens == want.completions[0].tokens and first not in got.completions[0].tokens


def _lookup_reference(text, known, end, n, width):
  """In plain Python: of the earlier positions p whose last tokens match at
  least the last n before end, the one matching the most (up to
  LOOKUP_SPAN), the latest among equals; what followed it."""
  best = None
  for p in range(end):
    m = 0
    while m < rule.LOOKUP_SPAN and p - m >= 0 and known[p - m] and known[end - m] and text[p - m] == text[end - m]:
      m += 1
    if n > 0 and m >= n and (best is None or m >= best[0]):
      best = (m, p)
  if best is None:
    return [], 0
  count = min(width, end - best[1])
  return list(text[best[1] + 1:best[1] + 1 + count]), count


def test_lookup_drafts_copy_what_followed_the_longest_match():
  rng = np.random.default_rng()
  b, length, width = 64, 40, 3
  text = rng.integers(0, 3, (b, length))  # a small vocabulary: suffixes recur, at several lengths
  known = np.ones((b, length), bool)
  for i, pad in enumerate(rng.integers(0, 10, b)):
    known[i, :pad] = False  # left padding
    text[i, :pad] = rng.integers(0, 3, pad)  # which must never match
  end = rng.integers(0, length, b)
  n = rng.integers(0, rule.MAX_LOOKUP + 1, b)
  drafts, count = rule.lookup_drafts(jnp.asarray(text), jnp.asarray(known), jnp.asarray(end), jnp.asarray(n), width)
  found = longer = 0
  for i in range(b):
    want, c = _lookup_reference(text[i], known[i], end[i], n[i], width)
    assert int(count[i]) == c, i
    np.testing.assert_array_equal(np.asarray(drafts[i, :c]), want)
    found += c > 0
    latest, _ = _lookup_reference_latest(text[i], known[i], end[i], n[i], width)
    longer += c > 0 and latest != want
  assert 0 < found < b and longer > 0  # some rows' longest match is not their latest


def _lookup_reference_latest(text, known, end, n, width):
  """The most recent earlier occurrence of the last n tokens alone."""
  for p in range(end - 1, n - 2, -1):
    if n > 0 and all(known[p - j] and known[end - j] and text[p - j] == text[end - j] for j in range(n)):
      count = min(width, end - p)
      return list(text[p + 1:p + 1 + count]), count
  return [], 0


def test_a_next_head_takes_the_copied_drafts_where_they_are_more():
  v = rule.Verified(keep=jnp.array([1, 1, 1]), ended=jnp.zeros(3, bool), ahead=jnp.array([[5, 1, 1, 1]] * 3),
                    n_ahead=jnp.array([0, 2, 3]))
  out = rule.with_lookup(v, jnp.array([[7, 8, 9]] * 3), jnp.array([2, 2, 3]))
  np.testing.assert_array_equal(np.asarray(out.n_ahead), [2, 2, 3])
  np.testing.assert_array_equal(np.asarray(out.ahead), [[5, 7, 8, 9], [5, 1, 1, 1], [5, 1, 1, 1]])


@pytest.mark.parametrize("lookup, passes", [
    (0, 13),  # no drafts offered: one token a pass after the prompt's
    # 5, 6, 7, 8 alone; then 5's earlier follower 6 7 8 is offered: 5-8, then 5-8 again
    (1, 7),
    # 5-8 and 5 alone (no earlier "8 5"); 6 after "5 6" at 0-1: 6 7 8 5, again 6 7 8 5, then room for 3
    (2, 8),
])
def test_copied_drafts_hold_where_the_text_repeats(lookup, passes):
  text = np.array([5, 6, 7, 8] * 3)
  out, nfe = _decode(text, range(20), 4, threshold=1.0, lookup=lookup)  # the model's drafts never offered
  np.testing.assert_array_equal(out, text)
  assert nfe == passes


def test_a_head_width_needs_revision_and_at_least_a_block():
  with pytest.raises(ValueError, match="needs revise=True"):
    ThresholdSampler(head_width=8)
  with pytest.raises(ValueError, match="at least the block size 4"):
    revising(4, head_width=3)


def test_lookup_needs_revision_and_a_short_suffix():
  with pytest.raises(ValueError, match="needs revise=True"):
    ThresholdSampler(lookup=2)
  with pytest.raises(ValueError, match="lookup must be in"):
    revising(lookup=rule.MAX_LOOKUP + 1)


def _distinct_pairs_text(rng, n):
  """n tokens of 0..8 after the prompt [1, 2] in which no pair of neighbours recurs."""
  while True:
    text = rng.integers(0, 9, n).tolist()
    pairs = list(zip([1, 2] + text, [2] + text))
    if len(set(pairs)) == len(pairs):
      return np.array(text)


@pytest.mark.parametrize("wrong_at, head_width, passes", [
    (None, 0, 5),  # the prompt's pass; t0; then drafts chained from (t0, t1): t1-4; t5-8; t9-11
    (6, 0, 6),  # the table follows (t4, t5) with a wrong token: t0; t1-4; t5 (the base's t6 next); t6-9; t10-11
    (None, 8, 4),  # a head of 8 keeps the chain past the block: t0; t1-8; t9-11
    (6, 8, 4),  # t0; t1-5 (the base's t6 next); t6-11
])
def test_table_drafts_chain_from_the_text_and_the_base_keeps_its_own(wrong_at, head_width, passes):
  text = _distinct_pairs_text(np.random.default_rng(), 12)
  seqs = [[1, 2] + text.tolist()]
  if wrong_at is not None:  # the pair before `wrong_at` seen twice followed by another token
    seqs += [[int(text[wrong_at - 2]), int(text[wrong_at - 1]), int(text[wrong_at] + 1) % 9]] * 2
  gs = 2
  tokens = jnp.concatenate([jnp.array([[1, 2]]), jnp.full((1, len(text)), MASK)], 1)
  lay = Layout(gen_start=gs, gen_len=len(text), mask_id=MASK, eos_id=EOS)
  oracle = Oracle(text, range(20), gs)  # the model's own drafts are never offered (threshold 1)
  oracle.draft_table = draft_table.build(seqs, V, order=2, min_context=2)  # chains from the last two tokens
  sampler = revising(4, 1.0, lookup=2, head_width=head_width)
  out = sampler.run(oracle, tokens, jnp.ones_like(tokens, bool), jnp.zeros((1, 2), jnp.uint32), lay)
  np.testing.assert_array_equal(np.asarray(out["tokens"][0, gs:]), text)
  assert int(out["nfe"]) == passes
  oracle.draft_table = None  # no table, no copies (the text never repeats a pair): a token a pass
  out = sampler.run(oracle, tokens, jnp.ones_like(tokens, bool), jnp.zeros((1, 2), jnp.uint32), lay)
  assert int(out["nfe"]) == len(text) + 1


def test_an_adapted_model_with_a_table_of_its_bases_text_writes_that_text_in_fewer_passes(tiny_checkpoints):
  ar = checkpoints.load(tiny_checkpoints["ar"])
  adapted = adapted_from(ar, block_size=4)
  prompts, n = ["def add(a, b):\n", "x = 1\ny"], 24
  want = ARGenerator(ar).generate(prompts, max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  ids = [Generator(adapted).encode_prompt(p) + c.tokens for p, c in zip(prompts, want.completions)]
  with_table = dataclasses.replace(adapted, draft_table=draft_table.build(ids, adapted.spec.cfg.vocab_size))
  sampler = revising(4, lookup=2)
  got = Generator(with_table).generate(prompts, max_new_tokens=n, sampler=sampler)
  off = Generator(with_table, draft_table=False).generate(prompts, max_new_tokens=n, sampler=sampler)
  for w, g, o in zip(want.completions, got.completions, off.completions):
    assert g.tokens == w.tokens == o.tokens
  assert got.forward_passes < off.forward_passes


@pytest.mark.parametrize("model_drafts, passes", [
    (True, 5),  # the prompt's pass with the masked block; t0 alone (no drafts offered); t1-4; t5-8; t9-11
    (False, 4),  # the prompt's pass proposes t0 and the table chains from (2, t0) at once: t0-3; t4-7; t8-11
])
def test_heads_alone_start_with_copied_and_table_drafts(model_drafts, passes):
  text = _distinct_pairs_text(np.random.default_rng(), 12)
  gs = 2
  tokens = jnp.concatenate([jnp.array([[1, 2]]), jnp.full((1, len(text)), MASK)], 1)
  lay = Layout(gen_start=gs, gen_len=len(text), mask_id=MASK, eos_id=EOS)
  oracle = Oracle(text, range(20), gs)  # the model's own drafts are never offered (threshold 1)
  oracle.draft_table = draft_table.build([[1, 2] + text.tolist()], V, order=2, min_context=2)
  sampler = revising(4, 1.0, lookup=2, model_drafts=model_drafts)
  out = sampler.run(oracle, tokens, jnp.ones_like(tokens, bool), jnp.zeros((1, 2), jnp.uint32), lay)
  np.testing.assert_array_equal(np.asarray(out["tokens"][0, gs:]), text)
  assert int(out["nfe"]) == passes


@pytest.mark.parametrize("floor, passes", [
    (0.0, 5),  # t0; t1-4; t5-8 (the chain goes on from "t4 t5", 11 sixteenths sure); t9-11
    (0.6, 5),
    (0.7, 6),  # the chain stops at "t4 t5": t0; t1-4; t5 alone; t6-9; t10-11
])
def test_a_table_chain_stops_where_its_chance_falls_below_the_floor(floor, passes):
  text = _distinct_pairs_text(np.random.default_rng(), 12)
  # "t4 t5" went on with t6 twice and with another token once: 2/3, kept as 11/16.
  seqs = [[1, 2] + text.tolist()] * 2 + [[int(text[4]), int(text[5]), int(text[6] + 1) % 9]]
  gs = 2
  tokens = jnp.concatenate([jnp.array([[1, 2]]), jnp.full((1, len(text)), MASK)], 1)
  lay = Layout(gen_start=gs, gen_len=len(text), mask_id=MASK, eos_id=EOS)
  oracle = Oracle(text, range(20), gs)  # the model's own drafts are never offered (threshold 1)
  oracle.draft_table = draft_table.build(seqs, V, order=2, min_context=2)
  out = revising(4, 1.0, lookup=2, table_floor=floor).run(oracle, tokens, jnp.ones_like(tokens, bool),
                                                          jnp.zeros((1, 2), jnp.uint32), lay)
  np.testing.assert_array_equal(np.asarray(out["tokens"][0, gs:]), text)
  assert int(out["nfe"]) == passes


def test_narrow_products_run_the_narrowest_width_that_holds_the_valid_columns():
  from mdlm_jax.model.layers import Narrow
  rng = np.random.default_rng()
  x = rng.standard_normal((3, 6, 5)).astype(np.float32)
  w = rng.standard_normal((5, 4)).astype(np.float32)
  taken = []

  def product(x):
    width = x.shape[1]
    jax.debug.callback(lambda: taken.append(width))
    return x @ w

  for need, width in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 6), (6, 6), (9, 6)]:
    taken.clear()
    got = np.asarray(jax.jit(lambda x, need: Narrow((1, 2, 4, 6), need).columns(product, x))(x, need))
    jax.effects_barrier()
    assert taken == [width]
    want = np.einsum("blk,kn->bln", x.astype(np.float64), w)
    np.testing.assert_allclose(got[:, :width], want[:, :width], rtol=1e-5, atol=1e-5)
    assert not got[:, width:].any()
    rows = np.asarray(jax.jit(lambda x, need: Narrow((1, 2, 4, 6), need).rows(lambda y: y @ w, x))(
        x.reshape(18, 5), need)).reshape(3, 6, 4)
    np.testing.assert_allclose(rows, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_dtype", ["float32", pytest.param("w8a8", marks=pytest.mark.slow)])
def test_a_narrowed_pass_scores_its_valid_columns_as_the_full_pass_does(tiny_checkpoints, decode_dtype):
  """A head-only speculative pass narrowed to its valid columns: the same
  logits there and at the base's next token after them, the same cache."""
  from mdlm_jax.model.kv_cache import KVCache
  adapted = adapted_from(checkpoints.load(tiny_checkpoints["ar"]), block_size=4)
  few = Generator(adapted, decode_dtype=decode_dtype).loaded
  model = bind(few.spec, few.params)
  rng = np.random.default_rng()
  v, hw, p = few.spec.cfg.vocab_size, 6, 7
  cache = KVCache.init(few.spec.cfg, 2, 32, per_row=True)
  prompt = jnp.asarray(rng.integers(0, v - 2, (2, p)), jnp.int32)
  _, cache = jax.jit(lambda c: model.forward_cached(prompt, jnp.broadcast_to(jnp.arange(p), (2, p)), c, commit=True,
                                                     valid_new=jnp.ones((2, p), bool), commit_len=jnp.full((2,), p)))(
      cache)
  head = jnp.asarray(rng.integers(0, v - 2, (2, hw)), jnp.int32)
  lane = jnp.arange(hw)[None]
  pos = p + lane + jnp.zeros((2, 1), jnp.int32)
  narrowed = jax.jit(lambda valid, need: model.forward_speculative(head, pos, cache, valid, (1, 2, 4, hw), need))
  whole = jax.jit(lambda valid: model.forward_speculative(head, pos, cache, valid))
  for n_valid in [(1, 1), (2, 1), (3, 2), (4, 4), (5, 6)]:
    n = jnp.asarray(n_valid)
    valid = lane < n[:, None]
    got, pending = narrowed(valid, jnp.max(n))
    full, full_pending = whole(valid)
    assert got.shape == full.shape
    for r, k in enumerate(n_valid):  # the valid columns, then the base's next token after them
      np.testing.assert_allclose(got[r, :k], full[r, :k], rtol=1e-4, atol=1e-4)
      np.testing.assert_allclose(got[r, hw], full[r, hw], rtol=1e-4, atol=1e-4)
    kept = jnp.asarray([min(k, 2) for k in n_valid])
    a, b = pending.commit(kept), full_pending.commit(kept)
    np.testing.assert_array_equal(a.length, b.length)
    np.testing.assert_array_equal(a.valid, b.valid)
    np.testing.assert_allclose(a.last_hidden, b.last_hidden, rtol=1e-4, atol=1e-4)
    for r, k in enumerate(np.asarray(kept)):  # the kept slots' keys
      np.testing.assert_allclose(a.k[:, r, ..., p:p + k], b.k[:, r, ..., p:p + k], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # CI: a narrowed pass against the full one (below), and the oracle's floors
@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_narrow_passes_write_the_bases_text_in_the_passes_full_width_ones_take(tiny_checkpoints, floor):
  """Narrowing is cost only: the same text and passes as the head's full
  width, whatever the table's floor; the text is the base's."""
  ar = checkpoints.load(tiny_checkpoints["ar"])
  adapted = adapted_from(ar, block_size=4)
  prompts, n = ["def add(a, b):\n", "x = 1\ny"], 24
  want = ARGenerator(ar).generate(prompts, max_new_tokens=n, sampler=ARSampler(n, temperature=0.0))
  ids = [Generator(adapted).encode_prompt(p) + c.tokens for p, c in zip(prompts, want.completions)]
  rng = np.random.default_rng()
  noise = [rng.integers(0, adapted.spec.cfg.vocab_size - 2, 30).tolist() for _ in range(4)]  # shares below 1
  with_table = dataclasses.replace(adapted, draft_table=draft_table.build(ids + noise, adapted.spec.cfg.vocab_size))
  gen = Generator(with_table)
  common = dict(lookup=2, head_width=6, model_drafts=False, table_floor=floor)
  full = gen.generate(prompts, max_new_tokens=n, sampler=revising(4, **common))
  narrow = gen.generate(prompts, max_new_tokens=n, sampler=revising(4, pass_widths=(1, 2, 4, 6), **common))
  for w, f, g in zip(want.completions, full.completions, narrow.completions):
    assert f.tokens == g.tokens == w.tokens
  assert narrow.forward_passes == full.forward_passes < n


def test_a_table_floor_and_pass_widths_need_what_they_act_on():
  with pytest.raises(ValueError, match="table_floor must be in"):
    revising(lookup=2, table_floor=1.5)
  with pytest.raises(ValueError, match="needs lookup > 0"):
    revising(table_floor=0.3)
  with pytest.raises(ValueError, match="needs model_drafts=False"):
    revising(lookup=2, pass_widths=(1, 4))
  for widths in [(1, 2), (2, 1, 4), (0, 4), (1, 1, 4), (1, 8)]:
    with pytest.raises(ValueError, match="pass_widths must increase from at least 1 to the head's width 4"):
      revising(lookup=2, model_drafts=False, pass_widths=widths)
  assert revising(lookup=2, model_drafts=False, head_width=6, pass_widths=(1, 6)).pass_widths == (1, 6)
