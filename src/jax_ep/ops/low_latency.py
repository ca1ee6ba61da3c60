"""Low-latency (decode) dispatch/combine: fixed [E_l, R * max_tokens, H]
buffers, fused or split into *_start / *_done so XLA can place compute
between the send and the receive. Split and fused give identical results.

Backends: the reference by default (None / "auto" / "reference");
backend="cuda" runs them over the normal CUDA kernels (_low_latency_normal:
bitwise the reference, not yet DeepEP-class latency). That path does all its
work in *_start, so it leaves XLA nothing to overlap.

The dedicated kernels (one kernel per fused op, or a send and a receive
kernel for *_start / *_done; rows stored straight into the owners' windows:
docs/low_latency.md) are reached through `kernel_dispatch` /
`kernel_combine` and their `_start` / `_done` halves; they become the CUDA
path once a GPU run has checked them against the reference
(`_KERNELS_VALIDATED`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import reference as ref
from jax_ep._checks import check_positive, check_routing, check_x
from jax_ep._types import LowLatencyDispatchOutput, LowLatencyHandle, Pending
from jax_ep.ops import _backend
from jax_ep.ops import _low_latency_normal as _via_normal

# The dedicated kernels pass their GPU tests at EP1 and on virtual ranks, but
# their cross-GPU protocol has not run over NVLink (docs/low_latency.md):
# backend="cuda" keeps the composition over the normal kernels until it has.
_KERNELS_VALIDATED = False


def kernel_dispatch(x: jax.Array, topk_idx: jax.Array, *, num_experts: int, max_tokens: int,
                    axis_name: str = "ep", fp8: bool = False, ue8m0: bool = False,
                    reserved_bytes: int = 0, num_sms: int = 0) -> LowLatencyDispatchOutput:
  """low_latency_dispatch on the dedicated kernels (bf16 x; rows past a
  count are left unwritten). Needs a Communicator for `axis_name`."""
  from jax_ep import _ffi_low_latency as ffi_ll
  _check_dispatch(x, topk_idx, num_experts, max_tokens, axis_name, fp8, "cuda")
  _check_kernel_inputs(x, topk_idx, fp8, max_tokens)
  num_ranks = ref.axis_size(axis_name)

  def cuda(comm):
    return lambda a, i: ffi_ll.dispatch_cuda(
        a, i, num_experts=num_experts, max_tokens=max_tokens, num_ranks=num_ranks,
        comm_id=comm.comm_id, fp8=fp8, ue8m0=ue8m0, reserved_bytes=reserved_bytes,
        num_sms=num_sms)

  recv, counts, src_entry = _backend.run("cuda", axis_name, None, cuda, x,
                                         topk_idx.astype(jnp.int32))
  handle = LowLatencyHandle(src_entry=src_entry, recv_count=counts, max_tokens=max_tokens,
                            num_experts=num_experts)
  return LowLatencyDispatchOutput(recv, counts, handle)


def kernel_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                   handle: LowLatencyHandle, *, axis_name: str = "ep", reserved_bytes: int = 0,
                   num_sms: int = 0) -> jax.Array:
  """low_latency_combine on the dedicated kernel (bf16 y)."""
  from jax_ep import _ffi_low_latency as ffi_ll
  _check_combine(y, topk_idx, topk_weights, handle, axis_name, "cuda")
  _check_combine_kernel_input(y)

  def cuda(comm):
    return lambda yy, e, c, i, w: ffi_ll.combine_cuda(
        yy, e, c, i, w, num_experts=handle.num_experts, max_tokens=handle.max_tokens,
        comm_id=comm.comm_id, reserved_bytes=reserved_bytes, num_sms=num_sms)

  return _backend.run("cuda", axis_name, None, cuda, y, handle.src_entry, handle.recv_count,
                      topk_idx.astype(jnp.int32), topk_weights)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelPending:
  """An op sent by the kernels' send half (kernel_*_start), for its receive
  half (kernel_*_done). arrays[0] is the send's token, which orders the two
  in XLA (a combine adds its topk_idx and topk_weights); the rest is static."""
  arrays: tuple
  op: str = dataclasses.field(metadata=dict(static=True))
  axis_name: str = dataclasses.field(metadata=dict(static=True))
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  max_tokens: int = dataclasses.field(metadata=dict(static=True))
  num_tokens: int = dataclasses.field(metadata=dict(static=True))
  topk: int = dataclasses.field(metadata=dict(static=True))
  hidden: int = dataclasses.field(metadata=dict(static=True))
  fp8: bool = dataclasses.field(metadata=dict(static=True))
  reserved_bytes: int = dataclasses.field(metadata=dict(static=True))
  num_sms: int = dataclasses.field(metadata=dict(static=True))


def _check_kernel_inputs(x, topk_idx, fp8, max_tokens):
  from jax_ep import _ffi_low_latency as ffi_ll
  if not ffi_ll.kernels_take(x.dtype, x.shape[1], fp8, topk_idx.shape[1], max_tokens):
    raise ValueError("the low-latency kernels take bf16 x with H a multiple of 8 (128 with FP8), "
                     f"1 <= K <= 32 and max_tokens <= {ffi_ll.MAX_TOKENS}; got {x.dtype}, "
                     f"H={x.shape[1]}, K={topk_idx.shape[1]}, max_tokens={max_tokens}")


def kernel_dispatch_start(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                          max_tokens: int, axis_name: str = "ep", fp8: bool = False,
                          ue8m0: bool = False, reserved_bytes: int = 0,
                          num_sms: int = 0) -> KernelPending:
  """The send half of kernel_dispatch (its own custom call)."""
  from jax_ep import _ffi_low_latency as ffi_ll
  _check_dispatch(x, topk_idx, num_experts, max_tokens, axis_name, fp8, "cuda")
  _check_kernel_inputs(x, topk_idx, fp8, max_tokens)

  def cuda(comm):
    return lambda a, i: ffi_ll.dispatch_send_cuda(
        a, i, num_experts=num_experts, max_tokens=max_tokens, comm_id=comm.comm_id, fp8=fp8,
        ue8m0=ue8m0, reserved_bytes=reserved_bytes, num_sms=num_sms)

  token = _backend.run("cuda", axis_name, None, cuda, x, topk_idx.astype(jnp.int32))
  return KernelPending((token,), op="low_latency_dispatch", axis_name=axis_name,
                       num_experts=num_experts, max_tokens=max_tokens, num_tokens=x.shape[0],
                       topk=topk_idx.shape[1], hidden=x.shape[1], fp8=fp8,
                       reserved_bytes=reserved_bytes, num_sms=num_sms)


def kernel_dispatch_done(pending: KernelPending) -> LowLatencyDispatchOutput:
  """The receive half: what kernel_dispatch returns."""
  from jax_ep import _ffi_low_latency as ffi_ll
  _check_kernel_pending(pending, "low_latency_dispatch")
  p = pending
  num_ranks = ref.axis_size(p.axis_name)

  def cuda(comm):
    return lambda t: ffi_ll.dispatch_recv_cuda(
        t, num_tokens=p.num_tokens, topk=p.topk, hidden=p.hidden, num_experts=p.num_experts,
        max_tokens=p.max_tokens, num_ranks=num_ranks, comm_id=comm.comm_id, fp8=p.fp8,
        reserved_bytes=p.reserved_bytes, num_sms=p.num_sms)

  recv, counts, src_entry = _backend.run("cuda", p.axis_name, None, cuda, p.arrays[0])
  handle = LowLatencyHandle(src_entry=src_entry, recv_count=counts, max_tokens=p.max_tokens,
                            num_experts=p.num_experts)
  return LowLatencyDispatchOutput(recv, counts, handle)


def kernel_combine_start(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                         handle: LowLatencyHandle, *, axis_name: str = "ep",
                         reserved_bytes: int = 0, num_sms: int = 0) -> KernelPending:
  """The send half of kernel_combine (its own custom call)."""
  from jax_ep import _ffi_low_latency as ffi_ll
  _check_combine(y, topk_idx, topk_weights, handle, axis_name, "cuda")
  _check_combine_kernel_input(y)

  def cuda(comm):
    return lambda yy, e, c, i: ffi_ll.combine_send_cuda(
        yy, e, c, i, num_experts=handle.num_experts, max_tokens=handle.max_tokens,
        comm_id=comm.comm_id, reserved_bytes=reserved_bytes, num_sms=num_sms)

  token = _backend.run("cuda", axis_name, None, cuda, y, handle.src_entry, handle.recv_count,
                       topk_idx.astype(jnp.int32))
  return KernelPending((token, topk_idx, topk_weights), op="low_latency_combine",
                       axis_name=axis_name, num_experts=handle.num_experts,
                       max_tokens=handle.max_tokens, num_tokens=topk_idx.shape[0],
                       topk=topk_idx.shape[1], hidden=y.shape[-1], fp8=False,
                       reserved_bytes=reserved_bytes, num_sms=num_sms)


def kernel_combine_done(pending: KernelPending) -> jax.Array:
  """The receive half: [T, H] bf16, as kernel_combine."""
  from jax_ep import _ffi_low_latency as ffi_ll
  _check_kernel_pending(pending, "low_latency_combine")
  p = pending
  token, topk_idx, topk_weights = p.arrays

  def cuda(comm):
    return lambda t, i, w: ffi_ll.combine_recv_cuda(
        t, i, w, hidden=p.hidden, num_experts=p.num_experts, max_tokens=p.max_tokens,
        comm_id=comm.comm_id, reserved_bytes=p.reserved_bytes, num_sms=p.num_sms)

  return _backend.run("cuda", p.axis_name, None, cuda, token, topk_idx.astype(jnp.int32),
                      topk_weights)


def _check_kernel_pending(pending, op: str) -> None:
  if not isinstance(pending, KernelPending) or pending.op != op:
    raise ValueError(f"pending must be the result of kernel_{op.split('_', 2)[2]}_start")


def _check_combine_kernel_input(y) -> None:
  if y.dtype != jnp.bfloat16 or y.shape[-1] % 8:
    raise ValueError(f"the low-latency combine kernel takes bf16 y with H a multiple of 8; "
                     f"got {y.dtype}, H={y.shape[-1]}")


def _kernels_for(x_dtype, hidden, fp8, topk, max_tokens) -> bool:
  from jax_ep import _ffi_low_latency as ffi_ll
  return _KERNELS_VALIDATED and ffi_ll.kernels_take(x_dtype, hidden, fp8, topk, max_tokens)


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
  if backend == "cuda" and _kernels_for(x.dtype, x.shape[1], fp8, topk_idx.shape[1], max_tokens):
    return kernel_dispatch_start(x, topk_idx, num_experts=num_experts, max_tokens=max_tokens,
                                 axis_name=axis_name, fp8=fp8, ue8m0=ue8m0)
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
  order; the rest are zero (the reference) or unspecified (the kernels).
  """
  if isinstance(pending, KernelPending):
    return kernel_dispatch_done(pending)
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
  if backend == "cuda" and _kernels_for(x.dtype, x.shape[1], fp8, topk_idx.shape[1], max_tokens):
    return kernel_dispatch(x, topk_idx, num_experts=num_experts, max_tokens=max_tokens,
                           axis_name=axis_name, fp8=fp8, ue8m0=ue8m0)  # one kernel
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
  if backend == "cuda" and _kernels_for(y.dtype, y.shape[-1], False, topk_idx.shape[1], handle.max_tokens):
    return kernel_combine_start(y, topk_idx, topk_weights, handle, axis_name=axis_name)
  if backend == "cuda":
    out = _via_normal.combine_via_normal(y, topk_idx, topk_weights, handle, axis_name=axis_name,
                                         backend="cuda")
    return Pending(out, op="low_latency_combine", axis_name=axis_name,
                   num_experts=handle.num_experts, backend="cuda")
  return ref.low_latency_combine_start(y, topk_idx, topk_weights, handle, axis_name=axis_name)


def low_latency_combine_done(pending: Pending) -> jax.Array:
  """[T, H]: sum over the token's valid (t, k) in ascending (expert, k) order of
  w[t, k] * y[row], float32, cast to y's dtype."""
  if isinstance(pending, KernelPending):
    return kernel_combine_done(pending)
  _check_pending(pending, "low_latency_combine")
  if pending.backend == "cuda":
    return pending.arrays
  return ref.low_latency_combine_done(pending)


def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                        handle: LowLatencyHandle, *, axis_name: str = "ep",
                        backend: Optional[str] = None) -> jax.Array:
  """Fused `low_latency_combine_start` + `low_latency_combine_done`."""
  if backend == "cuda" and _kernels_for(y.dtype, y.shape[-1], False, topk_idx.shape[1], handle.max_tokens):
    _check_combine(y, topk_idx, topk_weights, handle, axis_name, backend)
    return kernel_combine(y, topk_idx, topk_weights, handle, axis_name=axis_name)  # one kernel
  p = low_latency_combine_start(y, topk_idx, topk_weights, handle, axis_name=axis_name,
                                backend=backend)
  return low_latency_combine_done(p)
