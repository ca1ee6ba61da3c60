"""Wrappers of ffi/handlers/dispatch.cc: "jax_ep_dispatch" and
"jax_ep_combine" (attribute `start`: on the communicator's side stream, for
dispatch_start / combine_start; their done is `side_done`).

Window layout: `jax_ep._window.normal_bytes`.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._checks import is_fp8_pair
from jax_ep._ffi import call
from jax_ep._types import DispatchHandle, DispatchOutput

Array = jax.Array

_LAYOUT_CODE = {"rank": 0, "expert": 1}
_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def dispatch(x: Any, topk_idx: Array, topk_weights: Optional[Array], *, num_experts: int,
             num_ranks: int, comm_id: int, layout: str, capacity: int,
             expert_alignment: int = 1, fp8: bool = False, ue8m0: bool = False,
             num_sms: int = 0, recv_sms: int = 0, handle: Optional[DispatchHandle] = None,
             start: bool = False) -> DispatchOutput:
  """Normal dispatch on the GPU; same pytree and values as `reference.dispatch`.

  Args:
    x: [T, H] bf16/f16/f32 or an FP8 pair (q [T, H] e4m3, scales [T, H/128] f32).
    topk_idx: [T, K] int32 in [-1, E). topk_weights: [T, K] float or None.
    fp8 / ue8m0: cast x to FP8 in the kernel.
    num_sms: at most this many SMs for each of its kernels, setup included
      (0: the bandwidth model's count);
    recv_sms: of the data kernel's, receiving (0: the model's share).
    start: enqueue on the communicator's side stream (dispatch_start); the
      results may be read only after side_done. Nothing is computed on
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
   recv_counts) = call("jax_ep_dispatch", results, has_side_effect=start)(
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


def combine(y: Array, handle: DispatchHandle, weights: Optional[Array], *, comm_id: int,
            num_sms: int = 0, recv_sms: int = 0, start: bool = False) -> Array:
  """Normal combine on the GPU: [C, H] rows -> [T, H], the reference's f32
  order. num_sms / recv_sms: as for dispatch (recv_sms: the reducing SMs).
  start: on the side stream (combine_start); read the result after side_done."""
  if y.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"combine: y dtype must be bf16, f16 or f32, got {y.dtype}")
  t = handle.topk_idx.shape[0]
  w = (jnp.zeros((0,), jnp.float32) if weights is None else weights.astype(jnp.float32))
  return call("jax_ep_combine", jax.ShapeDtypeStruct((t, y.shape[1]), y.dtype),
              has_side_effect=start)(
      y, w, handle.topk_idx.astype(jnp.int32), handle.pos_in_rank, handle.recv_src_rank,
      handle.recv_src_token, handle.recv_src_k, handle.recv_counts,
      comm_id=np.int64(comm_id), num_experts=np.int32(handle.num_experts),
      layout=np.int32(_LAYOUT_CODE[handle.layout]), has_weights=np.int32(weights is not None),
      num_sms=np.int32(num_sms), recv_sms=np.int32(recv_sms), start=np.int32(bool(start)))
