"""Low-latency (decode) dispatch/combine: fixed [E_l, R * max_tokens, H]
buffers, fused or split into *_start / *_done so XLA can place compute
between the send and the receive. Split and fused give identical results.

Backends: the reference by default (None / "auto" / "reference");
backend="cuda" runs them over the normal CUDA kernels (_low_latency_normal:
bitwise the reference, not yet DeepEP-class latency). That path does all its
work in *_start, so it leaves XLA nothing to overlap.
"""
from __future__ import annotations

from typing import Any, Optional

import jax

from jax_ep import reference as ref
from jax_ep._checks import check_positive, check_routing, check_x
from jax_ep._types import LowLatencyDispatchOutput, LowLatencyHandle, Pending
from jax_ep.ops import _backend
from jax_ep.ops import _low_latency_normal as _via_normal


def _check_pending(pending, op: str) -> None:
  if not isinstance(pending, Pending) or pending.op != op:
    raise ValueError(f"pending must be the result of {op}_start")


def _check_dispatch(x, topk_idx, num_experts, max_tokens, axis_name, fp8, backend):
  _backend.check_backend(backend)
  t, _ = check_x(x, fp8=fp8)
  if isinstance(x, tuple):
    raise ValueError("x: low_latency_dispatch takes bf16/f16/f32 x; use fp8=True for FP8")
  check_routing(topk_idx, None, num_tokens=t, num_experts=num_experts,
                num_ranks=ref.axis_size(axis_name))
  check_positive("max_tokens", max_tokens)
  if t > max_tokens:
    raise ValueError(f"x has {t} tokens, more than max_tokens={max_tokens}")


def low_latency_dispatch_start(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                               max_tokens: int, axis_name: str = "ep", fp8: bool = False,
                               ue8m0: bool = False, backend: Optional[str] = None) -> Any:
  """Sends; returns an opaque pending state for `low_latency_dispatch_done`."""
  _check_dispatch(x, topk_idx, num_experts, max_tokens, axis_name, fp8, backend)
  if backend == "cuda":
    out = _via_normal.dispatch_via_normal(x, topk_idx, num_experts=num_experts,
                                          max_tokens=max_tokens, axis_name=axis_name, fp8=fp8,
                                          ue8m0=ue8m0, backend="cuda")
    return Pending(out, op="low_latency_dispatch", axis_name=axis_name, num_experts=num_experts,
                   max_tokens=max_tokens, backend="cuda")
  return ref.low_latency_dispatch_start(x, topk_idx, num_experts=num_experts,
                                        max_tokens=max_tokens, axis_name=axis_name, fp8=fp8,
                                        ue8m0=ue8m0)


def low_latency_dispatch_done(pending: Pending) -> LowLatencyDispatchOutput:
  """Receives: recv_x [E_l, R * max_tokens, H] (+ scales if FP8), recv_count [E_l], handle.

  Rows of local expert l are packed from row 0 in (source rank, token, k)
  order; the rest are zero.
  """
  _check_pending(pending, "low_latency_dispatch")
  if pending.backend == "cuda":
    return pending.arrays
  return ref.low_latency_dispatch_done(pending)


def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                         max_tokens: int, axis_name: str = "ep", fp8: bool = False,
                         ue8m0: bool = False,
                         backend: Optional[str] = None) -> LowLatencyDispatchOutput:
  """Fused `low_latency_dispatch_start` + `low_latency_dispatch_done`.

  Args:
    x: [T, H] with T <= max_tokens; topk_idx: [T, K] ids in [-1, E).
  """
  p = low_latency_dispatch_start(x, topk_idx, num_experts=num_experts, max_tokens=max_tokens,
                                 axis_name=axis_name, fp8=fp8, ue8m0=ue8m0, backend=backend)
  return low_latency_dispatch_done(p)


def _check_combine(y, topk_idx, topk_weights, handle, axis_name, backend):
  _backend.check_backend(backend)
  if not isinstance(handle, LowLatencyHandle):
    raise ValueError("handle must be the LowLatencyHandle of low_latency_dispatch")
  num_ranks = ref.axis_size(axis_name)
  e_l = handle.num_experts // num_ranks
  m = num_ranks * handle.max_tokens
  if y.ndim != 3 or y.shape[:2] != (e_l, m):
    raise ValueError(f"y must be [E_l={e_l}, R*max_tokens={m}, H], got shape {list(y.shape)}")
  if topk_weights is None:
    raise ValueError("topk_weights is required by low_latency_combine")
  check_routing(topk_idx, topk_weights, num_tokens=topk_idx.shape[0],
                num_experts=handle.num_experts, num_ranks=num_ranks)


def low_latency_combine_start(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                              handle: LowLatencyHandle, *, axis_name: str = "ep",
                              backend: Optional[str] = None) -> Any:
  """Sends expert outputs back; returns a pending state for `low_latency_combine_done`."""
  _check_combine(y, topk_idx, topk_weights, handle, axis_name, backend)
  if backend == "cuda":
    out = _via_normal.combine_via_normal(y, topk_idx, topk_weights, handle, axis_name=axis_name,
                                         backend="cuda")
    return Pending(out, op="low_latency_combine", axis_name=axis_name,
                   num_experts=handle.num_experts, backend="cuda")
  return ref.low_latency_combine_start(y, topk_idx, topk_weights, handle, axis_name=axis_name)


def low_latency_combine_done(pending: Pending) -> jax.Array:
  """[T, H]: sum over the token's valid (t, k) in ascending (expert, k) order of
  w[t, k] * y[row], float32, cast to y's dtype."""
  _check_pending(pending, "low_latency_combine")
  if pending.backend == "cuda":
    return pending.arrays
  return ref.low_latency_combine_done(pending)


def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                        handle: LowLatencyHandle, *, axis_name: str = "ep",
                        backend: Optional[str] = None) -> jax.Array:
  """Fused `low_latency_combine_start` + `low_latency_combine_done`."""
  p = low_latency_combine_start(y, topk_idx, topk_weights, handle, axis_name=axis_name,
                                backend=backend)
  return low_latency_combine_done(p)
