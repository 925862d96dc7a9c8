"""Attention with the sequence sharded over the mesh's `sequence` axis.

Each device keeps its share of the queries and gathers every key and value
(an all-gather on the way in; its transpose, a reduce-scatter of dK and dV,
on the way back), then runs the chunked attention on its rows at their
global offset. Gathered keys and values rather than a ring: every mask kind
(the BD3 training mask, packed segments, a KV-cache prefix) works unchanged,
because each device sees all keys and evaluates the mask at global indices;
a ring's send/receive schedule would have to be rebalanced per mask to skip
masked tiles. The gathered keys and values are [S, kv_heads, head_dim] per
sequence, a fraction of the activations with grouped-query attention, and
the attention's memory stays linear in the length on every device.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from mdlm_jax.kernels.chunked_attention import chunked_attention
from mdlm_jax.kernels.masks import AttentionMask

AXIS = "sequence"


def sequence_shards(mesh, l: int, s: int) -> int:
  """How many ways the queries split (1: this attention does not split)."""
  if mesh is None or mesh.empty or AXIS not in mesh.axis_names:
    return 1
  n = dict(mesh.shape)[AXIS]
  return n if n > 1 and l % n == 0 and l >= n else 1


def sequence_parallel_attention(q, k, v, mask: AttentionMask, *, mesh, batch, heads, causal: bool = False):
  """`chunked_attention(q, k, v, mask)` with q's rows split over AXIS; `batch`
  and `heads` are the mesh axes of those dimensions, or None (query and
  key/value heads split alike, so each shard keeps whole GQA groups)."""
  n = dict(mesh.shape)[AXIS]
  l = q.shape[1]
  local = l // n
  q_spec, kv_spec = P(batch, AXIS, heads, None), P(batch, None, heads, None)
  # The per-row arrays travel as a dict (shard_map rebuilds its arguments'
  # pytrees with placeholders, which an AttentionMask's checks refuse).
  fields = {f: getattr(mask, f) for f in ("q_segment_ids", "kv_segment_ids", "kv_valid", "q_end")
            if getattr(mask, f) is not None}

  def spec(name, x):
    b = batch if x.shape[0] > 1 else None
    return P(b, AXIS) if name in ("q_segment_ids", "q_end") else P(b, None)

  def run(q, k, v, arrays):
    offset = jax.lax.axis_index(AXIS) * local
    return chunked_attention(q, k, v, mask.replace(**arrays), causal=causal, q_offset=offset, q_total=l)

  return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, {f: spec(f, x) for f, x in fields.items()}),
                       out_specs=q_spec, check_vma=False)(q, k, v, fields)
