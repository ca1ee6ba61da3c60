"""Pure-JAX implementations of every jax_ep op: the test oracle and the
CPU/TPU path.

All functions run inside `shard_map` over the EP axis and see one rank's
shard. They move data with `all_gather` / `all_to_all` and place rows with
sorts and gathers (no Python loops over tokens), in exactly the row order of
docs/design.md §2, so the CUDA kernels can be checked against them bitwise.

Combine-like reductions accumulate in float32 as `acc = acc + w * y`, one
product and one add per row, in the fixed order: ascending rank of the row,
then local expert, then top-k slot, starting from -0.0 (tokens with no rows
give +0.0). On GPU, XLA keeps the product and the add apart, as the kernels do
(bitwise-checked); XLA:CPU may contract them into one fused multiply-add.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import fp8 as _fp8
from jax_ep._checks import is_fp8_pair, raise_if
from jax_ep._types import (DispatchHandle, DispatchOutput, Layout, LowLatencyDispatchOutput,
                           LowLatencyHandle, Pending)

Array = jax.Array


# ---------------------------------------------------------------- helpers

def axis_size(axis_name: str) -> int:
  """Ranks on the EP axis. Outside shard_map (or with a wrong axis name)
  jax's bare `NameError: unbound axis name` becomes a ValueError that says
  what to do."""
  try:
    if hasattr(lax, "axis_size"):
      return lax.axis_size(axis_name)
    return lax.psum(1, axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here: jax_ep ops run per rank inside shard_map "
        f"over the expert-parallel mesh axis, e.g. jax_ep.shard_map(f, mesh, "
        f"axis_name={axis_name!r}) or jax.shard_map(f, mesh=mesh, ...), and axis_name must "
        f"name that axis ({e})") from e


def _moved(move, x: Array, *args) -> Array:
  """move(x, *args) for a pure data movement (gather, all-gather,
  all-to-all): FP8 and bf16 travel as their bits. XLA:CPU computes bf16
  collectives and selects through f32, which rewrites NaN payloads (quiet,
  canonical); dispatch moves payloads bit for bit."""
  if x.dtype == _fp8.FP8_DTYPE:  # forward-only: nothing differentiates through FP8
    return lax.bitcast_convert_type(move(lax.bitcast_convert_type(x, jnp.uint8), *args), x.dtype)
  if x.dtype == jnp.bfloat16:
    return _bits_moved(move, x, *args)
  return move(x, *args)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _bits_moved(move, x: Array, *args) -> Array:
  """move on x's bits (16-bit floats); tangents move as values."""
  return lax.bitcast_convert_type(move(lax.bitcast_convert_type(x, jnp.uint16), *args), x.dtype)


@_bits_moved.defjvp
def _bits_moved_jvp(move, primals, tangents):
  x, *args = primals
  return _bits_moved(move, x, *args), move(tangents[0], *args)


def _take_fill(a: Array, rows: Array) -> Array:
  return jnp.take(a, rows, axis=0, mode="fill", fill_value=0)


def _gather(x: Array, axis_name: str) -> Array:
  """[...] on every rank -> [R, ...]; FP8 and bf16 travel as bits."""
  return _moved(functools.partial(lax.all_gather, axis_name=axis_name), x)


def _exchange(x: Array, axis_name: str) -> Array:
  """x[j] goes to rank j; returns out[j] = x_j[this rank]."""
  return _moved(functools.partial(lax.all_to_all, axis_name=axis_name, split_axis=0,
                                  concat_axis=0), x)


def _take_rows(table: Array, rows: Array) -> Array:
  """table[rows] with rows outside [0, len) (padding, -1) giving zeros."""
  if table.shape[0] == 0:  # jnp.take refuses an empty axis; every row is padding
    return jnp.zeros(rows.shape + table.shape[1:], table.dtype)
  # jnp.take wraps negative indices even with mode="fill": move them past the end.
  rows = jnp.where(rows < 0, table.shape[0], rows)
  return _moved(_take_fill, table, rows)


def _map_payload(fn, x: Any) -> Any:
  return tuple(fn(a) for a in x) if is_fp8_pair(x) else fn(x)


def _valid_ids(topk_idx: Array, num_experts: int) -> Array:
  return (topk_idx >= 0) & (topk_idx < num_experts)


def _check_ids(op: str, topk_idx: Array, num_experts: int, axis_name: str, carry: Any) -> Any:
  """`carry` (the op's payload), checked: a run-time error naming the bad
  ids if any is outside [-1, num_experts)."""
  return _check_range(op, "expert id", "topk_idx", topk_idx, num_experts, axis_name, carry)


def _check_range(op: str, what: str, name: str, values: Array, limit: int, axis_name: str,
                 carry: Any) -> Any:
  """`carry`, checked: a run-time error when a value is outside [-1, limit),
  naming the smallest and largest such value over the ranks."""
  bad = (values < -1) | (values >= limit)
  big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
  lo = jnp.min(jnp.where(bad, values, big), initial=big)
  hi = jnp.max(jnp.where(bad, values, small), initial=small)
  return raise_if(jnp.any(bad), functools.partial(_range_text, op, what, name, limit), lo, hi,
                  axis_name=axis_name, carry=carry, reduce=("min", "max"))


def _range_text(op: str, what: str, name: str, limit: int, lo: int, hi: int) -> str:
  got = f"{lo}" if lo == hi else f"{lo} and {hi}" if lo < -1 < limit <= hi else f"{lo} .. {hi}"
  return f"jax_ep {op}: {what} outside [-1, {limit}) in {name} (got {got}; -1 means none)"


def _rank_of(topk_idx: Array, num_experts: int, num_ranks: int) -> Array:
  """Destination rank of every (t, k); -1 where the id is -1 or invalid."""
  e_l = num_experts // num_ranks
  return jnp.where(_valid_ids(topk_idx, num_experts), topk_idx // e_l, -1)


def _ordered_sum(products: list[tuple[Array, Array]], shape, dtype) -> Array:
  """acc = -0.0; acc = acc + p for (mask, p) in order, p already float32.

  -0.0 is the exact additive identity (XLA folds `0 + p` into `p`, which
  differs for p = -0.0, so start from the identity that folding preserves);
  tokens with no rows give +0.0.
  """
  acc = jnp.full(shape, -0.0, jnp.float32)
  seen = jnp.zeros(shape[:1] + (1,), bool)
  for mask, p in products:
    acc = jnp.where(mask, acc + p, acc)
    seen = seen | mask
  return jnp.where(seen, acc, 0.0).astype(dtype)


def _weighted(y: Array, w: Optional[Array]) -> Array:
  y = y.astype(jnp.float32)
  return y if w is None else w.astype(jnp.float32)[..., None] * y


# ---------------------------------------------------------------- layout

def get_dispatch_layout(topk_idx: Array, *, num_experts: int, axis_name: str) -> Layout:
  layout, _ = _layout(topk_idx, num_experts, axis_size(axis_name))
  return layout


def _layout(topk_idx: Array, num_experts: int, num_ranks: int) -> tuple[Layout, Array]:
  """Layout plus pos_in_rank [T, R]."""
  dest = _rank_of(topk_idx, num_experts, num_ranks)
  in_rank = jnp.any(dest[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1)
  per_rank = jnp.sum(in_rank, axis=0, dtype=jnp.int32)
  valid = _valid_ids(topk_idx, num_experts)
  per_expert = jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, topk_idx, num_experts)].add(
      1, mode="drop")
  pos = jnp.where(in_rank, jnp.cumsum(in_rank, axis=0, dtype=jnp.int32) - 1, -1)
  return Layout(per_rank, per_expert, in_rank), pos


# ---------------------------------------------------------------- dispatch

def default_capacity(*, layout: str, num_tokens: int, num_ranks: int, topk: int,
                     num_experts: int, expert_alignment: int = 1) -> int:
  """Worst-case received rows for one rank (docs/design.md §2: C defaults to it)."""
  if layout == "rank":
    return num_ranks * num_tokens
  e_l = num_experts // num_ranks
  return num_ranks * num_tokens * min(topk, e_l) + e_l * (expert_alignment - 1)


def dispatch(x: Any, topk_idx: Array, topk_weights: Optional[Array], *, num_experts: int,
             axis_name: str, layout: str = "rank", capacity: int, expert_alignment: int = 1,
             fp8: bool = False, ue8m0: bool = False,
             handle: Optional[DispatchHandle] = None) -> DispatchOutput:
  """Reference dispatch (arguments already validated by `jax_ep.ops`)."""
  num_ranks = axis_size(axis_name)
  if fp8:
    x = _fp8.quantize(x, ue8m0=ue8m0)
  if handle is None:
    x = _check_ids("dispatch", topk_idx, num_experts, axis_name, x)
    handle, x = _route(x, topk_idx, num_experts=num_experts, num_ranks=num_ranks, layout=layout,
                    capacity=capacity, expert_alignment=expert_alignment, axis_name=axis_name)
  return _move(x, topk_idx, topk_weights, handle, axis_name)


def _route(x: Any, topk_idx: Array, *, num_experts: int, num_ranks: int, layout: str, capacity: int,
           expert_alignment: int, axis_name: str) -> tuple[DispatchHandle, Any]:
  """Where every received row comes from, in docs/design.md §2 order, and
  the payload x that carries the capacity check."""
  t, k = topk_idx.shape
  r = lax.axis_index(axis_name)
  e_l = num_experts // num_ranks
  _, pos = _layout(topk_idx, num_experts, num_ranks)
  dest_all = _rank_of(_gather(topk_idx, axis_name), num_experts, num_ranks)  # [R, T, K]
  here = dest_all == r
  if layout == "rank":
    row_mask = jnp.any(here, axis=2).reshape(-1)                      # (s, t) order
    total = jnp.sum(row_mask, dtype=jnp.int32)
    (src,) = jnp.nonzero(row_mask, size=capacity, fill_value=-1)
    rows_valid = jnp.arange(capacity) < total
    src = jnp.where(rows_valid, src, -1).astype(jnp.int32)
    src_rank, src_token = _split_src(src, t)
    src_k = jnp.full((capacity,), -1, jnp.int32)
    recv_counts = jnp.sum(jnp.any(here, axis=2), axis=1, dtype=jnp.int32)
  else:
    n = num_ranks * t * k
    local = (_gather(topk_idx, axis_name) - r * e_l).reshape(-1)
    mask = here.reshape(-1)
    sizes, i, gl = _group_entries(jnp.where(mask, local, e_l), e_l)
    padded = (sizes + expert_alignment - 1) // expert_alignment * expert_alignment
    start = jnp.cumsum(padded) - padded                              # padded group starts
    row = jnp.where(mask, start[gl] + i, capacity)
    total = jnp.sum(padded)
    entry = jnp.full((capacity,), -1, jnp.int32).at[row].set(jnp.arange(n, dtype=jnp.int32),
                                                            mode="drop")
    src_rank, src_token = _split_src(jnp.where(entry >= 0, entry // max(k, 1), -1), t)
    src_k = jnp.where(entry >= 0, entry % max(k, 1), -1)
    recv_counts = jnp.sum(here, axis=(1, 2), dtype=jnp.int32)
  x = raise_if(total > capacity, f"jax_ep dispatch: capacity overflow: {{}} rows needed, "
               f"capacity={capacity} (raise `capacity` or leave it None for the worst case)",
               total, axis_name=axis_name, carry=x)
  return DispatchHandle(topk_idx=topk_idx, pos_in_rank=pos, recv_src_rank=src_rank,
                        recv_src_token=src_token, recv_src_k=src_k, recv_counts=recv_counts,
                        layout=layout, num_experts=num_experts, capacity=capacity,
                        expert_alignment=expert_alignment), x


def _group_entries(group: Array, num_groups: int) -> tuple[Array, Array, Array]:
  """Groups flat (source rank, token, k) entries by local expert.

  group: [N] in [0, num_groups], num_groups meaning "not here". Returns the
  group sizes [num_groups], each entry's index inside its group (entries keep
  their flat order) and its group clipped to a valid index (for gathers).
  """
  n = group.shape[0]
  sizes = jnp.zeros((num_groups + 1,), jnp.int32).at[group].add(1)[:num_groups]
  ustart = jnp.cumsum(sizes) - sizes
  order = jnp.argsort(group, stable=True)
  pos = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
  gl = jnp.minimum(group, num_groups - 1)
  return sizes, pos - ustart[gl], gl


def _split_src(src: Array, t: int) -> tuple[Array, Array]:
  tt = max(t, 1)
  return (jnp.where(src >= 0, src // tt, -1).astype(jnp.int32),
          jnp.where(src >= 0, src % tt, -1).astype(jnp.int32))


def _move(x: Any, topk_idx: Array, topk_weights: Optional[Array], h: DispatchHandle,
          axis_name: str) -> DispatchOutput:
  """Moves payload and weights along a routing (also the cached dispatch)."""
  num_ranks = axis_size(axis_name)
  r = lax.axis_index(axis_name)
  e_l = h.num_experts // num_ranks
  t = topk_idx.shape[0]
  valid = h.recv_src_rank >= 0
  flat = jnp.where(valid, h.recv_src_rank * t + h.recv_src_token, -1)
  recv_x = _map_payload(lambda a: _take_rows(_gather(a, axis_name).reshape(-1, *a.shape[1:]), flat),
                        x)
  idx_rows = _take_rows(_gather(topk_idx, axis_name).reshape(-1, topk_idx.shape[1]), flat)
  w_rows = None
  if topk_weights is not None:
    w_rows = _take_rows(_gather(topk_weights, axis_name).reshape(-1, topk_weights.shape[1]), flat)
  if h.layout == "rank":
    here = valid[:, None] & (_rank_of(idx_rows, h.num_experts, num_ranks) == r)
    recv_idx = jnp.where(here, idx_rows - r * e_l, -1).astype(jnp.int32)
    recv_w = None if w_rows is None else jnp.where(here, w_rows, 0).astype(w_rows.dtype)
    counts = h.recv_counts
  else:
    kk = jnp.maximum(h.recv_src_k, 0)[:, None]
    ids = jnp.take_along_axis(idx_rows, kk, axis=1)[:, 0]
    recv_idx = jnp.where(valid, ids - r * e_l, -1).astype(jnp.int32)
    recv_w = None
    if w_rows is not None:
      recv_w = jnp.where(valid, jnp.take_along_axis(w_rows, kk, axis=1)[:, 0], 0).astype(w_rows.dtype)
    sizes = jnp.zeros((e_l + 1,), jnp.int32).at[jnp.where(valid, recv_idx, e_l)].add(1)[:e_l]
    a = h.expert_alignment
    counts = (sizes + a - 1) // a * a
  return DispatchOutput(recv_x, recv_idx, recv_w, counts, h)


# ---------------------------------------------------------------- combine

def _return_rows(v: Array, h: DispatchHandle, axis_name: str) -> Array:
  """Sends per-row values back to their source tokens.

  v [C, ...] -> [R, T, ...] (rank layout: [j, t] = value of the row from t on
  rank j) or [T, K, ...] (expert layout: [t, k] = value of the row from (t, k)).
  """
  num_ranks = axis_size(axis_name)
  t, k = h.topk_idx.shape
  valid = h.recv_src_rank >= 0
  if h.layout == "rank":
    slot = jnp.where(valid, h.recv_src_rank * t + h.recv_src_token, num_ranks * t)
    back = jnp.zeros((num_ranks * t, *v.shape[1:]), v.dtype).at[slot].set(v, mode="drop")
    return _exchange(back.reshape(num_ranks, t, *v.shape[1:]), axis_name)
  slot = jnp.where(valid, (h.recv_src_rank * t + h.recv_src_token) * k + h.recv_src_k,
                   num_ranks * t * k)
  back = jnp.zeros((num_ranks * t * k, *v.shape[1:]), v.dtype).at[slot].set(v, mode="drop")
  got = _exchange(back.reshape(num_ranks, t, k, *v.shape[1:]), axis_name)  # [j, t, k, ...]
  dest = jnp.maximum(_rank_of(h.topk_idx, h.num_experts, num_ranks), 0)
  sel = dest.reshape(1, t, k, *([1] * (v.ndim - 1)))
  return jnp.take_along_axis(got, sel, axis=0)[0]


def _expert_order(topk_idx: Array, num_experts: int) -> Array:
  """Per token, top-k slots sorted by expert id (= rank, then local expert); invalid last."""
  key = jnp.where(_valid_ids(topk_idx, num_experts), topk_idx, num_experts)
  return jnp.argsort(key, axis=1, stable=True)


def combine(y: Array, h: DispatchHandle, weights: Optional[Array], *, axis_name: str) -> Array:
  """out[t] = sum of w_row * y[row] over rows from t, float32, fixed order."""
  num_ranks = axis_size(axis_name)
  t, k = h.topk_idx.shape
  ys = _return_rows(y, h, axis_name)
  ws = None if weights is None else _return_rows(weights, h, axis_name)
  if h.layout == "rank":
    in_rank = h.pos_in_rank >= 0                                        # [T, R]
    terms = [(in_rank[:, j:j + 1], _weighted(ys[j], None if ws is None else ws[j]))
             for j in range(num_ranks)]
  else:
    order = _expert_order(h.topk_idx, h.num_experts)
    valid = _valid_ids(h.topk_idx, h.num_experts)
    terms = []
    for i in range(k):
      kk = order[:, i:i + 1]
      yi = jnp.take_along_axis(ys, kk[:, :, None], axis=1)[:, 0]
      wi = None if ws is None else jnp.take_along_axis(ws, kk, axis=1)[:, 0]
      terms.append((jnp.take_along_axis(valid, kk, axis=1), _weighted(yi, wi)))
  return _ordered_sum(terms, (t, y.shape[1]), y.dtype)


def return_row_weights(dw: Array, h: DispatchHandle, axis_name: str) -> Array:
  """Cotangent of the received weights -> cotangent of topk_weights [T, K]."""
  num_ranks = axis_size(axis_name)
  if h.layout == "rank":
    back = _return_rows(dw, h, axis_name)                               # [R, T, K]
    dest = jnp.maximum(_rank_of(h.topk_idx, h.num_experts, num_ranks), 0)
    out = jnp.take_along_axis(back, dest[None], axis=0)[0]
  else:
    out = _return_rows(dw, h, axis_name)                                # [T, K]
  return jnp.where(_valid_ids(h.topk_idx, h.num_experts), out, 0).astype(dw.dtype)


# ---------------------------------------------------------------- low latency

def low_latency_dispatch_start(x: Array, topk_idx: Array, *, num_experts: int, max_tokens: int,
                               axis_name: str, fp8: bool = False, ue8m0: bool = False):
  if fp8:
    x = _fp8.quantize(x, ue8m0=ue8m0)
  x = _check_ids("low_latency_dispatch", topk_idx, num_experts, axis_name, x)
  return Pending((_map_payload(lambda a: _gather(a, axis_name), x), _gather(topk_idx, axis_name)),
                 op="low_latency_dispatch", axis_name=axis_name, num_experts=num_experts,
                 max_tokens=max_tokens)


def low_latency_dispatch_done(pending: Pending) -> LowLatencyDispatchOutput:
  xs, idx_all = pending.arrays
  num_experts, max_tokens, axis_name = pending.num_experts, pending.max_tokens, pending.axis_name
  num_ranks, t, k = idx_all.shape
  r = lax.axis_index(axis_name)
  e_l = num_experts // num_ranks
  m = num_ranks * max_tokens
  n = num_ranks * t * k
  flat_idx = idx_all.reshape(-1)
  mask = _valid_ids(flat_idx, num_experts) & (flat_idx // e_l == r)
  sizes, i, gl = _group_entries(jnp.where(mask, flat_idx - r * e_l, e_l), e_l)
  slot = jnp.where(mask & (i < m), gl * m + i, e_l * m)
  entry = jnp.full((e_l * m,), -1, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32),
                                                          mode="drop")
  xs = raise_if(jnp.any(sizes > m), f"jax_ep low_latency_dispatch: capacity overflow: an expert "
                f"got {{}} rows, room for R*max_tokens={m}", jnp.max(sizes, initial=0),
                axis_name=axis_name, carry=xs)
  tok = jnp.where(entry >= 0, entry // max(k, 1), -1)                  # flat (s, t)

  def place(a):
    return _take_rows(a.reshape(-1, *a.shape[2:]), tok).reshape(e_l, m, *a.shape[2:])

  recv = _map_payload(place, xs)
  h = LowLatencyHandle(src_entry=entry.reshape(e_l, m), recv_count=sizes, max_tokens=max_tokens,
                       num_experts=num_experts)
  return LowLatencyDispatchOutput(recv, sizes, h)


def low_latency_combine_start(y: Array, topk_idx: Array, topk_weights: Array, h: LowLatencyHandle,
                              *, axis_name: str):
  num_ranks = axis_size(axis_name)
  t, k = topk_idx.shape
  e_l, m, d = y.shape
  entry = h.src_entry.reshape(-1)
  slot = jnp.where(entry >= 0, entry, num_ranks * t * k)
  back = jnp.zeros((num_ranks * t * k, d), y.dtype).at[slot].set(y.reshape(-1, d), mode="drop")
  return Pending((_exchange(back.reshape(num_ranks, t, k, d), axis_name), topk_idx, topk_weights),
                 op="low_latency_combine", axis_name=axis_name, num_experts=h.num_experts)


def low_latency_combine_done(pending: Pending) -> Array:
  got, topk_idx, topk_weights = pending.arrays
  num_experts = pending.num_experts
  num_ranks = got.shape[0]
  t, k = topk_idx.shape
  dest = jnp.maximum(_rank_of(topk_idx, num_experts, num_ranks), 0)
  ys = jnp.take_along_axis(got, dest[None, :, :, None], axis=0)[0]     # [T, K, H]
  order = _expert_order(topk_idx, num_experts)
  valid = _valid_ids(topk_idx, num_experts)
  terms = []
  for i in range(k):
    kk = order[:, i:i + 1]
    yi = jnp.take_along_axis(ys, kk[:, :, None], axis=1)[:, 0]
    wi = jnp.take_along_axis(topk_weights, kk, axis=1)[:, 0]
    terms.append((jnp.take_along_axis(valid, kk, axis=1), _weighted(yi, wi)))
  return _ordered_sum(terms, (t, got.shape[-1]), got.dtype)


# ---------------------------------------------------------------- engram

def engram_fetch_start(table: Array, indices: Array, *, axis_name: str,
                       scales: Optional[Array] = None):
  """Request/response: every rank answers the rows it owns for everyone."""
  num_ranks = axis_size(axis_name)
  r = lax.axis_index(axis_name)
  v_l = table.shape[0]
  v = v_l * num_ranks
  table = _check_range("engram_fetch", "row index", "indices", indices, v, axis_name, table)
  req = _gather(indices, axis_name)                                     # [R, T, e]
  mine = (req >= 0) & (req // v_l == r)
  resp = _take_rows(table, jnp.where(mine, req - r * v_l, v_l).reshape(-1))
  resp = resp.reshape(*req.shape, table.shape[1])
  return Pending((_exchange(resp, axis_name), indices, scales), op="engram_fetch",
                 axis_name=axis_name, rows_per_rank=v_l)


def engram_fetch_wait(pending: Pending) -> Any:
  got, indices, scales = pending.arrays
  v_l = pending.rows_per_rank
  owner = jnp.where(indices >= 0, indices // v_l, 0)
  rows = jnp.take_along_axis(got, owner[None, :, :, None], axis=0)[0]  # [T, e, D]
  if scales is None:
    return rows
  return rows, engram_row_scales(indices, scales)


def engram_row_scales(indices: Array, scales: Array) -> Array:
  """FP8 tables: the replicated per-row scales of the fetched rows; 0 for -1."""
  return jnp.where(indices >= 0, scales[jnp.maximum(indices, 0)], 0).astype(scales.dtype)


def engram_grad_entries(d_rows: Array, indices: Array, v_l: int, *,
                        axis_name: str) -> tuple[Array, Array]:
  """What this owner must sum: every rank's (local row, f32 cotangent)
  entries in (source rank, token, slot) order, [R*T*e] and [R*T*e, D]; rows
  that are not this owner's are v_l."""
  r = lax.axis_index(axis_name)
  req = _gather(indices, axis_name).reshape(-1)
  d = _gather(d_rows.astype(jnp.float32), axis_name).reshape(req.shape[0], -1)
  mine = (req >= 0) & (req // v_l == r)
  return jnp.where(mine, req - r * v_l, v_l).astype(jnp.int32), d


def engram_table_grad(d_rows: Array, indices: Array, v_l: int, dtype, *, axis_name: str) -> Array:
  """Row cotangents [T, e, D] -> cotangent of the local table shard [V/R, D].

  Each owner sums, in float32 and in (source rank, token, slot) order, the
  cotangents of the rows it served (XLA's scatter keeps that order on CPU;
  on GPU it adds with atomics, in no fixed order: the CUDA backend's kernel,
  jax_ep.ops.engram _shard_grad, keeps it there).
  """
  rows, d = engram_grad_entries(d_rows, indices, v_l, axis_name=axis_name)
  g = jnp.zeros((v_l, d.shape[1]), jnp.float32).at[rows].add(d, mode="drop")
  return g.astype(dtype)
