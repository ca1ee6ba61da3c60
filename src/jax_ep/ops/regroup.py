"""Rank-layout rows <-> rows grouped by local expert, on one rank (no communication).

A MoE layer can dispatch in rank layout (one row per (source rank, token)),
run its experts on rows grouped by local expert (`expert_rows`, the same
rows, order and padding as an expert-layout dispatch), sum each row's expert
outputs here (`sum_expert_rows`) and combine in rank layout. At EP >= 2 that
combine sends one row per (token, rank) over the link, where an
expert-layout combine sends one per (token, expert): K / R times fewer bytes
(docs/design.md §2, "Rank-layout combine in a layer"). The price is the
rounding of the per-rank partial sums (in `out_dtype`) before the combine
adds the ranks, the same on every backend.

Both maps are gathers with sums in a fixed order (the top-k slot), each the
other's transpose, so the gradients are deterministic (XLA's scatter-add on
GPU adds in no fixed order).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertGrouping(NamedTuple):
  """Where each (row, slot) entry of a rank-layout receive sits when grouped
  by local expert. slot [C, K]: its grouped row (-1: no expert here);
  source [M]: the rank-layout row of grouped row m (-1: padding);
  entry [M]: its flat entry row * K + k (-1: padding); counts [E_l]: the
  groups' sizes padded to `expert_alignment` (what grouped_matmul reads)."""
  slot: jax.Array
  source: jax.Array
  entry: jax.Array
  counts: jax.Array


def group_by_expert(local_ids: jax.Array, *, num_local_experts: int,
                    expert_alignment: int = 1) -> ExpertGrouping:
  """The grouping of a rank-layout dispatch's `recv_topk_idx` ([C, K] local
  expert ids, -1 elsewhere): groups by expert, each ordered by row (source
  rank, then token), padded to `expert_alignment`, in the worst case's
  C * min(K, E_l) rows plus the padding (so nothing is ever dropped)."""
  c, k = local_ids.shape
  e_l, align = num_local_experts, expert_alignment
  m = c * min(k, e_l) + e_l * (align - 1)
  ids = local_ids.reshape(-1)
  valid = (ids >= 0) & (ids < e_l)
  key = jnp.where(valid, ids, e_l)
  order = jnp.argsort(key, stable=True)                     # entries by (expert, row, k)
  sizes = jnp.zeros((e_l + 1,), jnp.int32).at[key].add(1)[:e_l]  # integer adds: exact
  padded = (sizes + align - 1) // align * align
  group_off = jnp.cumsum(padded) - padded                   # padded group starts
  first = jnp.cumsum(sizes) - sizes                         # group starts in `order`
  g = key[order]
  ok = g < e_l
  gi = jnp.minimum(g, e_l - 1)
  dest = jnp.where(ok, group_off[gi] + jnp.arange(c * k) - first[gi], -1)  # < m
  slot = jnp.full((c * k,), -1, jnp.int32).at[order].set(dest.astype(jnp.int32))
  at = jnp.where(dest >= 0, dest, m)                        # no expert: not written
  entry = jnp.full((m,), -1, jnp.int32).at[at].set(order.astype(jnp.int32), mode="drop")
  source = jnp.where(entry >= 0, entry // k, -1)
  return ExpertGrouping(slot.reshape(c, k), source, entry, padded)


def _gather_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
  """x[rows] with zeros where rows < 0."""
  if x.shape[0] == 0:  # no tokens anywhere: every row is padding (jnp.take refuses an empty axis)
    return jnp.zeros((rows.shape[0], *x.shape[1:]), x.dtype)
  got = jnp.take(x, jnp.maximum(rows, 0), axis=0)
  return jnp.where((rows >= 0)[:, None], got, jnp.zeros((), x.dtype))


@jax.custom_vjp
def expert_rows(x: jax.Array, grouping: ExpertGrouping) -> jax.Array:
  """[C, H] rank-layout rows -> [M, H] rows grouped by local expert (a row
  copied once per local expert it chose; padding rows zero)."""
  return _gather_rows(x, grouping.source)


def _expert_rows_fwd(x, grouping):
  return expert_rows(x, grouping), grouping


def _expert_rows_bwd(grouping, ct):
  # Each rank-layout row gets the sum of its copies' cotangents, slot by
  # slot in top-k order (f32): sum_expert_rows with unit weights (exact).
  ones = jnp.ones(grouping.slot.shape, jnp.float32)
  return _sum_expert_rows(ct, grouping, ones, ct.dtype), None


expert_rows.defvjp(_expert_rows_fwd, _expert_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sum_expert_rows(y: jax.Array, grouping: ExpertGrouping, weights: jax.Array,
                    out_dtype=None) -> jax.Array:
  """[M, H] expert outputs -> [C, H]: each rank-layout row's weighted sum of
  its experts' outputs (weights [C, K], the dispatch's recv_topk_weights), in
  f32 in top-k order, cast to `out_dtype` (default y's)."""
  return _sum_expert_rows(y, grouping, weights, out_dtype)


def _sum_expert_rows(y, grouping, weights, out_dtype):
  acc = None
  for i in range(grouping.slot.shape[1]):
    s = grouping.slot[:, i]
    w = jnp.where(s >= 0, weights[:, i], 0.0).astype(jnp.float32)
    term = _gather_rows(y, s).astype(jnp.float32) * w[:, None]
    acc = term if acc is None else acc + term
  return acc.astype(out_dtype or y.dtype)


def _sum_fwd(y, grouping, weights, out_dtype):
  return _sum_expert_rows(y, grouping, weights, out_dtype), (y, grouping, weights)


def _sum_bwd(out_dtype, res, ct):
  y, grouping, weights = res
  ct32 = ct.astype(jnp.float32)
  # Grouped row m came from entry (r, k): dy[m] = w[r, k] * ct[r].
  w_entry = jnp.where(grouping.entry >= 0, weights.reshape(-1)[jnp.maximum(grouping.entry, 0)], 0.0)
  dy = (_gather_rows(ct32, grouping.source) * w_entry[:, None].astype(jnp.float32)).astype(y.dtype)
  dw = jnp.stack([jnp.sum(_gather_rows(y, grouping.slot[:, i]).astype(jnp.float32) * ct32, axis=-1)
                  for i in range(grouping.slot.shape[1])], axis=1)
  return dy, None, dw.astype(weights.dtype)


sum_expert_rows.defvjp(_sum_fwd, _sum_bwd)
