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
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Sequence

import numpy as np

from mdlm_jax.checkpoints import chat_template


@dataclasses.dataclass(frozen=True)
class ChatRows:
  tokens: np.ndarray  # int32 [n, seq_len]
  loss_mask: np.ndarray  # bool [n, seq_len]
  too_long: int  # conversations left out


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


def rows(conversations: Iterable[dict], tokenizer, template: str, seq_len: int) -> ChatRows:
  tokens, masks, too_long = [], [], 0
  for conv in conversations:
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
  if not tokens:
    raise ValueError(f"no conversation fits in seq_len={seq_len} tokens ({too_long} longer)")
  return ChatRows(np.stack(tokens), np.stack(masks), too_long)


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
      if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(f"{path}:{n}: a conversation is an object with a 'messages' array")
      out.append(record)
  return out


def train_iterator(data: ChatRows, batch_size: int, seed: int, *, process_index: int = 0,
                   process_count: int = 1):
  """Endless shuffled batches {"tokens", "loss_mask"} of this process's rows
  (every process_count-th), a new order each epoch; a grain iterator, so its
  position is saved in checkpoints and restored on resume."""
  import grain
  n = len(data.tokens[process_index::process_count])
  if batch_size > n:
    raise ValueError(f"a batch of {batch_size} is more than this process's {n} conversations")
  ds = grain.MapDataset.range(len(data.tokens))[process_index::process_count]
  ds = ds.shuffle(seed=seed).repeat(None).map(lambda i: {"tokens": data.tokens[i], "loss_mask": data.loss_mask[i]})
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  return iter(it.batch(batch_size, drop_remainder=True))


def eval_batches(data: ChatRows, batch_size: int, num_batches: int) -> list[dict[str, np.ndarray]]:
  """The first rows, in order, as up to num_batches whole batches."""
  n = min(num_batches, len(data.tokens) // batch_size)
  if n < 1:
    raise ValueError(f"{len(data.tokens)} held-out conversations make no batch of {batch_size}")
  return [{"tokens": data.tokens[i * batch_size:(i + 1) * batch_size],
           "loss_mask": data.loss_mask[i * batch_size:(i + 1) * batch_size]} for i in range(n)]


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
