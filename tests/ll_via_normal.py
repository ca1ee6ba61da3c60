"""An independent re-derivation of the low-latency ops from the normal ones
(expert layout), kept as an extra oracle for the low-latency reference.

The low-latency contract (docs/design.md §2) is the expert layout with a fixed
[E_l, R * max_tokens] grid per expert instead of packed groups: the rows of
local expert l are exactly the expert-layout group of l, in the same
(source rank, token, k) order. So:

  dispatch: normal dispatch (expert layout, alignment 1, capacity R * T * K:
            every (token, k) is at most one row) -> each group moved to its
            row of the grid;
            src_entry = (src_rank * T + src_token) * K + src_k.
  combine:  the grid's rows back into the packed group order, then normal
            combine (expert layout) with per-row weights. The combine-time
            topk_weights reach the expert side through a dispatch of a
            16-byte placeholder row per token (which also rebuilds the
            normal handle): the weights are applied where the reference
            applies them, in the same f32 order, so the result is bitwise
            the reference's.

With the normal ops on the reference backend this checks the low-latency
reference against the normal one bit for bit (test_low_latency_via_normal.py).
It was once the CUDA path of the low-latency ops (645-1336 us per op on
2 x H200, two normal ops plus two local moves); the dedicated kernels
(docs/low_latency.md) replaced it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep import reference as ref
from jax_ep._checks import raise_if
from jax_ep._types import LowLatencyDispatchOutput, LowLatencyHandle
from jax_ep import combine, dispatch


def _capacity(num_ranks: int, topk_idx: jax.Array) -> int:
  t, k = topk_idx.shape
  return max(1, num_ranks * t * k)


def _grid_rows(counts: jax.Array, m: int, capacity: int) -> jax.Array:
  """[E_l, m] packed row of grid cell (l, i), `capacity` where i >= counts[l]."""
  start = jnp.cumsum(counts) - counts
  i = jnp.arange(m, dtype=jnp.int32)[None, :]
  return jnp.where(i < counts[:, None], start[:, None] + i, capacity).astype(jnp.int32)


def _check_room(counts: jax.Array, m: int, axis_name: str, carry):
  # Only repeated expert ids in one token's top-k can put more than
  # R * max_tokens rows on one expert; the reference raises the same.
  return raise_if(jnp.any(counts > m), f"jax_ep low_latency_dispatch: capacity overflow: an expert "
                  f"got {{}} rows, room for R*max_tokens={m}", jnp.max(counts, initial=0),
                  axis_name=axis_name, carry=carry)


def dispatch_via_normal(x: jax.Array, topk_idx: jax.Array, *, num_experts: int, max_tokens: int,
                        axis_name: str, fp8: bool, ue8m0: bool,
                        backend: str) -> LowLatencyDispatchOutput:
  num_ranks = ref.axis_size(axis_name)
  t, k = topk_idx.shape
  e_l = num_experts // num_ranks
  m = num_ranks * max_tokens
  cap = _capacity(num_ranks, topk_idx)
  o = dispatch(x, topk_idx, None, num_experts=num_experts, axis_name=axis_name, layout="expert",
               capacity=cap, fp8=fp8, ue8m0=ue8m0, backend=backend)
  o = o._replace(recv_x=_check_room(o.counts, m, axis_name, o.recv_x))
  rows = _grid_rows(o.counts, m, cap).reshape(-1)
  recv = jax.tree.map(lambda a: ref._take_rows(a, rows).reshape(e_l, m, *a.shape[1:]), o.recv_x)
  h = o.handle
  entry = jnp.where(h.recv_src_rank >= 0, (h.recv_src_rank * t + h.recv_src_token) * k + h.recv_src_k, -1)
  src_entry = jnp.take(entry, rows, mode="fill", fill_value=-1).reshape(e_l, m).astype(jnp.int32)
  handle = LowLatencyHandle(src_entry=src_entry, recv_count=o.counts, max_tokens=max_tokens,
                            num_experts=num_experts)
  return LowLatencyDispatchOutput(recv, o.counts, handle)


def combine_via_normal(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                       h: LowLatencyHandle, *, axis_name: str, backend: str) -> jax.Array:
  t, _ = topk_idx.shape
  _, m, d = y.shape
  cap = _capacity(ref.axis_size(axis_name), topk_idx)
  placeholder = jnp.zeros((t, 8), jnp.bfloat16)  # 16 bytes: the smallest row a dispatch moves
  # f32 is exact: the reference multiplies in f32 whatever the weights' dtype.
  o = dispatch(placeholder, topk_idx, topk_weights.astype(jnp.float32), num_experts=h.num_experts,
               axis_name=axis_name, layout="expert", capacity=cap, backend=backend)
  packed = ref._take_rows(y.reshape(-1, d), _packed_sources(o.counts, m, cap))
  return combine(packed, o.handle, o.recv_topk_weights, axis_name=axis_name, backend=backend)


def _packed_sources(counts: jax.Array, m: int, capacity: int) -> jax.Array:
  """[capacity] grid row (l * m + i) that packed row p comes from, -1 past the
  last group: the inverse of _grid_rows. A gather of the few packed rows
  instead of a scatter over the whole [E_l, m] grid (470 MB at the low-latency
  shape of docs/design.md §6, where the scatter took ~3 ms on H200)."""
  ends = jnp.cumsum(counts)
  p = jnp.arange(capacity, dtype=jnp.int32)
  l = jnp.searchsorted(ends, p, side="right").astype(jnp.int32)
  start = jnp.take(ends - counts, jnp.minimum(l, counts.shape[0] - 1))
  return jnp.where(l < counts.shape[0], l * m + (p - start), -1).astype(jnp.int32)
