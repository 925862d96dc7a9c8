"""Conversations as instruction-tuning rows, the way LLaDA tunes: the prompt
is never masked and the loss covers the response only.

Each conversation (`{"messages": [...], "tools": [...]}`, as
`data/instructions.py` writes them) is rendered with the chat template. The
last message is the response: its text is what the full rendering adds to
the rendering of the messages before it with the generation prompt. A row is

    [bos] prompt response [eos] [eos] ... [eos]      (exactly seq_len tokens)

with `loss_mask` True over the response and every EOS after it: padding with
EOS that the loss covers teaches the model to end its answer, so that the
length of a generation follows the answer, not the canvas. Conversations
longer than seq_len are left out (counted), never cut.

An infill record (`{"fim": {"prefix", "middle", "suffix"}}`) becomes the
same kind of row with the PSM prompt (`data/fim.py`) and the middle as the
response, so instruction tuning keeps (and sharpens) infilling. A run draws
`data.fim_rate` of its rows from those (`train_iterator`).

Mined examples are a few hundred tokens, so most of a long row is padding
the network still runs over. With `data.length_buckets` a batch holds rows
of one bucket, cut to that bucket's length: the same answers and EOS, a
shorter padding, a fraction of the compute.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Sequence

import numpy as np

from mdlm_jax.data import chat_template


@dataclasses.dataclass(frozen=True)
class ChatRows:
  tokens: np.ndarray  # int32 [n, seq_len]
  loss_mask: np.ndarray  # bool [n, seq_len]
  too_long: int  # conversations left out
  infill: np.ndarray | None = None  # bool [n]: the row is an infill record (None: none is)
  lengths: np.ndarray | None = None  # int [n]: prompt, answer and its EOS (None: the whole row)

  @property
  def is_infill(self) -> np.ndarray:
    return np.zeros(len(self.tokens), bool) if self.infill is None else self.infill

  @property
  def used(self) -> np.ndarray:
    return np.full(len(self.tokens), self.tokens.shape[1]) if self.lengths is None else self.lengths

  def take(self, index) -> "ChatRows":
    return ChatRows(self.tokens[index], self.loss_mask[index], self.too_long, self.is_infill[index],
                    self.used[index])


def split_response(template: str, conversation: dict) -> tuple[str, str]:
  """(prompt text, response text) of a conversation whose last message is the
  assistant's answer."""
  messages, tools = conversation["messages"], conversation.get("tools")
  if not messages or messages[-1].get("role") != "assistant":
    raise ValueError("a training conversation ends with the assistant's message")
  prompt = chat_template.render(template, messages[:-1], tools=tools, add_generation_prompt=True)
  full = chat_template.render(template, messages, tools=tools)
  if not full.startswith(prompt):
    raise ValueError("the chat template renders the history differently once the answer is added")
  return prompt, full[len(prompt):]


def text_of(record: dict, template: str) -> str:
  """The whole text of a record (what a tokenizer trained for the run reads)."""
  if "fim" in record:
    f = record["fim"]
    return f["prefix"] + f["middle"] + f["suffix"]
  return chat_template.render(template, record["messages"], tools=record.get("tools"))


def rows(conversations: Iterable[dict], tokenizer, template: str, seq_len: int) -> ChatRows:
  tokens, masks, infill, lengths, too_long = [], [], [], [], 0
  fmt = None
  for conv in conversations:
    if "fim" in conv:
      if fmt is None:
        from mdlm_jax.data.fim import FIMFormat  # pylint: disable=import-outside-toplevel
        fmt = FIMFormat.of(tokenizer)
      f = conv["fim"]
      p = fmt.prompt(tokenizer.bos_id, tokenizer.encode(f["prefix"]), tokenizer.encode(f["suffix"]))
      r = tokenizer.encode(f["middle"]) + [tokenizer.eos_id]
    else:
      prompt, response = split_response(template, conv)
      p = [tokenizer.bos_id] + tokenizer.encode(prompt)
      r = tokenizer.encode(response) + [tokenizer.eos_id]
    if len(p) + len(r) > seq_len:
      too_long += 1
      continue
    row = np.full((seq_len,), tokenizer.eos_id, np.int32)
    row[:len(p)], row[len(p):len(p) + len(r)] = p, r
    mask = np.zeros((seq_len,), bool)
    mask[len(p):] = True
    tokens.append(row)
    masks.append(mask)
    infill.append("fim" in conv)
    lengths.append(len(p) + len(r))
  if not tokens:
    raise ValueError(f"no conversation fits in seq_len={seq_len} tokens ({too_long} longer)")
  return ChatRows(np.stack(tokens), np.stack(masks), too_long, np.asarray(infill, bool), np.asarray(lengths))


def read_jsonl(path: str) -> list[dict]:
  out = []
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
      fim = record.get("fim") if isinstance(record, dict) else None
      if fim is not None:
        if not (isinstance(fim, dict) and all(isinstance(fim.get(k), str) for k in ("prefix", "middle", "suffix"))):
          raise ValueError(f"{path}:{n}: an infill record's 'fim' is an object with string 'prefix', 'middle'"
                           " and 'suffix'")
      elif not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(f"{path}:{n}: a record is an object with a 'messages' array (a conversation) or a"
                         " 'fim' object (an infill)")
      out.append(record)
  return out


def select(data: ChatRows, infill_rate: float) -> ChatRows:
  """The rows a run with this share of infill rows reads: conversations only
  at 0, infills only at 1, both otherwise."""
  if infill_rate <= 0:
    return data.take(~data.is_infill)
  return data.take(data.is_infill) if infill_rate >= 1 else data


def bucket_of(lengths: np.ndarray, buckets: Sequence[int], seq_len: int) -> np.ndarray:
  """The length each row is cut to: the smallest bucket (or seq_len) that holds it."""
  edges = np.asarray(sorted({*buckets, seq_len}))
  return edges[np.searchsorted(edges, lengths)]


def train_iterator(data: ChatRows, batch_size: int, seed: int, *, infill_rate: float = 0.0,
                   buckets: Sequence[int] = (), process_index: int = 0, process_count: int = 1):
  """Endless shuffled batches {"tokens", "loss_mask"} of this process's rows
  (every process_count-th), a new order each epoch; a grain iterator, so its
  position is saved in checkpoints and restored on resume.

  A batch is rows of one kind (infill or conversation) and one length bucket,
  cut to it (`bucket_of`). Batches of each (kind, bucket) pool come in the
  share `infill_rate` (or 1 - it) times the pool's share of its kind, counted
  over all processes' rows, so that every process takes the same shape at
  each step and `infill_rate` of the batches are infills. A bucket with
  fewer rows than a batch is read at the next length up."""
  import grain
  seq_len = data.tokens.shape[1]
  mine = np.arange(len(data.tokens))[process_index::process_count]
  if batch_size > len(mine):
    raise ValueError(f"a batch of {batch_size} is more than this process's {len(mine)} conversations")
  edges = sorted({*buckets, seq_len})
  cut = bucket_of(data.used, edges, seq_len)
  pools, weights = [], []
  for kind, share in ((False, 1.0 - infill_rate), (True, infill_rate)):
    if share <= 0:
      continue
    of_kind = data.is_infill == kind
    if not of_kind.any():
      what = "infill records" if kind else "conversations"
      raise ValueError(f"data.fim_rate={infill_rate} draws rows from the folder's {what}, but it has none")
    for length in edges:
      everywhere = of_kind & (cut == length)
      if not everywhere.any():
        continue
      fewest = min(everywhere[q::process_count].sum() for q in range(process_count))  # the same on every process
      if fewest < batch_size and length < seq_len:
        cut[everywhere] = edges[edges.index(length) + 1]  # too few for batches of their own: read longer
        continue
      if fewest < batch_size:
        what = "infill records" if kind else "conversations"
        raise ValueError(f"{fewest} {what} of length up to {length} on a process make no batch of {batch_size}")
      rows_ = mine[everywhere[mine]]
      pools.append(grain.MapDataset.range(len(rows_)).map(lambda j, r=rows_: int(r[j]))
                   .shuffle(seed=seed + 1000 * kind + length).repeat(None)
                   .map(lambda i, n=length: {"tokens": data.tokens[i, :n], "loss_mask": data.loss_mask[i, :n]})
                   .batch(batch_size, drop_remainder=True))
      weights.append(share * everywhere.sum() / of_kind.sum())
  ds = pools[0] if len(pools) == 1 else grain.MapDataset.mix(pools, weights)
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def eval_batches(data: ChatRows, batch_size: int, num_batches: int) -> list[dict[str, np.ndarray]]:
  """The first rows, in order, as up to num_batches batches of batch_size. A
  last partial batch is filled with rows that score nothing (loss_mask all
  false: the objectives count and mask scored tokens only), so a held-out set
  smaller than a training batch still evaluates, and every row counts."""
  n = min(len(data.tokens), num_batches * batch_size)
  if n < 1:
    raise ValueError("the held-out conversations are empty: nothing to evaluate")
  out = []
  for start in range(0, n, batch_size):
    tokens, loss_mask = data.tokens[start:min(n, start + batch_size)], data.loss_mask[start:min(n, start + batch_size)]
    short = batch_size - len(tokens)
    if short:
      tokens = np.concatenate([tokens, np.zeros((short, tokens.shape[1]), tokens.dtype)])
      loss_mask = np.concatenate([loss_mask, np.zeros((short, loss_mask.shape[1]), loss_mask.dtype)])
    out.append({"tokens": tokens, "loss_mask": loss_mask})
  return out


def load(folder: str, split: str, tokenizer, template: str, seq_len: int) -> ChatRows:
  """Rows of `train.jsonl` or (split "validation") `heldout.jsonl` in an
  instruction folder (`python -m mdlm_jax.corpus instructions`)."""
  name = {"train": "train.jsonl", "validation": "heldout.jsonl"}[split]
  path = os.path.join(folder, name)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: data.corpus of a chat run is a folder with train.jsonl and"
                            " heldout.jsonl")
  return rows(read_jsonl(path), tokenizer, template, seq_len)


__all__: Sequence[str] = ["ChatRows", "eval_batches", "load", "read_jsonl", "rows", "split_response",
                          "train_iterator"]
