"""Decoding weights held once per kind, every layer's along a leading axis.

A decoding pass at batch 1 is short enough that handing XLA its operands
shows: jit's dispatch checks each argument, and an imported model has a
thousand-odd arrays (SmolLM2-135M's int8 copy: 1,084; the engine's call
that launches a pass took 2.4 ms with them, 0.5 ms with the 40 stacks,
measured). Stacked, each kind of weight is one array: the blocks
read their layer of it, the int8 products in place (`kernels.stack_layers`),
the small arrays (norm scales, biases) through a slice XLA fuses into their
use. Other float arrays of two or more axes (a time-conditioned model's
modulation) stay one array a layer: XLA's dot would copy a slice of a stack
out before multiplying it. The adapters' own params are stacked too: the
int8 weights carry them joined, so no pass reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array

from mdlm_jax import kernels


@struct.dataclass
class LayerSlice:
  """Layer `layer` of an array stacked over layers, standing where that
  layer's own array stands in the params (read as `w[...]`)."""

  stacked: Array
  layer: int = struct.field(pytree_node=False)

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError("a LayerSlice is read whole (w[...])")
    return self.stacked[self.layer]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.stacked.shape[1:])

  @property
  def dtype(self):
    return self.stacked.dtype

  @property
  def ndim(self) -> int:
    return len(self.shape)


def _is_int8(x) -> bool:
  return isinstance(x, kernels.QuantizedWeight)


def _stackable(path, leaf) -> bool:
  """Whether a pass reads this float block leaf in place from a stack: a
  vector (read through a fused slice), or an adapter's own param (read by
  no pass of an int8 copy). Int8 weights always stack."""
  return leaf.ndim == 1 or "lora_" in jax.tree_util.keystr(path)


def stack_blocks(params: dict) -> dict:
  """`params` of an int8 decoding copy (`transformer.quantize_for_decoding`)
  with the blocks' arrays that can be read from a stack (`_stackable`)
  replaced by their layer of one stack of their kind; the same values, read
  by the same module (`spec.bind`)."""
  blocks = params["blocks"]
  keys = sorted(blocks)
  flat = [jax.tree_util.tree_flatten_with_path(blocks[k], is_leaf=_is_int8) for k in keys]
  tree = flat[0][1]
  if any(t != tree for _, t in flat):
    raise ValueError("the blocks differ in structure: they cannot be stacked")
  columns = []
  for same in zip(*(leaves for leaves, _ in flat)):
    path, leaf = same[0]
    values = [v for _, v in same]
    if _is_int8(leaf):
      columns.append(kernels.stack_layers(values))
    elif _stackable(path, leaf):
      stacked = jnp.stack(values)
      columns.append([LayerSlice(stacked, i) for i in range(len(values))])
    else:
      columns.append(values)
  out = dict(params, blocks={})
  for i, k in enumerate(keys):
    out["blocks"][k] = jax.tree.unflatten(tree, [column[i] for column in columns])
  return out
