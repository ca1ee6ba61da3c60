"""Normal (high-throughput) `dispatch` and `combine`, with exact transposes.

dispatch' = combine of the row cotangents with unit weights, plus the weight
cotangents routed back to `topk_weights`; combine' = cached dispatch of the
output cotangent scaled by the row weights, plus dw_row = <dout[t], y[row]>.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import fp8 as _fp8
from jax_ep import reference as ref
from jax_ep._checks import (check_positive, check_recv_sms, check_routing, check_sms, check_x,
                            is_fp8_pair, note_origin, origin_of, raise_if)
from jax_ep._ffi import dispatch as ffi
from jax_ep._types import DispatchHandle, DispatchOutput
from jax_ep.ops import _backend

LAYOUTS = ("rank", "expert")


@dataclasses.dataclass(frozen=True)
class _Cfg:
  num_experts: int
  axis_name: str
  layout: str
  capacity: int
  expert_alignment: int
  fp8: bool
  ue8m0: bool
  backend: Optional[str]
  start: bool = False  # on the communicator's side stream (jax_ep.ops.overlap)
  num_sms: int = 0     # CUDA: at most this many SMs, 0 = the bandwidth model's count
  recv_sms: int = 0    # CUDA: of them receiving / reducing, 0 = the model's share


def dispatch(x: Any, topk_idx: jax.Array, topk_weights: Optional[jax.Array] = None, *,
             num_experts: int, axis_name: str = "ep", layout: str = "rank",
             capacity: Optional[int] = None, expert_alignment: int = 1, fp8: bool = False,
             ue8m0: bool = False, handle: Optional[DispatchHandle] = None,
             num_sms: Optional[int] = 0, recv_sms: Optional[int] = 0,
             backend: Optional[str] = None) -> DispatchOutput:
  """Sends each token to the ranks (rank layout) or experts (expert layout) it chose.

  Runs inside `shard_map` over `axis_name` (R ranks, E_l = E / R local experts).

  Args:
    x: [T, H] bf16/f16/f32, or an FP8 pair (q [T, H] float8_e4m3fn,
      scales [T, H / 128] f32).
    topk_idx: [T, K] int32 expert ids in [-1, E); -1 means none.
    topk_weights: [T, K] float weights, or None.
    layout: "rank": one row per (source rank, token) with an expert here;
      "expert": one row per (source token, local expert), grouped by expert,
      each group padded to `expert_alignment` (the `ragged_dot` layout).
    capacity: rows C of the outputs; None = the worst case. Overflow raises.
    fp8: cast a bf16/f16/f32 `x` to FP8 (per token, per 128 channels) first;
      `ue8m0` rounds the scales up to powers of two.
    handle: from an earlier dispatch with the same routing: skip the layout
      work (cached dispatch); `capacity`/`layout` come from the handle.
    num_sms, recv_sms: CUDA kernels only (static): at most num_sms SMs (one
      CTA each), recv_sms of them receiving; 0 (or None) = the bandwidth
      model's choice (24 at most; every SM at one rank, where nothing crosses
      a link, except in the *_start forms, which run beside compute).
      The reference ignores them.
  Returns:
    DispatchOutput(recv_x, recv_topk_idx, recv_topk_weights, counts, handle);
    see `jax_ep.DispatchOutput` for the shapes of each layout.
  """
  cfg, num_ranks, t = _dispatch_cfg(x, topk_idx, topk_weights, num_experts=num_experts,
                                    axis_name=axis_name, layout=layout, capacity=capacity,
                                    expert_alignment=expert_alignment, fp8=fp8, ue8m0=ue8m0,
                                    handle=handle, backend=backend)
  cfg = dataclasses.replace(cfg, **_sms(num_sms, recv_sms))
  if t == 0:
    return _remember(_empty_dispatch(cfg, x, topk_idx, topk_weights, num_ranks))
  if handle is not None:
    x = _check_same_routing(x, topk_idx, handle, axis_name)
  if fp8 or is_fp8_pair(x):
    # FP8 payloads are forward-only: nothing flows back into x through them.
    x = jax.tree.map(jax.lax.stop_gradient, x)
    return _remember(_dispatch_impl(cfg, x, topk_idx, topk_weights, handle))
  return _remember(_dispatch_vjp(cfg, x, topk_idx, topk_weights, handle))


def _remember(out: DispatchOutput) -> DispatchOutput:
  """out, its arrays noted as this dispatch's (see _check_same_dispatch)."""
  origin = id(out.handle.recv_src_rank)
  for a in (out.recv_x, out.recv_topk_weights, out.counts, out.handle.recv_src_rank):
    note_origin(a, origin)
  return out


def _check_same_dispatch(handle: DispatchHandle, y, weights) -> None:
  """ValueError when y or weights is known to come from another dispatch
  than handle (by object identity: free, and silent where unknown)."""
  h_from = origin_of(handle.recv_src_rank)
  if h_from is None:
    return
  for name, a in (("y", y), ("weights", weights)):
    a_from = None if a is None else origin_of(a)
    if a_from is not None and a_from != h_from:
      raise ValueError(f"handle and {name} come from two different dispatches: {name} holds "
                       "the rows of one, handle is the handle of another; pass the handle of "
                       "the dispatch whose rows y holds (combine(y, out.handle, "
                       "out.recv_topk_weights))")


def _dispatch_cfg(x, topk_idx, topk_weights, *, num_experts, axis_name, layout, capacity,
                  expert_alignment, fp8, ue8m0, handle, backend) -> tuple[_Cfg, int, int]:
  """The checked configuration of a dispatch: (cfg, R, T); raises ValueError
  naming the bad argument."""
  num_ranks = ref.axis_size(axis_name)
  _backend.check_backend(backend)
  t, _ = check_x(x, fp8=fp8)
  k = check_routing(topk_idx, topk_weights, num_tokens=t, num_experts=num_experts,
                    num_ranks=num_ranks)
  if handle is not None:
    if not isinstance(handle, DispatchHandle):
      raise ValueError(f"handle must be a DispatchHandle from dispatch, got {type(handle).__name__}")
    if handle.num_experts != num_experts or handle.topk_idx.shape != topk_idx.shape:
      raise ValueError("handle was made for another routing (num_experts or topk_idx shape differ)")
    layout, capacity, expert_alignment = handle.layout, handle.capacity, handle.expert_alignment
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  check_positive("expert_alignment", expert_alignment)
  check_positive("capacity", capacity, allow_none=True)
  if capacity is None:
    capacity = ref.default_capacity(layout=layout, num_tokens=t, num_ranks=num_ranks, topk=k,
                                    num_experts=num_experts, expert_alignment=expert_alignment)
  cfg = _Cfg(num_experts, axis_name, layout, int(capacity), int(expert_alignment), bool(fp8),
             bool(ue8m0), backend)
  return cfg, num_ranks, t


def _check_same_routing(x, topk_idx: jax.Array, handle: DispatchHandle, axis_name: str):
  """x, checked at run time: a cached dispatch moves rows along the handle's
  routing, so a topk_idx that differs from the one that made it would get
  another routing's rows silently. Free when they are the same array (the
  combine's backward, or `handle=out.handle` with the same topk_idx)."""
  if topk_idx is handle.topk_idx:
    return x
  differ = jnp.sum(topk_idx != handle.topk_idx, dtype=jnp.int32)
  return raise_if(differ > 0, "jax_ep dispatch: handle was made for another routing: topk_idx "
                  "differs from the handle's in {} (token, k) entries on some rank; pass the "
                  "topk_idx of the dispatch that made the handle", differ, axis_name=axis_name,
                  carry=x)


def combine(y: jax.Array, handle: DispatchHandle, weights: Optional[jax.Array] = None, *,
            axis_name: str = "ep", num_sms: Optional[int] = 0,
            recv_sms: Optional[int] = 0, backend: Optional[str] = None) -> jax.Array:
  """Returns each row to its source token and sums (inside shard_map).

  out[t] = sum over rows from token t of w_row * y[row], accumulated in
  float32 in a fixed order (ascending rank of the row, then local expert, then
  top-k slot), cast to y's dtype; tokens with no rows get zeros.

  Args:
    y: [C, H] rows in the order `dispatch` produced them.
    handle: the DispatchHandle of that dispatch.
    weights: [C] per-row weights (e.g. expert layout's recv_topk_weights), or
      None for a plain sum.
    num_sms, recv_sms: as in `dispatch` (recv_sms: the reducing CTAs).
  Returns:
    [T, H] in y's dtype.
  """
  cfg = _combine_cfg(y, handle, weights, axis_name=axis_name, backend=backend)
  cfg = dataclasses.replace(cfg, **_sms(num_sms, recv_sms))
  if handle.topk_idx.shape[0] == 0:
    return jnp.zeros((0, y.shape[1]), y.dtype)
  return _combine_vjp(cfg, y, handle, weights)


def _sms(num_sms, recv_sms) -> dict:
  n = check_sms(num_sms)
  return dict(num_sms=n, recv_sms=check_recv_sms(recv_sms, n))


def _combine_cfg(y, handle, weights, *, axis_name, backend) -> _Cfg:
  """The checked configuration of a combine; raises ValueError naming the
  bad argument."""
  ref.axis_size(axis_name)  # outside shard_map: say where to call it, before any shape
  _backend.check_backend(backend)
  if not isinstance(handle, DispatchHandle):
    raise ValueError(f"handle must be a DispatchHandle from dispatch, got {type(handle).__name__}")
  _check_same_dispatch(handle, y, weights)
  c = handle.capacity
  if y.ndim != 2 or y.shape[0] != c:
    raise ValueError(f"y must be [C={c}, H] (the dispatch capacity), got shape {list(y.shape)}")
  if weights is not None and weights.shape != (c,):
    raise ValueError(f"weights must be [C={c}] per-row weights, got shape {list(weights.shape)}")
  return _Cfg(handle.num_experts, axis_name, handle.layout, c, handle.expert_alignment, False,
              False, backend)


# ------------------------------------------------------------ implementations

def _empty_dispatch(cfg: _Cfg, x, topk_idx, topk_weights, num_ranks: int) -> DispatchOutput:
  """T = 0 on every rank (T is static): nothing moves; all rows are padding.

  Built directly: XLA's sharding pass rejects some programs whose shard_map
  inputs are all empty, and there is nothing to communicate anyway.
  """
  c, k = cfg.capacity, topk_idx.shape[1]
  e_l = cfg.num_experts // num_ranks
  none = jnp.full((c,), -1, jnp.int32)
  h = DispatchHandle(topk_idx=topk_idx, pos_in_rank=jnp.zeros((0, num_ranks), jnp.int32),
                     recv_src_rank=none, recv_src_token=none, recv_src_k=none,
                     recv_counts=jnp.zeros((num_ranks,), jnp.int32), layout=cfg.layout,
                     num_experts=cfg.num_experts, capacity=c,
                     expert_alignment=cfg.expert_alignment)
  if is_fp8_pair(x) or cfg.fp8:
    h_dim = (x[0] if is_fp8_pair(x) else x).shape[1]
    recv_x = (jnp.zeros((c, h_dim), jnp.float8_e4m3fn), jnp.zeros((c, h_dim // 128), jnp.float32))
  else:
    recv_x = jnp.zeros((c, x.shape[1]), x.dtype)
  rank = cfg.layout == "rank"
  w_shape = (c, k) if rank else (c,)
  recv_w = None if topk_weights is None else jnp.zeros(w_shape, topk_weights.dtype)
  counts = jnp.zeros((num_ranks,) if rank else (e_l,), jnp.int32)
  return DispatchOutput(recv_x, jnp.full(w_shape, -1, jnp.int32), recv_w, counts, h)


def choice(cfg: _Cfg, op: str) -> _backend.Choice:
  """The backend of a normal op of `cfg` (its start and done halves too)."""
  return _backend.choose(cfg.backend, op=op, axis_name=cfg.axis_name)


def kernel_dispatch(cfg: _Cfg, comm_id: int, x, topk_idx, topk_weights, handle):
  return ffi.dispatch(x, topk_idx, topk_weights, num_experts=cfg.num_experts,
                      num_ranks=ref.axis_size(cfg.axis_name), comm_id=comm_id,
                      layout=cfg.layout, capacity=cfg.capacity,
                      expert_alignment=cfg.expert_alignment, fp8=cfg.fp8, ue8m0=cfg.ue8m0,
                      num_sms=cfg.num_sms, recv_sms=cfg.recv_sms, handle=handle,
                      start=cfg.start)


def _dispatch_impl(cfg: _Cfg, x, topk_idx, topk_weights, handle) -> DispatchOutput:
  def reference(x, topk_idx, topk_weights, handle):
    return ref.dispatch(x, topk_idx, topk_weights, num_experts=cfg.num_experts,
                        axis_name=cfg.axis_name, layout=cfg.layout, capacity=cfg.capacity,
                        expert_alignment=cfg.expert_alignment, fp8=cfg.fp8, ue8m0=cfg.ue8m0,
                        handle=handle)

  c = choice(cfg, "dispatch")
  return _backend.run(c, reference, functools.partial(kernel_dispatch, cfg, c.comm_id), x,
                      topk_idx, topk_weights, handle)


def _combine_impl(cfg: _Cfg, y, handle, weights) -> jax.Array:
  def reference(y, handle, weights):
    return ref.combine(y, handle, weights, axis_name=cfg.axis_name)

  def kernel(y, handle, weights):
    return ffi.combine(y, handle, weights, comm_id=c.comm_id, num_sms=cfg.num_sms,
                       recv_sms=cfg.recv_sms, start=cfg.start)

  c = choice(cfg, "combine")
  return _backend.run(c, reference, kernel, y, handle, weights)


# ------------------------------------------------------------ gradients

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_vjp(cfg, x, topk_idx, topk_weights, handle):
  return _dispatch_impl(cfg, x, topk_idx, topk_weights, handle)


def _dispatch_fwd(cfg, x, topk_idx, topk_weights, handle):
  out = _dispatch_impl(cfg, x, topk_idx, topk_weights, handle)
  return out, (out.handle, topk_weights is not None)


def _dispatch_bwd(cfg, res, ct):
  h, has_w = res
  dx = _combine_impl(cfg, ct.recv_x, h, None)
  dw = None
  if has_w:
    dw = ref.return_row_weights(ct.recv_topk_weights, h, cfg.axis_name)
  return dx, None, dw, None


_dispatch_vjp.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_vjp(cfg, y, handle, weights):
  return _combine_impl(cfg, y, handle, weights)


def _combine_fwd(cfg, y, handle, weights):
  return _combine_impl(cfg, y, handle, weights), (y, handle, weights)


def _combine_bwd(cfg, res, dout):
  y, h, weights = res
  rows = _cached_rows(cfg, dout, h)
  if weights is None:
    dy, dw = rows.astype(y.dtype), None
  else:
    dy = (weights.astype(jnp.float32)[:, None] * rows.astype(jnp.float32)).astype(y.dtype)
    dw = jnp.sum(rows.astype(jnp.float32) * y.astype(jnp.float32), axis=-1).astype(weights.dtype)
  return dy, None, dw


def _cached_rows(cfg: _Cfg, x, h: DispatchHandle):
  """Cached dispatch of a payload along the routing in `h`."""
  topk = h.topk_idx
  out = _dispatch_impl(dataclasses.replace(cfg, fp8=False, ue8m0=False), x, topk, None, h)
  return out.recv_x


_combine_vjp.defvjp(_combine_fwd, _combine_bwd)


@dataclasses.dataclass(frozen=True)
class _RowsCfg:
  num_experts: int
  axis_name: str
  layout: str
  expert_alignment: int
  dtype: Any
  backend: Optional[str]


def dispatch_fp8_rows(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, *,
                      num_experts: int, axis_name: str = "ep", layout: str = "expert",
                      expert_alignment: int = 1, dtype=jnp.bfloat16,
                      backend: Optional[str] = None) -> tuple[DispatchOutput, tuple]:
  """An FP8 dispatch that FP8 experts can train through.

  dispatch(fp8=True) alone passes no gradient to x (FP8 payloads are
  forward-only), which would cut every layer below off from the loss. Here
  the rows come out twice: dequantised to `dtype` in out.recv_x, carrying
  the gradient, and as the FP8 pair (q, scales) the experts read (the
  dequantised rows are then dead code). The backward is a straight-through
  estimator: the rows' cotangents go back by the bf16 combine, the exact
  transpose of a bf16 dispatch (the quantisation counts as the identity),
  and the weights' cotangents as dispatch's own. x: [T, H], H a multiple
  of 128. Returns (out, (q, scales)).
  """
  cfg = _RowsCfg(num_experts, axis_name, layout, int(expert_alignment), dtype, backend)
  return _fp8_rows(x, topk_idx, topk_weights, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_rows(x, topk_idx, topk_weights, cfg: _RowsCfg):
  return _fp8_rows_fwd(x, topk_idx, topk_weights, cfg)[0]


def _fp8_rows_fwd(x, topk_idx, topk_weights, cfg: _RowsCfg):
  kw = dict(layout="rank") if cfg.layout == "rank" else dict(
      layout="expert", expert_alignment=cfg.expert_alignment)
  out = dispatch(x, topk_idx, topk_weights, num_experts=cfg.num_experts,
                 axis_name=cfg.axis_name, fp8=True, backend=cfg.backend, **kw)
  q, scales = out.recv_x
  out = out._replace(recv_x=_fp8.dequantize(q, scales, cfg.dtype))
  return (out, (q, scales)), out.handle


def _fp8_rows_bwd(cfg: _RowsCfg, handle, cts):
  ct = cts[0]
  dx = combine(ct.recv_x.astype(cfg.dtype), handle, None, axis_name=cfg.axis_name,
               backend=cfg.backend)
  dw = ref.return_row_weights(ct.recv_topk_weights, handle, cfg.axis_name)
  return dx, None, dw


_fp8_rows.defvjp(_fp8_rows_fwd, _fp8_rows_bwd)
