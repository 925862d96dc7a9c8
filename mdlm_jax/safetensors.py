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
