"""Low-latency (decode) dispatch/combine: fixed [E_l, R * max_tokens, H]
buffers, fused or split into *_start / *_done so XLA can place compute
between the send and the receive. Split and fused give identical results.

Backends, chosen once per call by `jax_ep.ops._backend.choose` (the *_done
half keeps its start's choice):
  "cuda": the dedicated kernels (one kernel per fused op; a send and a
    receive kernel for *_start / *_done; rows stored straight into the
    owners' windows: docs/low_latency.md). They take bf16 x / y, H a
    multiple of 8 (128 with FP8), 1 <= K <= 32 and max_tokens <= 65535;
    anything else is a ValueError at trace time.
  None / "auto": the kernels on the CUDA platform where they can run (a
    Communicator for the axis, its peers reached by NVLink (LSA) or GIN, an
    input they take, a window that holds their area above
    `reserved_bytes`, with the staging of GIN peers), the pure-JAX
    reference otherwise.
  "reference": the reference.
Rows of recv_x at or past recv_count are unspecified on the kernels (they
never write them) and zero in the reference: compare or consume the valid
rows only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _window
from jax_ep import reference as ref
from jax_ep._checks import check_positive, check_routing, check_sms, check_x
from jax_ep._ffi import low_latency as ffi
from jax_ep._types import LowLatencyDispatchOutput, LowLatencyHandle, Pending
from jax_ep.ops import _backend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyPending:
  """An op sent by the kernels' send half, for its `*_done`. arrays[0] is the
  send's token, which orders the two halves in XLA; with backend "auto" the
  op's inputs follow it (the reference runs from them off CUDA), with "cuda"
  only what the receive reads (a combine's topk_idx and topk_weights)."""
  arrays: tuple
  op: str = dataclasses.field(metadata=dict(static=True))
  backend: str = dataclasses.field(metadata=dict(static=True))
  axis_name: str = dataclasses.field(metadata=dict(static=True))
  num_experts: int = dataclasses.field(metadata=dict(static=True))
  max_tokens: int = dataclasses.field(metadata=dict(static=True))
  num_tokens: int = dataclasses.field(metadata=dict(static=True))
  topk: int = dataclasses.field(metadata=dict(static=True))
  hidden: int = dataclasses.field(metadata=dict(static=True))
  fp8: bool = dataclasses.field(metadata=dict(static=True))
  ue8m0: bool = dataclasses.field(metadata=dict(static=True))
  reserved_bytes: int = dataclasses.field(metadata=dict(static=True))
  num_sms: int = dataclasses.field(metadata=dict(static=True))
  comm_id: int = dataclasses.field(metadata=dict(static=True), default=-1)

  @property
  def choice(self) -> _backend.Choice:
    return _backend.Choice(self.backend, self.axis_name, self.comm_id)


def _kernel_refusal(dtype, hidden: int, fp8: bool, topk: int, max_tokens: int) -> Optional[str]:
  """Why the kernels cannot take this input, or None."""
  if (jnp.dtype(dtype) == jnp.bfloat16 and 1 <= topk <= 32 and
      hidden % (128 if fp8 else 8) == 0 and max_tokens <= ffi.MAX_TOKENS):
    return None
  return (f"the low-latency kernels take bf16 data with H a multiple of 8 (128 with FP8), "
          f"1 <= K <= 32 and max_tokens <= {ffi.MAX_TOKENS}; got {jnp.dtype(dtype)}, "
          f"H={hidden}, K={topk}, max_tokens={max_tokens} (backend=None runs the reference "
          f"for such inputs)")


def _kernel_conditions(axis_name: str, *, dtype, hidden: int, fp8: bool, topk: int,
                       num_experts: int, max_tokens: int, reserved_bytes: int) -> dict:
  """What the kernels need of this call, for `_backend.choose`: an input
  they take and a window that holds their area above `reserved_bytes`
  (with the staging area where a peer is reached by GIN)."""
  comm = _backend.cuda_comm(axis_name)
  gin = _backend.has_gin_peer(comm)
  need = _window.low_latency_bytes(num_ranks=ref.axis_size(axis_name), max_tokens=max_tokens,
                                   hidden=hidden, topk=topk, num_experts=num_experts,
                                   reserved_bytes=reserved_bytes, gin=gin)
  hint = "low_latency=True, gin=True" if gin else "low_latency=True"
  return dict(refusal=_kernel_refusal(dtype, hidden, fp8, topk, max_tokens), window_need=need,
              window_what=f"the low-latency area above reserved_bytes={reserved_bytes}; "
                          f"jax_ep.get_buffer_size_hint(..., {hint})")


def _check_options(reserved_bytes, num_sms) -> int:
  """num_sms as the kernels' attribute (0: the kernels' own count)."""
  if (not isinstance(reserved_bytes, (int, np.integer)) or isinstance(reserved_bytes, bool)
      or reserved_bytes < 0):
    raise ValueError(f"reserved_bytes must be an int >= 0, got {reserved_bytes!r}")
  return check_sms(num_sms)


def _check_pending(pending, op: str) -> None:
  if not isinstance(pending, (Pending, LowLatencyPending)) or pending.op != op:
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


# ---------------------------------------------------------------- dispatch

def _ref_dispatch(x, topk_idx, *, num_experts, max_tokens, axis_name, fp8, ue8m0):
  """The reference's fused dispatch as (recv_x, recv_count, src_entry), the
  kernels' result tuple."""
  o = ref.low_latency_dispatch_done(ref.low_latency_dispatch_start(
      x, topk_idx, num_experts=num_experts, max_tokens=max_tokens, axis_name=axis_name, fp8=fp8,
      ue8m0=ue8m0))
  return o.recv_x, o.recv_count, o.handle.src_entry


def _dispatch_output(recv, counts, src_entry, *, num_experts, max_tokens):
  handle = LowLatencyHandle(src_entry=src_entry, recv_count=counts, max_tokens=max_tokens,
                            num_experts=num_experts)
  return LowLatencyDispatchOutput(recv, counts, handle)


def _dispatch_choice(backend, axis_name, op, x, topk_idx, *, num_experts, max_tokens, fp8,
                     reserved_bytes) -> _backend.Choice:
  return _backend.choose(backend, op=op, axis_name=axis_name, **_kernel_conditions(
      axis_name, dtype=x.dtype, hidden=x.shape[1], fp8=fp8, topk=topk_idx.shape[1],
      num_experts=num_experts, max_tokens=max_tokens, reserved_bytes=reserved_bytes))


def low_latency_dispatch_start(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                               max_tokens: int, axis_name: str = "ep", fp8: bool = False,
                               ue8m0: bool = False, reserved_bytes: int = 0,
                               num_sms: Optional[int] = 0,
                               backend: Optional[str] = None) -> Any:
  """Sends; returns an opaque pending state for `low_latency_dispatch_done`.
  Arguments as `low_latency_dispatch` (the done's receive kernel runs with
  the same num_sms)."""
  _check_dispatch(x, topk_idx, num_experts, max_tokens, axis_name, fp8, backend)
  sms = _check_options(reserved_bytes, num_sms)
  choice = _dispatch_choice(backend, axis_name, "low_latency_dispatch_start", x, topk_idx,
                            num_experts=num_experts, max_tokens=max_tokens, fp8=fp8,
                            reserved_bytes=reserved_bytes)
  if not choice.kernels:
    return ref.low_latency_dispatch_start(x, topk_idx, num_experts=num_experts,
                                          max_tokens=max_tokens, axis_name=axis_name, fp8=fp8,
                                          ue8m0=ue8m0)
  idx = topk_idx.astype(jnp.int32)

  def kernel(a, i):
    return ffi.dispatch_send(a, i, num_experts=num_experts, max_tokens=max_tokens,
                             comm_id=choice.comm_id, fp8=fp8, ue8m0=ue8m0,
                             reserved_bytes=reserved_bytes, num_sms=sms)

  def reference(a, i):  # off CUDA under auto: the done runs the whole reference
    return jnp.ones((1,), jnp.int32)

  token = _backend.run(choice, reference, kernel, x, idx)
  arrays = (token, x, idx) if choice.kind == "auto" else (token,)
  return LowLatencyPending(arrays, op="low_latency_dispatch", backend=choice.kind,
                           axis_name=axis_name, num_experts=num_experts, max_tokens=max_tokens,
                           num_tokens=x.shape[0], topk=topk_idx.shape[1], hidden=x.shape[1],
                           fp8=fp8, ue8m0=ue8m0, reserved_bytes=reserved_bytes, num_sms=sms,
                           comm_id=choice.comm_id)


def low_latency_dispatch_done(pending: Any) -> LowLatencyDispatchOutput:
  """Receives: recv_x [E_l, R * max_tokens, H] (+ scales if FP8), recv_count [E_l], handle.

  Rows of local expert l are packed from row 0 in (source rank, token, k)
  order; the rest are zero (the reference) or unspecified (the kernels).
  """
  _check_pending(pending, "low_latency_dispatch")
  if isinstance(pending, Pending):
    return ref.low_latency_dispatch_done(pending)
  p = pending
  num_ranks = ref.axis_size(p.axis_name)

  def kernel(t, *_):
    return ffi.dispatch_recv(t, num_tokens=p.num_tokens, topk=p.topk, hidden=p.hidden,
                             num_experts=p.num_experts, max_tokens=p.max_tokens,
                             num_ranks=num_ranks, comm_id=p.comm_id, fp8=p.fp8,
                             reserved_bytes=p.reserved_bytes, num_sms=p.num_sms)

  def reference(t, x, i):
    return _ref_dispatch(x, i, num_experts=p.num_experts, max_tokens=p.max_tokens,
                         axis_name=p.axis_name, fp8=p.fp8, ue8m0=p.ue8m0)

  recv, counts, src_entry = _backend.run(p.choice, reference, kernel, *p.arrays)
  return _dispatch_output(recv, counts, src_entry, num_experts=p.num_experts,
                          max_tokens=p.max_tokens)


def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, *, num_experts: int,
                         max_tokens: int, axis_name: str = "ep", fp8: bool = False,
                         ue8m0: bool = False, reserved_bytes: int = 0,
                         num_sms: Optional[int] = 0,
                         backend: Optional[str] = None) -> LowLatencyDispatchOutput:
  """Fused `low_latency_dispatch_start` + `low_latency_dispatch_done` (one
  kernel on CUDA).

  Args:
    x: [T, H] with T <= max_tokens; topk_idx: [T, K] ids in [-1, E).
    fp8 / ue8m0: cast to e4m3 with per-128-channel scales (powers of two).
    reserved_bytes: CUDA: window bytes from the base that other ops of the
      program (dispatch / combine) use; the kernels' area goes above them.
    num_sms: CUDA: at most this many SMs (one CTA each); 0 or None: one per
      local expert or per 16 tokens, at most every SM. The reference
      ignores it.
    backend: see the module doc.
  Returns:
    recv_x [E_l, R * max_tokens, H] (or (e4m3, scales [E_l, R * max_tokens,
    H / 128])), recv_count [E_l], handle (for low_latency_combine).
  """
  _check_dispatch(x, topk_idx, num_experts, max_tokens, axis_name, fp8, backend)
  sms = _check_options(reserved_bytes, num_sms)
  choice = _dispatch_choice(backend, axis_name, "low_latency_dispatch", x, topk_idx,
                            num_experts=num_experts, max_tokens=max_tokens, fp8=fp8,
                            reserved_bytes=reserved_bytes)
  kw = dict(num_experts=num_experts, max_tokens=max_tokens, axis_name=axis_name, fp8=fp8,
            ue8m0=ue8m0)
  if not choice.kernels:
    return low_latency_dispatch_done(low_latency_dispatch_start(x, topk_idx, **kw,
                                                                backend="reference"))
  num_ranks = ref.axis_size(axis_name)

  def kernel(a, i):
    return ffi.dispatch(a, i, num_experts=num_experts, max_tokens=max_tokens,
                        num_ranks=num_ranks, comm_id=choice.comm_id, fp8=fp8, ue8m0=ue8m0,
                        reserved_bytes=reserved_bytes, num_sms=sms)

  recv, counts, src_entry = _backend.run(choice, lambda a, i: _ref_dispatch(a, i, **kw), kernel,
                                         x, topk_idx.astype(jnp.int32))
  return _dispatch_output(recv, counts, src_entry, num_experts=num_experts,
                          max_tokens=max_tokens)


# ---------------------------------------------------------------- combine

def _ref_combine(y, src_entry, recv_count, topk_idx, topk_weights, *, num_experts, max_tokens,
                 axis_name):
  h = LowLatencyHandle(src_entry=src_entry, recv_count=recv_count, max_tokens=max_tokens,
                       num_experts=num_experts)
  return ref.low_latency_combine_done(ref.low_latency_combine_start(
      y, topk_idx, topk_weights, h, axis_name=axis_name))


def _combine_choice(backend, axis_name, op, y, topk_idx, handle,
                    reserved_bytes) -> _backend.Choice:
  return _backend.choose(backend, op=op, axis_name=axis_name, **_kernel_conditions(
      axis_name, dtype=y.dtype, hidden=y.shape[-1], fp8=False, topk=topk_idx.shape[1],
      num_experts=handle.num_experts, max_tokens=handle.max_tokens,
      reserved_bytes=reserved_bytes))


def low_latency_combine_start(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                              handle: LowLatencyHandle, *, axis_name: str = "ep",
                              reserved_bytes: int = 0, num_sms: Optional[int] = 0,
                              backend: Optional[str] = None) -> Any:
  """Sends expert outputs back; returns a pending state for
  `low_latency_combine_done`. Arguments as `low_latency_combine` (the done's
  receive kernel runs with the same num_sms)."""
  _check_combine(y, topk_idx, topk_weights, handle, axis_name, backend)
  sms = _check_options(reserved_bytes, num_sms)
  choice = _combine_choice(backend, axis_name, "low_latency_combine_start", y, topk_idx, handle,
                           reserved_bytes)
  if not choice.kernels:
    return ref.low_latency_combine_start(y, topk_idx, topk_weights, handle, axis_name=axis_name)
  idx = topk_idx.astype(jnp.int32)

  def kernel(yy, e, c, i):
    return ffi.combine_send(yy, e, c, i, num_experts=handle.num_experts,
                            max_tokens=handle.max_tokens, comm_id=choice.comm_id,
                            reserved_bytes=reserved_bytes, num_sms=sms)

  def reference(yy, e, c, i):  # off CUDA under auto: the done runs the whole reference
    return jnp.ones((1,), jnp.int32)

  token = _backend.run(choice, reference, kernel, y, handle.src_entry, handle.recv_count, idx)
  arrays = ((token, idx, topk_weights) if choice.kind == "cuda" else
            (token, idx, topk_weights, y, handle.src_entry, handle.recv_count))
  return LowLatencyPending(arrays, op="low_latency_combine", backend=choice.kind,
                           axis_name=axis_name, num_experts=handle.num_experts,
                           max_tokens=handle.max_tokens, num_tokens=topk_idx.shape[0],
                           topk=topk_idx.shape[1], hidden=y.shape[-1], fp8=False, ue8m0=False,
                           reserved_bytes=reserved_bytes, num_sms=sms, comm_id=choice.comm_id)


def low_latency_combine_done(pending: Any) -> jax.Array:
  """[T, H]: sum over the token's valid (t, k) in ascending (expert, k) order of
  w[t, k] * y[row], float32, cast to y's dtype."""
  _check_pending(pending, "low_latency_combine")
  if isinstance(pending, Pending):
    return ref.low_latency_combine_done(pending)
  p = pending

  def kernel(t, i, w, *_):
    return ffi.combine_recv(t, i, w, hidden=p.hidden, num_experts=p.num_experts,
                            max_tokens=p.max_tokens, comm_id=p.comm_id,
                            reserved_bytes=p.reserved_bytes, num_sms=p.num_sms)

  def reference(t, i, w, y, e, c):
    return _ref_combine(y, e, c, i, w, num_experts=p.num_experts, max_tokens=p.max_tokens,
                        axis_name=p.axis_name)

  return _backend.run(p.choice, reference, kernel, *p.arrays)


def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                        handle: LowLatencyHandle, *, axis_name: str = "ep",
                        reserved_bytes: int = 0, num_sms: Optional[int] = 0,
                        backend: Optional[str] = None) -> jax.Array:
  """Fused `low_latency_combine_start` + `low_latency_combine_done` (one
  kernel on CUDA).

  Args:
    y: [E_l, R * max_tokens, H] expert outputs (rows past recv_count are not
      read); topk_idx / topk_weights: [T, K], as given to the dispatch;
      handle: the dispatch's.
    reserved_bytes / num_sms / backend: as `low_latency_dispatch` (pass the
      dispatch's reserved_bytes).
  Returns:
    [T, H] in y's dtype.
  """
  _check_combine(y, topk_idx, topk_weights, handle, axis_name, backend)
  sms = _check_options(reserved_bytes, num_sms)
  choice = _combine_choice(backend, axis_name, "low_latency_combine", y, topk_idx, handle,
                           reserved_bytes)
  if not choice.kernels:
    return low_latency_combine_done(low_latency_combine_start(
        y, topk_idx, topk_weights, handle, axis_name=axis_name, backend="reference"))

  def kernel(yy, e, c, i, w):
    return ffi.combine(yy, e, c, i, w, num_experts=handle.num_experts,
                       max_tokens=handle.max_tokens, comm_id=choice.comm_id,
                       reserved_bytes=reserved_bytes, num_sms=sms)

  def reference(yy, e, c, i, w):
    return _ref_combine(yy, e, c, i, w, num_experts=handle.num_experts,
                        max_tokens=handle.max_tokens, axis_name=axis_name)

  return _backend.run(choice, reference, kernel, y, handle.src_entry, handle.recv_count,
                      topk_idx.astype(jnp.int32), topk_weights)
