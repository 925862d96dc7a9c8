"""Instruction-tuning rows: prompt in view, the response and its EOS padding scored."""

import numpy as np
import pytest

from mdlm_jax.data.chat_template import CHATML
from mdlm_jax.data import chat


class CharTok:
  bos_id, eos_id = 1, 2

  def encode(self, text):
    return [ord(c) + 10 for c in text]


CONV = {"messages": [{"role": "user", "content": "Add 2 and 3."},
                     {"role": "assistant", "content": "5"}]}
CALL = {"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        "messages": [{"role": "user", "content": "2+3?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]}]}


def test_the_response_is_what_the_answer_adds():
  prompt, response = chat.split_response(CHATML, CONV)
  assert prompt.endswith("<|im_start|>assistant\n") and response == "5<|im_end|>\n"
  prompt, response = chat.split_response(CHATML, CALL)
  assert "# Tools" in prompt and response == '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>\n'
  with pytest.raises(ValueError, match="ends with the assistant"):
    chat.split_response(CHATML, {"messages": CONV["messages"][:1]})


def test_rows_pad_with_scored_eos_and_leave_out_what_does_not_fit():
  tok = CharTok()
  prompt, response = chat.split_response(CHATML, CONV)
  n_prompt, n_answer = 1 + len(prompt), len(response) + 1
  long = {"messages": [{"role": "user", "content": "x" * 500}, {"role": "assistant", "content": "y"}]}
  data = chat.rows([CONV, long, CONV], tok, CHATML, seq_len=n_prompt + n_answer + 5)
  assert data.tokens.shape == (2, n_prompt + n_answer + 5) and data.too_long == 1
  row, mask = data.tokens[0], data.loss_mask[0]
  assert row[0] == tok.bos_id and row[1:n_prompt].tolist() == tok.encode(prompt)
  assert row[n_prompt:n_prompt + n_answer - 1].tolist() == tok.encode(response)
  assert (row[n_prompt + n_answer - 1:] == tok.eos_id).all()  # the answer's EOS, then EOS padding
  assert not mask[:n_prompt].any() and mask[n_prompt:].all()
  with pytest.raises(ValueError, match="no conversation fits"):
    chat.rows([long], tok, CHATML, seq_len=64)


def test_batches_shuffle_every_epoch_cover_all_rows_and_resume():
  data = chat.ChatRows(np.arange(10)[:, None].repeat(4, 1).astype(np.int32), np.ones((10, 4), bool), 0)
  it = chat.train_iterator(data, 5, seed=0)
  first = np.concatenate([next(it)["tokens"][:, 0] for _ in range(2)])
  state = it.get_state()
  second = np.concatenate([next(it)["tokens"][:, 0] for _ in range(2)])
  assert sorted(first) == sorted(second) == list(range(10)) and not np.array_equal(first, second)
  again = chat.train_iterator(data, 5, seed=0)
  again.set_state(state)
  assert np.array_equal(np.concatenate([next(again)["tokens"][:, 0] for _ in range(2)]), second)
  halves = [np.concatenate([next(chat.train_iterator(data, 5, seed=0, process_index=i, process_count=2))["tokens"]
                            [:, 0]]) for i in range(2)]
  assert sorted(np.concatenate(halves)) == list(range(10))  # each process reads its own rows
  with pytest.raises(ValueError, match="more than"):
    chat.train_iterator(data, 11, seed=0)
  batches = chat.eval_batches(data, 4, 5)
  assert [b["tokens"].shape for b in batches] == [(4, 4)] * 3  # every row, the last batch filled
  assert np.array_equal(np.concatenate([b["tokens"] for b in batches])[:10], data.tokens)
  assert np.array_equal(np.concatenate([b["loss_mask"] for b in batches])[:10], data.loss_mask)
  assert not batches[-1]["loss_mask"][2:].any()  # filler rows score nothing
  assert [b["tokens"].shape for b in chat.eval_batches(data, 4, 2)] == [(4, 4)] * 2
  (one,) = chat.eval_batches(data, 32, 2)  # fewer held-out rows than a batch
  assert one["tokens"].shape == (32, 4) and one["loss_mask"][:10].sum() == data.loss_mask.sum()
  assert not one["loss_mask"][10:].any()


class FimTok(CharTok):
  """CharTok with the three FIM markers as ids 3, 4, 5."""

  def piece_id(self, piece):
    from mdlm_jax.data import fim
    return {fim.PREFIX: 3, fim.SUFFIX: 4, fim.MIDDLE: 5}[piece]


INFILL = {"fim": {"prefix": "def f(x):\n", "middle": "    y = x\n", "suffix": "    return y\n"}}


def test_an_infill_record_is_a_psm_prompt_and_its_middle_scored():
  tok = FimTok()
  data = chat.rows([CONV, INFILL], tok, CHATML, seq_len=80)
  assert data.is_infill.tolist() == [False, True]
  f = INFILL["fim"]
  prompt = [tok.bos_id, 3, *tok.encode(f["prefix"]), 4, *tok.encode(f["suffix"]), 5]
  row, mask = data.tokens[1], data.loss_mask[1]
  assert row[:len(prompt)].tolist() == prompt and not mask[:len(prompt)].any() and mask[len(prompt):].all()
  middle = tok.encode(f["middle"])
  assert row[len(prompt):len(prompt) + len(middle)].tolist() == middle
  assert (row[len(prompt) + len(middle):] == tok.eos_id).all()
  assert chat.text_of(INFILL, CHATML) == "def f(x):\n    y = x\n    return y\n"
  with pytest.raises(ValueError, match="--chat-fim-pieces"):
    chat.rows([INFILL], CharTok(), CHATML, seq_len=80)  # no FIM pieces: a named error, not a crash


def test_the_infill_share_of_the_stream_is_fim_rate_and_resumes():
  n = 40
  tokens = np.arange(n)[:, None].repeat(4, 1).astype(np.int32)
  infill = np.arange(n) % 4 == 0  # 10 infill rows, 30 conversations
  data = chat.ChatRows(tokens, np.ones((n, 4), bool), 0, infill)
  for rate in (0.0, 0.25, 0.5, 1.0):
    it = chat.train_iterator(data, 4, seed=1, infill_rate=rate)
    seen = np.concatenate([next(it)["tokens"][:, 0] for _ in range(100)])
    share = infill[seen].mean()
    assert abs(share - rate) < 0.03, (rate, share)
    if rate in (0.0, 1.0):
      assert set(seen.tolist()) == set(np.flatnonzero(infill == (rate == 1.0)).tolist())
  it = chat.train_iterator(data, 4, seed=1, infill_rate=0.5)
  next(it)
  state = it.get_state()
  want = [next(it)["tokens"][:, 0].tolist() for _ in range(3)]
  again = chat.train_iterator(data, 4, seed=1, infill_rate=0.5)
  again.set_state(state)
  assert [next(again)["tokens"][:, 0].tolist() for _ in range(3)] == want
  with pytest.raises(ValueError, match="infill records, but it has none"):
    chat.train_iterator(chat.ChatRows(tokens, np.ones((n, 4), bool), 0), 4, seed=1, infill_rate=0.5)
  assert chat.select(data, 0.0).tokens.shape[0] == 30 and chat.select(data, 1.0).tokens.shape[0] == 10
  assert chat.select(data, 0.5).tokens.shape[0] == n


def test_read_jsonl_names_a_malformed_infill_record(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text('{"fim": {"prefix": "a", "middle": 3, "suffix": ""}}\n')
  with pytest.raises(ValueError, match=r"t.jsonl:1: an infill record's 'fim'"):
    chat.read_jsonl(str(path))


def test_bucket_of_is_the_smallest_length_that_holds_a_row():
  got = chat.bucket_of(np.array([1, 8, 9, 16, 17, 32]), (16, 8), 32)
  assert got.tolist() == [8, 8, 16, 16, 32, 32]


def test_length_buckets_cut_rows_to_one_length_per_batch_and_keep_every_answer():
  rng = np.random.default_rng()
  n, seq_len, edges = 96, 32, (8, 16, 32)
  lengths = rng.integers(2, seq_len + 1, n)
  lengths[:3] = 5  # with the rest random, bucket 8 may hold too few rows for a batch: then they read at 16
  tokens = np.full((n, seq_len), 2, np.int32)
  for i, length in enumerate(lengths):
    tokens[i, :length] = 100 + i  # the row's id in every used column
  data = chat.ChatRows(tokens, tokens != 2, 0, None, lengths)
  it = chat.train_iterator(data, 4, seed=0, buckets=(8, 16))
  widths = set()
  for _ in range(60):
    b = next(it)
    width = b["tokens"].shape[1]
    widths.add(width)
    ids = b["tokens"][:, 0] - 100
    assert width in edges and (lengths[ids] <= width).all()
    np.testing.assert_array_equal(b["tokens"], tokens[ids, :width])
    np.testing.assert_array_equal(b["loss_mask"], tokens[ids, :width] != 2)
  assert widths == {16, 32} | ({8} if (lengths <= 8).sum() >= 4 else set())
  # Two rows of bucket 8 make no batch of 4: they are read at 16, whole.
  lengths = np.array([5, 5] + [12] * 10 + [20] * 20)
  tokens = np.where(np.arange(seq_len) < lengths[:, None], 100 + np.arange(len(lengths))[:, None], 2)
  it = chat.train_iterator(chat.ChatRows(tokens, tokens != 2, 0, None, lengths), 4, seed=0, buckets=(8, 16))
  seen = {}
  for _ in range(60):
    b = next(it)
    for row in b["tokens"]:
      seen[int(row[0]) - 100] = b["tokens"].shape[1]
  assert seen[0] == seen[1] == 16 and {seen[i] for i in range(2, 12)} == {16} and seen[20] == 32
