"""`jax.ffi.ffi_call` wrappers for the normal dispatch / combine kernels.

Targets (ffi/handlers/dispatch.cc): "jax_ep_dispatch" and "jax_ep_combine"
(attribute `start`: on the communicator's side stream, for dispatch_start /
combine_start; "jax_ep_side_done" is their done, in jax_ep._ffi).
They run inside `shard_map` on one rank's shard (per-shard shapes). The
argument checks with user-facing messages live in `jax_ep.ops.dispatch`;
here only what the kernels rely on.

`dispatch_factory(cfg)` / `combine_factory(cfg)` are the hooks
`jax_ep.ops.dispatch` looks up: each returns `comm -> callable` with the
signature of the reference implementation.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native
from jax_ep._checks import is_fp8_pair
from jax_ep._ffi import _call
from jax_ep._types import DispatchHandle, DispatchOutput

Array = jax.Array

_LAYOUT_CODE = {"rank": 0, "expert": 1}
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _align16(n: int) -> int:
  return (n + 15) // 16 * 16


def window_bytes_needed(*, num_ranks: int, tokens_per_rank: int, hidden: int, topk: int,
                        num_experts: int, x_bytes: int = 2, fp8: bool = False,
                        y_bytes: int = 2) -> int:
  """Bytes of symmetric window (header included) normal dispatch + combine need.

  Mirrors ffi/kernels/window_layout.h (WindowBytesNeeded): dispatch and
  combine use the same area one after the other, so the need is the larger
  of the two. With FP8 the payload is 1 byte per channel (`x_bytes` ignored).
  """
  return max(dispatch_window_end(num_ranks=num_ranks, tokens_per_rank=tokens_per_rank,
                                 hidden=hidden, topk=topk, num_experts=num_experts,
                                 x_bytes=x_bytes, fp8=fp8),
             _combine_window_end(num_ranks, tokens_per_rank, hidden, topk, y_bytes))


# window_layout.h kOpAreaOffset: the header, then u32 chunk counters
# [kMaxRanks][kChunksPerSource].
_OP_AREA = _native.WINDOW_HEADER_BYTES + 4 * _native.MAX_RANKS * _native.CHUNKS_PER_SOURCE


def dispatch_window_end(*, num_ranks: int, tokens_per_rank: int, hidden: int, topk: int,
                        num_experts: int, x_bytes: int = 2, fp8: bool = False) -> int:
  """End of the window bytes a dispatch alone writes (window_layout.h
  DispatchWindow); Engram publications there go stale at each dispatch."""
  r, t, h, k, e = num_ranks, tokens_per_rank, hidden, topk, num_experts
  e_l = e // r
  counts = _align16(_OP_AREA + 8 * r)
  scratch_ints = 16 + r + e + (r + 1) + r + (e_l + 1) + e_l + e_l * r
  counts_out = _align16(counts + 8 * r * (2 + e_l))  # GIN peers' staged counts
  scratch = _align16(counts_out + 8 * r * (2 + e_l))
  rie = _align16(scratch + 4 * scratch_ints)
  recv = _align16(rie + 4 * t * k)
  payload = h * (1 if fp8 else x_bytes)
  scales_off = _align16(payload)
  meta_off = _align16(scales_off + 4 * (h // 128)) if fp8 else scales_off
  row = _align16(meta_off + 4 * (3 * k + 1))
  return recv + 2 * r * t * row  # recv + staging (GIN peers)


def _combine_window_end(r: int, t: int, h: int, k: int, y_bytes: int) -> int:
  crow = _align16(h * y_bytes) + 16
  crecv = _align16(_OP_AREA + 24 * r)  # ok, sent, sent_out (GIN peers' staged sent words)
  return crecv + (max(t * k, r * t) + r * t) * crow  # recv + staging (both layouts)


def dispatch_cuda(x: Any, topk_idx: Array, topk_weights: Optional[Array], *, num_experts: int,
                  num_ranks: int, comm_id: int, layout: str, capacity: int,
                  expert_alignment: int = 1, fp8: bool = False, ue8m0: bool = False,
                  num_sms: int = 0, recv_sms: int = 0, handle: Optional[DispatchHandle] = None,
                  start: bool = False) -> DispatchOutput:
  """Normal dispatch on the GPU; same pytree and values as `reference.dispatch`.

  Args:
    x: [T, H] bf16/f16/f32 or an FP8 pair (q [T, H] e4m3, scales [T, H/128] f32).
    topk_idx: [T, K] int32 in [-1, E). topk_weights: [T, K] float or None.
    fp8 / ue8m0: cast x to FP8 in the kernel.
    num_sms: CTAs of each kernel, at most (0: the bandwidth model);
    recv_sms: of the data kernel's, receiving (0: the model's share).
    start: enqueue on the communicator's side stream (dispatch_start); the
      results may be read only after side_done_cuda. Nothing is computed on
      them here then: recv_topk_weights stays f32 (and present without
      topk_weights), the done casts it.
  Returns:
    DispatchOutput (see jax_ep._types) for `layout`.
  """
  fp8_in = is_fp8_pair(x)
  if fp8_in:
    q, s = x
  else:
    q, s = x, jnp.zeros((0,), jnp.float32)
  t, h = q.shape
  k = topk_idx.shape[1]
  c = int(capacity)
  e_l = num_experts // num_ranks
  payload_fp8 = fp8_in or fp8
  w = (jnp.zeros((t, k), jnp.float32) if topk_weights is None
       else topk_weights.astype(jnp.float32))
  meta_shape = (c, k) if layout == "rank" else (c,)
  results = (
      jax.ShapeDtypeStruct((c, h), jnp.float8_e4m3fn if payload_fp8 else q.dtype),
      jax.ShapeDtypeStruct((c, h // 128) if payload_fp8 else (0,), jnp.float32),
      jax.ShapeDtypeStruct(meta_shape, jnp.int32),
      jax.ShapeDtypeStruct(meta_shape, jnp.float32),
      jax.ShapeDtypeStruct((num_ranks,) if layout == "rank" else (e_l,), jnp.int32),
      jax.ShapeDtypeStruct((t, num_ranks), jnp.int32),
      jax.ShapeDtypeStruct((c,), jnp.int32),
      jax.ShapeDtypeStruct((c,), jnp.int32),
      jax.ShapeDtypeStruct((c,), jnp.int32),
      jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
  )
  (recv_x, recv_scales, recv_idx, recv_w, counts, pos, src_rank, src_token, src_k,
   recv_counts) = _call("jax_ep_dispatch", results, has_side_effect=start)(
       q, s, topk_idx.astype(jnp.int32), w,
       comm_id=np.int64(comm_id), num_experts=np.int32(num_experts),
       layout=np.int32(_LAYOUT_CODE[layout]), expert_alignment=np.int32(expert_alignment),
       fp8_cast=np.int32(bool(fp8)), ue8m0=np.int32(bool(ue8m0)), num_sms=np.int32(num_sms),
       recv_sms=np.int32(recv_sms), start=np.int32(bool(start)))
  if handle is None:
    handle = DispatchHandle(topk_idx=topk_idx, pos_in_rank=pos, recv_src_rank=src_rank,
                            recv_src_token=src_token, recv_src_k=src_k, recv_counts=recv_counts,
                            layout=layout, num_experts=num_experts, capacity=c,
                            expert_alignment=expert_alignment)
  if start:
    out_w = recv_w
  else:
    out_w = None if topk_weights is None else recv_w.astype(topk_weights.dtype)
  out_x = (recv_x, recv_scales) if payload_fp8 else recv_x
  return DispatchOutput(out_x, recv_idx, out_w, counts, handle)


def combine_cuda(y: Array, handle: DispatchHandle, weights: Optional[Array], *, num_ranks: int,
                 comm_id: int, num_sms: int = 0, recv_sms: int = 0,
                 start: bool = False) -> Array:
  """Normal combine on the GPU: [C, H] rows -> [T, H], the reference's f32 order.
  start: on the side stream (combine_start); read the result after side_done_cuda."""
  del num_ranks  # the communicator knows it; kept for symmetry with dispatch_cuda
  if y.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"combine: y dtype must be bf16, f16 or f32, got {y.dtype}")
  t = handle.topk_idx.shape[0]
  w = (jnp.zeros((0,), jnp.float32) if weights is None else weights.astype(jnp.float32))
  return _call("jax_ep_combine", jax.ShapeDtypeStruct((t, y.shape[1]), y.dtype),
               has_side_effect=start)(
      y, w, handle.topk_idx.astype(jnp.int32), handle.pos_in_rank, handle.recv_src_rank,
      handle.recv_src_token, handle.recv_src_k, handle.recv_counts,
      comm_id=np.int64(comm_id), num_experts=np.int32(handle.num_experts),
      layout=np.int32(_LAYOUT_CODE[handle.layout]), has_weights=np.int32(weights is not None),
      num_sms=np.int32(num_sms), recv_sms=np.int32(recv_sms), start=np.int32(bool(start)))


# ------------------------------------------------------------ hooks for ops

def dispatch_factory(cfg):
  """cfg: jax_ep.ops.dispatch._Cfg -> (comm -> fn(x, topk_idx, topk_weights, handle))."""
  def with_comm(comm):
    def fn(x, topk_idx, topk_weights, handle):
      return dispatch_cuda(x, topk_idx, topk_weights, num_experts=cfg.num_experts,
                           num_ranks=comm.num_ranks, comm_id=comm.comm_id, layout=cfg.layout,
                           capacity=cfg.capacity, expert_alignment=cfg.expert_alignment,
                           fp8=cfg.fp8, ue8m0=cfg.ue8m0, handle=handle, start=cfg.start,
                           num_sms=cfg.num_sms, recv_sms=cfg.recv_sms)
    return fn
  return with_comm


def combine_factory(cfg):
  """cfg: jax_ep.ops.dispatch._Cfg -> (comm -> fn(y, handle, weights))."""
  def with_comm(comm):
    def fn(y, handle, weights):
      return combine_cuda(y, handle, weights, num_ranks=comm.num_ranks, comm_id=comm.comm_id,
                          start=cfg.start, num_sms=cfg.num_sms, recv_sms=cfg.recv_sms)
    return fn
  return with_comm
