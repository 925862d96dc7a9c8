"""The safetensors file format, read and written with numpy alone.

The serving ecosystem's weight format: an 8-byte little-endian header size, a
JSON header naming each tensor's dtype, shape and byte range, then the raw
little-endian bytes. Writing it ourselves keeps bfloat16 exact (through
ml_dtypes, which JAX already needs) and adds no dependency.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
from typing import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20
_BIG_ENDIAN_HOST = sys.byteorder != "little"


class SafetensorsError(ValueError):
  """A file that is not valid safetensors; the message says what is wrong."""


def save(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
  """Writes atomically: a temporary file in the same folder, renamed into place."""
  header, offset = {}, 0
  arrays = {}
  for name in sorted(tensors):
    a = np.asarray(tensors[name])
    if a.dtype not in _NAMES:
      raise SafetensorsError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray would make 0-d 1-d)
    if _BIG_ENDIAN_HOST:
      a = a.byteswap()
    arrays[name] = a
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the tensor bytes start 8-byte aligned
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(struct.pack("<Q", len(blob)))
      f.write(blob)
      for name in sorted(arrays):
        f.write(arrays[name].tobytes())
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would hide shipped weights from other users
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def current_umask() -> int:
  """The process umask (reading it means setting it, so it is set straight back)."""
  mask = os.umask(0)
  os.umask(mask)
  return mask


def load(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Returns (tensors, metadata); every inconsistency is a SafetensorsError."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise SafetensorsError(f"{path}: cannot read ({e.strerror})") from e
  if len(data) < 8:
    raise SafetensorsError(f"{path}: too short to be safetensors ({len(data)} bytes)")
  (n,) = struct.unpack("<Q", data[:8])
  if n > min(_MAX_HEADER, len(data) - 8):
    raise SafetensorsError(f"{path}: header size {n} exceeds the file")
  try:
    header = json.loads(data[8:8 + n])
  except ValueError as e:
    raise SafetensorsError(f"{path}: header is not JSON ({e})") from e
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: header is not a JSON object")
  metadata = header.pop("__metadata__", {}) or {}
  body = memoryview(data)[8 + n:]
  tensors = {}
  for name, info in header.items():
    try:
      dtype = _DTYPES[info["dtype"]]
      shape = tuple(int(s) for s in info["shape"])
      begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
      raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry ({e!r})") from e
    if not 0 <= begin <= end <= len(body) or end - begin != dtype.itemsize * int(np.prod(shape)):
      raise SafetensorsError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not fit its"
                             f" shape {shape} and dtype {info['dtype']} or the file")
    a = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape)
    tensors[name] = a.byteswap() if _BIG_ENDIAN_HOST else a.copy()
  return tensors, metadata


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def parse_size(text: str | int) -> int:
  """Bytes from an int or a string such as "5GB", "500MB", "64KiB" (decimal and binary units)."""
  if isinstance(text, int):
    return text
  units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
           "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
  s = str(text).strip().upper()
  num = s.rstrip("KMGTIB")
  try:
    value = float(num) * units[s[len(num):]]
  except (KeyError, ValueError):
    raise ValueError(f"size {text!r} is not a number of bytes such as 5GB, 500MB or 1048576") from None
  if value < 1:
    raise ValueError(f"size {text!r} must be at least one byte")
  return int(value)


def save_folder(folder: str, tensors: Mapping[str, np.ndarray], *, max_shard_bytes: int,
                metadata: Mapping[str, str] | None = None) -> list[str]:
  """Writes `model.safetensors`, or, past `max_shard_bytes`, the Hugging Face sharded
  layout (model-0000i-of-0000n.safetensors + model.safetensors.index.json) that
  `load_folder` and transformers both read. Tensors keep their order; a tensor larger
  than the limit gets a shard of its own. Returns the files written."""
  shards: list[list[str]] = [[]]
  size = 0
  for name in tensors:
    nbytes = np.asarray(tensors[name]).nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  if len(shards) == 1:
    save(os.path.join(folder, SINGLE_FILE), tensors, metadata)
    return [SINGLE_FILE]
  n = len(shards)
  files, weight_map = [], {}
  for i, names in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    save(os.path.join(folder, fname), {k: tensors[k] for k in names}, metadata)
    files.append(fname)
    weight_map.update({k: fname for k in names})
  index = {"metadata": {"total_size": int(sum(np.asarray(a).nbytes for a in tensors.values()))},
           "weight_map": weight_map}
  with open(os.path.join(folder, INDEX_FILE), "w") as f:
    json.dump(index, f, indent=1)
  return files + [INDEX_FILE]


def has_weights(folder: str) -> bool:
  return any(os.path.isfile(os.path.join(folder, f)) for f in (SINGLE_FILE, INDEX_FILE))


def load_folder(folder: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Reads what `save_folder` (or transformers' save_pretrained) wrote: one file or an index of shards."""
  index_path = os.path.join(folder, INDEX_FILE)
  if not os.path.isfile(index_path):
    path = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(path):
      raise SafetensorsError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    return load(path)
  try:
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise SafetensorsError(f"{index_path}: not a safetensors index ({e!r})") from e
  tensors, metadata = {}, {}
  for fname in files:
    if os.path.basename(fname) != fname or not os.path.isfile(os.path.join(folder, fname)):
      raise SafetensorsError(f"{index_path} names shard {fname!r}, which is not in {folder}")
    part, metadata = load(os.path.join(folder, fname))
    tensors.update(part)
  missing = sorted(k for k in weight_map if k not in tensors)
  if missing:
    raise SafetensorsError(f"{index_path} lists tensors its shards lack: {missing[:3]}")
  return tensors, metadata
