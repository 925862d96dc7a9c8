"""Triton's interpreter (TRITON_INTERPRET=1) over numpy arrays, so a Triton
kernel runs on a machine without a GPU or PyTorch. The interpreter reads and
writes a tensor argument through its data pointer, and copies it to the host
and back through a few PyTorch tensor methods; `HostTensor` gives it those
over a numpy array's own memory, so the copies are the array itself."""

from __future__ import annotations

import numpy as np

_TORCH_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int32): "int32",
                np.dtype(np.uint32): "uint32", np.dtype(np.int64): "int64"}


class _Dtype:
  def __init__(self, name: str):
    self.name = name

  def __str__(self):
    return f"torch.{self.name}"


class _Storage:
  def __init__(self, array: np.ndarray):
    self.array = array

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def cpu(self) -> "_Storage":
    return self

  def copy_(self, other) -> None:
    del other  # host and device are the same memory


class HostTensor:
  """A contiguous numpy array as the interpreter's tensor argument."""

  def __init__(self, array):
    self.array = np.ascontiguousarray(array)
    if self.array.dtype not in _TORCH_NAMES:
      raise TypeError(f"no Triton type for {self.array.dtype}")
    self.dtype = _Dtype(_TORCH_NAMES[self.array.dtype])

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def untyped_storage(self) -> _Storage:
    return _Storage(self.array)

  def new_empty(self, *_, **__) -> "HostTensor":
    return HostTensor(self.array[:0])

  def set_(self, storage: _Storage, *_) -> "HostTensor":
    self.array = storage.array
    return self

  def storage_offset(self) -> int:
    return 0

  def size(self):
    return self.array.shape

  def stride(self):
    return tuple(s // self.array.itemsize for s in self.array.strides)

  def copy_(self, other) -> None:
    del other
