"""Corpora, train/validation splits and the grain input pipeline.

Documents are whole text files (or jsonl records). Each is tokenized as
`[bos] + ids + [eos]` and the stream is packed into rows of exactly `seq_len`
tokens with no padding, so every position the model sees is real data.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import grain
import numpy as np

SPLITS = ("train", "validation")
# Directory names under the stdlib root that hold tests, test data or
# third-party packages rather than the library itself.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_GLOB_CHARS = frozenset("*?[")


class TokenizerLike(Protocol):
  """What the pipeline needs from mdlm_jax.tokenizer.Tokenizer."""

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...


# ----------------------------------------------------------------- documents


def _read_text(path: str) -> str | None:
  """The file's exact text, or None if it is not a utf-8 text file."""
  with open(path, "rb") as f:
    raw = f.read()
  if b"\0" in raw:  # utf-8 decodes NULs, but they mean a binary file.
    return None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return None


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
  """Sorted paths of the running interpreter's own stdlib .py sources.

  A corpus that needs no download: same interpreter, same bytes, same splits.
  """
  root = stdlib_root()
  if not os.path.isdir(root):
    raise FileNotFoundError(f"stdlib directory not found: {root}")
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
    for name in filenames:
      path = os.path.join(dirpath, name)
      if name.endswith(".py") and os.path.isfile(path) and _read_text(path) is not None:
        paths.append(path)
  return sorted(paths)


def split_of(key: str, validation_fraction: float) -> str:
  """"train" or "validation", stable across processes, machines and runs.

  Python's hash() is salted per process, so a sha256 of the key is used.
  """
  digest = hashlib.sha256(key.encode("utf-8")).digest()
  u = int.from_bytes(digest[:8], "big") / 2.0**64  # uniform in [0, 1)
  return "validation" if u < validation_fraction else "train"


def _stdlib_docs() -> list[tuple[str, str]]:
  root = stdlib_root()
  return [(os.path.relpath(p, root).replace(os.sep, "/"), p) for p in stdlib_files()]


def _dir_docs(directory: str) -> list[tuple[str, str]]:
  """(key, path) for every file below directory; hidden entries (.git) skipped."""
  out = []
  for dirpath, dirnames, filenames in os.walk(directory):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    for name in filenames:
      path = os.path.join(dirpath, name)
      if not name.startswith(".") and os.path.isfile(path):
        out.append((os.path.relpath(path, directory).replace(os.sep, "/"), path))
  return sorted(out)


def _glob_root(pattern: str) -> str:
  """The directory part of pattern before its first wildcard."""
  parts = pattern.split(os.sep)
  static = []
  for part in parts[:-1]:
    if _GLOB_CHARS & set(part):
      break
    static.append(part)
  return os.sep.join(static) or "."


def _glob_docs(pattern: str) -> list[tuple[str, str]]:
  paths = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
  root = _glob_root(pattern)
  return sorted((os.path.relpath(p, root).replace(os.sep, "/"), p) for p in paths)


def _jsonl_docs(path: str, split: str, validation_fraction: float,
                text_field: str) -> tuple[list[str], int]:
  """The split's texts and the number of records; the split key of a record
  is its 0-based line index."""
  docs, records = [], 0
  with open(path, "rb") as f:
    for index, raw in enumerate(f):
      where = f"{path}:{index + 1}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError:
        raise ValueError(f"{where}: not utf-8 text") from None
      if not line.strip():
        continue  # blank lines (e.g. a trailing one) are not records.
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(record, dict) or text_field not in record:
        raise ValueError(f"{where}: no field {text_field!r} in the record")
      text = record[text_field]
      if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
      records += 1
      if text and split_of(str(index), validation_fraction) == split:
        docs.append(text)
  return docs, records


def load_documents(corpus: str, split: str, validation_fraction: float,
                   text_field: str = "text") -> list[str]:
  """The documents of one split of a corpus, in a deterministic order.

  corpus: "stdlib", a code corpus folder (`python -m mdlm_jax.corpus build`),
  a directory (every utf-8 text file below it), a glob of text files, or a
  .jsonl file whose records hold the text in text_field.
  Non-utf-8 files are skipped, so a directory may hold binaries too.
  A document's split follows from its key: its path relative to the corpus
  root (the stdlib root, the directory, or the glob's wildcard-free prefix),
  `package/path` in a code corpus, or for jsonl its 0-based line index.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not 0 <= validation_fraction <= 1:
    raise ValueError(f"validation_fraction must be in [0, 1], got {validation_fraction}")
  if not corpus:
    raise ValueError("corpus is empty: pass 'stdlib', a directory, a glob or a .jsonl file")

  from mdlm_jax.data import corpus as code_corpus
  if os.path.isdir(corpus) and code_corpus.is_corpus(corpus):  # built by `python -m mdlm_jax.corpus build`
    docs, files = [], 0
    for key, text in code_corpus.documents(corpus):
      files += 1
      if text and split_of(key, validation_fraction) == split:
        docs.append(text)
    total = f"{files} files"
  elif corpus.endswith(".jsonl") and not (_GLOB_CHARS & set(corpus)):
    if not os.path.isfile(corpus):
      raise FileNotFoundError(f"corpus file not found: {corpus}")
    docs, records = _jsonl_docs(corpus, split, validation_fraction, text_field)
    total = f"{records} records"
  else:
    if corpus == "stdlib":
      keyed = _stdlib_docs()
    elif os.path.isdir(corpus):
      keyed = _dir_docs(corpus)
    elif _GLOB_CHARS & set(corpus) or os.path.isfile(corpus):
      keyed = _glob_docs(corpus)
    else:
      raise FileNotFoundError(f"corpus path not found: {corpus}")
    if not keyed:
      raise ValueError(f"corpus {corpus!r} matches no files")
    docs = []
    for key, path in keyed:
      if split_of(key, validation_fraction) == split:
        text = _read_text(path)
        if text:  # None (not utf-8 text) or empty.
          docs.append(text)
    total = f"{len(keyed)} files"
  if not docs:
    raise ValueError(
        f"corpus {corpus!r} has no non-empty documents in the {split!r} split "
        f"({total}, validation_fraction={validation_fraction})")
  return docs


# ------------------------------------------------------------------ pipeline


def _doc_tokens(tokenizer: TokenizerLike, text: str) -> np.ndarray:
  ids = tokenizer.encode(text)
  out = np.empty(len(ids) + 2, np.int32)
  out[0] = tokenizer.bos_id
  out[1:-1] = ids
  out[-1] = tokenizer.eos_id
  return out


class _PackIterator(grain.DatasetIterator):
  """Concatenates token arrays and cuts the stream into seq_len rows.

  The state is (parent state before the current document, tokens of it
  already emitted): small, JSON-friendly, and restoring it re-tokenizes only
  that one document.
  """

  def __init__(self, parent: grain.DatasetIterator, seq_len: int):
    super().__init__(parent)
    self._seq_len = seq_len
    self._doc_state = parent.get_state()
    self._doc = np.zeros((0,), np.int32)
    self._offset = 0

  def __next__(self) -> dict[str, np.ndarray]:
    row = np.empty((self._seq_len,), np.int32)
    filled = 0
    while filled < self._seq_len:
      if self._offset == len(self._doc):
        state = self._parent.get_state()
        self._doc = next(self._parent)  # StopIteration drops the partial row.
        self._doc_state, self._offset = state, 0
        continue
      n = min(self._seq_len - filled, len(self._doc) - self._offset)
      row[filled:filled + n] = self._doc[self._offset:self._offset + n]
      filled += n
      self._offset += n
    return {"tokens": row}

  def get_state(self) -> dict[str, Any]:
    return {"doc": copy.deepcopy(self._doc_state), "offset": self._offset}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state["doc"])
    self._doc_state, self._offset = copy.deepcopy(state["doc"]), int(state["offset"])
    self._doc = np.zeros((0,), np.int32)
    if self._offset:
      self._doc = next(self._parent)
      if self._offset > len(self._doc):
        raise ValueError(
            f"pipeline state offset {self._offset} is past the end of its "
            f"document ({len(self._doc)} tokens): state from another corpus or tokenizer?")


class _PackIterDataset(grain.IterDataset):

  def __init__(self, parent: grain.IterDataset, seq_len: int):
    super().__init__(parent)
    self._seq_len = seq_len

  def __iter__(self) -> _PackIterator:
    return _PackIterator(self._parent.__iter__(), self._seq_len)

  def __str__(self) -> str:
    return f"_PackIterDataset(seq_len={self._seq_len})"


def _shuffle_seed(seed: int) -> int:
  """Hashes the user seed: grain reseeds epoch e with seed + e, so seeds s and
  s + 1 would otherwise replay each other's epochs shifted by one."""
  digest = hashlib.sha256(f"mdlm_jax.data.shuffle:{int(seed)}".encode()).digest()
  return int.from_bytes(digest[:4], "big")


def _check_shape(seq_len: int, batch_size: int):
  if seq_len < 1:
    raise ValueError(f"seq_len must be positive, got {seq_len}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be positive, got {batch_size}")


class _ShardsIterator(grain.DatasetIterator):
  """Rows of several reader shards side by side: one batch is the concatenation
  of each shard's next batch, in shard order."""

  def __init__(self, shards: Sequence[grain.DatasetIterator]):
    super().__init__(list(shards))

  def __next__(self) -> dict[str, np.ndarray]:
    return {"tokens": np.concatenate([next(p)["tokens"] for p in self._parents])}

  def get_state(self) -> dict[str, Any]:
    return {"shards": [p.get_state() for p in self._parents]}

  def set_state(self, state: dict[str, Any]) -> None:
    if len(state.get("shards", ())) != len(self._parents):
      raise ValueError(f"pipeline state holds {len(state.get('shards', ()))} reader shards, this process"
                       f" reads {len(self._parents)}: state from another data.num_shards or process count?")
    for p, s in zip(self._parents, state["shards"]):
      p.set_state(s)


def _shard_iterator(documents: Sequence[str], tokenizer: TokenizerLike, *, seq_len: int, rows: int,
                    seed: int, shard: int, num_shards: int, fim_rate: float = 0.0,
                    fim_spm_rate: float = 0.5, fim_level: str = "document") -> grain.DatasetIterator:
  ds = grain.MapDataset.source(documents)[shard::num_shards]
  ds = ds.shuffle(seed=_shuffle_seed(seed)).repeat(None)
  if fim_rate > 0:
    from mdlm_jax.data.fim import FIMFormat
    fmt, salt = FIMFormat.of(tokenizer), _shuffle_seed(seed + 1)
  if fim_rate > 0 and fim_level == "document":
    # The cut points and the order come from a generator seeded per element,
    # so they are the same on every run and after a resume.
    ds = ds.random_map(lambda text, rng: fmt.training_tokens(tokenizer, text, rng, rate=fim_rate,
                                                            spm_rate=fim_spm_rate), seed=salt)
  else:
    ds = ds.map(lambda text: _doc_tokens(tokenizer, text))
  # In-process, unthreaded reads: deterministic and cheap enough for tokenizing.
  packed = _PackIterDataset(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)), seq_len)
  if fim_rate > 0 and fim_level == "context":
    def rearrange(row):
      # Seeded by the row itself: the same on every run and after a resume,
      # with no state of its own.
      rng = np.random.default_rng([salt, zlib.crc32(row["tokens"].tobytes())])
      return {"tokens": fmt.context_tokens(row["tokens"], (tokenizer.bos_id, tokenizer.eos_id), rng,
                                           rate=fim_rate, spm_rate=fim_spm_rate)}
    packed = packed.map(rearrange)
  return iter(packed.batch(rows, drop_remainder=True))


def make_train_iterator(documents: Sequence[str], tokenizer: TokenizerLike, *,
                        seq_len: int, batch_size: int, seed: int,
                        process_index: int = 0, process_count: int = 1,
                        num_shards: int | None = None, fim_rate: float = 0.0,
                        fim_spm_rate: float = 0.5, fim_level: str = "document") -> grain.DatasetIterator:
  """Endless {"tokens": int32 [batch_size, seq_len]} batches for one process.
  With `fim_rate` > 0, that fraction of documents (`fim_level` "document")
  or of the runs of text in each packed row ("context") is rearranged for
  fill-in-the-middle (`data.fim`).

  batch_size is per process. The documents are dealt into `num_shards` reader
  shards (default: one per process), each shuffled by seed and packed on its
  own; process i reads the i-th contiguous group of num_shards / process_count
  shards, so it never touches another process's documents. With num_shards
  fixed, the global batch (the processes' batches in process order) does not
  depend on how many processes read it. get_state() is JSON-serializable and
  set_state() resumes exactly.
  """
  _check_shape(seq_len, batch_size)
  if fim_level not in ("document", "context"):
    raise ValueError(f"fim_level must be 'document' or 'context', got {fim_level!r}")
  num_shards = process_count if num_shards is None else num_shards
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
  if num_shards < 1 or num_shards % process_count:
    raise ValueError(f"{num_shards} reader shards cannot be split evenly over {process_count} processes")
  per_process = num_shards // process_count
  if batch_size % per_process:
    raise ValueError(f"a batch of {batch_size} rows per process does not split over its {per_process} reader"
                     " shards")
  if len(documents) < num_shards:
    raise ValueError(
        f"{len(documents)} documents cannot be sharded over {num_shards} "
        "reader shards: every shard needs at least one")
  shards = [_shard_iterator(documents, tokenizer, seq_len=seq_len, rows=batch_size // per_process, seed=seed,
                            shard=s, num_shards=num_shards, fim_rate=fim_rate, fim_spm_rate=fim_spm_rate,
                            fim_level=fim_level)
            for s in range(process_index * per_process, (process_index + 1) * per_process)]
  return shards[0] if per_process == 1 else _ShardsIterator(shards)


def _token_stream(documents: Sequence[str], tokenizer: TokenizerLike,
                  limit: int) -> Iterator[np.ndarray]:
  """Document token arrays in order until at least limit tokens were yielded."""
  total = 0
  for text in documents:
    if total >= limit:
      return
    tokens = _doc_tokens(tokenizer, text)
    total += len(tokens)
    yield tokens


def make_eval_batches(documents: Sequence[str], tokenizer: TokenizerLike, *,
                      seq_len: int, batch_size: int,
                      num_batches: int) -> list[np.ndarray]:
  """Up to num_batches int32 [batch_size, seq_len] batches, packed in document
  order with no shuffling, so every evaluation sees the same tokens."""
  _check_shape(seq_len, batch_size)
  if num_batches < 1:
    raise ValueError(f"num_batches must be positive, got {num_batches}")
  per_batch = seq_len * batch_size
  chunks = list(_token_stream(documents, tokenizer, per_batch * num_batches))
  stream = np.concatenate(chunks) if chunks else np.zeros((0,), np.int32)
  n = min(num_batches, len(stream) // per_batch)
  if n == 0:
    raise ValueError(
        f"evaluation documents hold {len(stream)} tokens, but one batch of "
        f"{batch_size} x {seq_len} needs {per_batch}")
  rows = stream[:n * per_batch].reshape(n, batch_size, seq_len)
  return [np.ascontiguousarray(b) for b in rows]


def load_all_documents(corpus: str, text_field: str = "text") -> list[str]:
  """Every document of a corpus, ignoring the train/validation split (for
  evaluating on data the user names)."""
  return load_documents(corpus, "train", 0.0, text_field)
