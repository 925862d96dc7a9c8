"""The slot state as few buffers where the engine's programs take and return it.

On XLA:CPU, launching a program costs host time for every argument and result
buffer (jit's argument checks, the runtime's buffer bookkeeping and result
objects), and at batch 1 the launch is most of the engine's host work a pass.
The slot state is about forty small arrays, so the engine holds it packed: its
arrays of 4-byte elements and its flags, each reshaped to one row a slot, sit
side by side in one int32 buffer [slots, columns] (4-byte dtypes bitcast, flags
converted), and the programs unpack it on entry and pack it on return. Large
arrays (the cache's keys and values) keep buffers of their own, updated in
place; packing copies only the small ones, a few KB a slot.

Rows stay rows, so a packed buffer shards over slots as its arrays did.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# A slot's share of a packed array at most (elements): larger ones keep their own
# buffer, so that packing (a copy each pass) stays small beside a pass.
MAX_PACKED_PER_SLOT = 16384


@dataclasses.dataclass(frozen=True)
class _Leaf:
  shape: tuple[int, ...]
  dtype: Any
  start: int  # first column in the packed buffer; -1: a buffer of its own
  own: int  # index among the own buffers (-1: packed)

  @property
  def columns(self) -> int:
    return math.prod(self.shape[1:])


@dataclasses.dataclass(frozen=True)
class Packing:
  """How a pytree of slot-indexed arrays packs: `pack(tree)` is a tuple (its
  own-buffer arrays in leaf order, then the packed int32 buffer), `unpack`
  its inverse. Both run inside jit (or on numpy arrays, eagerly)."""
  treedef: Any
  leaves: tuple[_Leaf, ...]
  rows: int
  columns: int
  names: tuple[str, ...]  # each leaf's path, e.g. "cache.k"

  @classmethod
  def of(cls, tree, rows: int, keep_whole: Callable[[str], bool] = lambda name: False) -> "Packing":
    """The packing of `tree` (arrays or shape structs), whose leaves index
    slots on their first axis (`rows` of them) except those `keep_whole`
    names (by path), which keep their own buffers, as do leaves too large
    to copy every pass or of dtypes that are not 4 bytes wide or bool."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, names, column, own = [], [], 0, 0
    for path, x in flat:
      name = jax.tree_util.keystr(path, simple=True, separator=".")
      shape, dtype = tuple(x.shape), np.dtype(x.dtype)
      packed = (not keep_whole(name) and len(shape) >= 1 and shape[0] == rows
                and math.prod(shape[1:]) <= MAX_PACKED_PER_SLOT and (dtype.itemsize == 4 or dtype == np.bool_))
      if packed:
        leaves.append(_Leaf(shape, dtype, column, -1))
        column += math.prod(shape[1:])
      else:
        leaves.append(_Leaf(shape, dtype, -1, own))
        own += 1
      names.append(name)
    return cls(treedef, tuple(leaves), rows, column, tuple(names))

  @property
  def num_own(self) -> int:
    return sum(leaf.own >= 0 for leaf in self.leaves)

  def pack(self, tree) -> tuple:
    xs = self.treedef.flatten_up_to(tree)
    np_mode = all(isinstance(x, np.ndarray) for x in xs)
    xp = np if np_mode else jnp
    own = tuple(x for x, leaf in zip(xs, self.leaves) if leaf.own >= 0)
    parts = [_to_int32(xp, x, leaf.dtype).reshape(self.rows, leaf.columns)
             for x, leaf in zip(xs, self.leaves) if leaf.own < 0]
    packed = xp.concatenate(parts, axis=1) if parts else xp.zeros((self.rows, 0), xp.int32)
    return own + (packed,)

  def unpack(self, packed: tuple):
    own, buffer = packed[:-1], packed[-1]
    if len(own) != self.num_own or tuple(buffer.shape) != (self.rows, self.columns):
      raise ValueError(f"not this packing's buffers: {len(own)} own buffers and a packed {tuple(buffer.shape)}, "
                       f"expected {self.num_own} and {(self.rows, self.columns)}")
    xp = np if isinstance(buffer, np.ndarray) else jnp
    xs = []
    for leaf in self.leaves:
      if leaf.own >= 0:
        xs.append(own[leaf.own])
      else:
        part = buffer[:, leaf.start:leaf.start + leaf.columns]
        xs.append(_from_int32(xp, part, leaf.dtype).reshape(leaf.shape))
    return self.treedef.unflatten(xs)

  def own_buffer(self, packed: tuple, name: str):
    """The array `name` (a path such as "cache.k") where it keeps its own
    buffer: read without a program."""
    i = self.names.index(name)
    if self.leaves[i].own < 0:
      raise ValueError(f"{name} is packed: unpack to read it")
    return packed[self.leaves[i].own]


def _to_int32(xp, x, dtype):
  if dtype == np.bool_:
    return x.astype(xp.int32)
  if dtype == np.int32:
    return x
  return x.view(np.int32) if xp is np else lax.bitcast_convert_type(x, jnp.int32)


def _from_int32(xp, x, dtype):
  if dtype == np.bool_:
    return x != 0
  if dtype == np.int32:
    return x
  return x.view(dtype) if xp is np else lax.bitcast_convert_type(x, dtype)
