"""`dispatch_start` / `dispatch_done` and `combine_start` / `combine_done`:
the normal ops split so that independent compute runs while rows move.

On CUDA the start enqueues the op's kernels on the communicator's own stream
(after everything XLA's stream has queued so far) and the done makes XLA's
stream wait for them (ffi/runtime/side_lane.h, docs/design.md "Overlap"). The
start's results reach the program only through the done, which takes them
as aliased operands, with the start's inputs and the overlapped compute
(`after=`) as further operands, so XLA keeps every buffer the side stream
touches alive until the done. Elsewhere start is the op and done the
identity. Results equal the fused `dispatch` / `combine` bit for bit.

Gradients: the done carries them (its residuals are its own outputs, read
after the wait): dispatch_done' = combine of the row cotangents (unit
weights) into x plus the weight cotangents, combine_done' = cached dispatch
of the output cotangent; the starts pass them through. The backward runs
the fused ops on XLA's stream.

One start/done pair at a time per communicator and device, with no other
dispatch, combine or low-latency op in between (a clear error otherwise).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import reference as ref
from jax_ep._checks import is_fp8_pair
from jax_ep._ffi import side_done as ffi
from jax_ep._types import DispatchHandle, DispatchOutput
from jax_ep.ops import _backend
from jax_ep.ops import dispatch as _d


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingDispatch:
  """A dispatch in flight: pass it to `dispatch_done`, read nothing in it."""
  out: DispatchOutput           # the start's results (weights f32, always present)
  x: Any                        # the start's inputs, kept alive until the done
  topk_weights: Optional[jax.Array]
  cfg: _d._Cfg = dataclasses.field(metadata=dict(static=True))
  on_side: bool = dataclasses.field(metadata=dict(static=True), default=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCombine:
  """A combine in flight: pass it to `combine_done`, read nothing in it."""
  out: jax.Array                # [T, H], the start's result
  y: jax.Array
  handle: DispatchHandle
  weights: Optional[jax.Array]
  cfg: _d._Cfg = dataclasses.field(metadata=dict(static=True))
  on_side: bool = dataclasses.field(metadata=dict(static=True), default=True)


def dispatch_start(x: Any, topk_idx: jax.Array, topk_weights: Optional[jax.Array] = None, *,
                   num_experts: int, axis_name: str = "ep", layout: str = "rank",
                   capacity: Optional[int] = None, expert_alignment: int = 1, fp8: bool = False,
                   ue8m0: bool = False, num_sms: Optional[int] = 0,
                   recv_sms: Optional[int] = 0,
                   backend: Optional[str] = None) -> PendingDispatch:
  """Starts `jax_ep.dispatch` (same arguments, no `handle`); see the module doc."""
  cfg, num_ranks, t = _d._dispatch_cfg(
      x, topk_idx, topk_weights, num_experts=num_experts, axis_name=axis_name, layout=layout,
      capacity=capacity, expert_alignment=expert_alignment, fp8=fp8, ue8m0=ue8m0, handle=None,
      backend=backend)
  cfg = dataclasses.replace(cfg, **_d._sms(num_sms, recv_sms))
  if t == 0:
    out = _d._empty_dispatch(cfg, x, topk_idx, topk_weights, num_ranks)
    return PendingDispatch(out, x, topk_weights, cfg, on_side=False)
  if fp8 or is_fp8_pair(x):
    x = jax.tree.map(jax.lax.stop_gradient, x)
  cfg = dataclasses.replace(cfg, start=True)
  out, x, topk_weights = _dispatch_start_vjp(cfg, x, topk_idx, topk_weights)
  return PendingDispatch(out, x, topk_weights, cfg)


def dispatch_done(pending: PendingDispatch, *, after: Any = None) -> DispatchOutput:
  """The DispatchOutput of `pending`, once its kernels are done.

  after: a pytree of arrays computed before the wait (the compute to overlap
    with the dispatch; see `ordered_after`); not returned.
  """
  if not isinstance(pending, PendingDispatch):
    raise ValueError(f"dispatch_done takes the PendingDispatch of dispatch_start, got "
                     f"{type(pending).__name__}")
  if not pending.on_side:
    return _d._remember(pending.out)
  after = tuple(jax.tree.leaves(after))
  return _d._remember(_dispatch_done_vjp(pending.cfg, pending.out, pending.x,
                                         pending.topk_weights, after))


def combine_start(y: jax.Array, handle: DispatchHandle, weights: Optional[jax.Array] = None, *,
                  axis_name: str = "ep", num_sms: Optional[int] = 0,
                  recv_sms: Optional[int] = 0,
                  backend: Optional[str] = None) -> PendingCombine:
  """Starts `jax_ep.combine` (same arguments); see the module doc."""
  cfg = _d._combine_cfg(y, handle, weights, axis_name=axis_name, backend=backend)
  cfg = dataclasses.replace(cfg, **_d._sms(num_sms, recv_sms))
  if handle.topk_idx.shape[0] == 0:
    return PendingCombine(jnp.zeros((0, y.shape[1]), y.dtype), y, handle, weights, cfg,
                          on_side=False)
  cfg = dataclasses.replace(cfg, start=True)
  out, y, weights = _combine_start_vjp(cfg, y, handle, weights)
  return PendingCombine(out, y, handle, weights, cfg)


def combine_done(pending: PendingCombine, *, after: Any = None) -> jax.Array:
  """The [T, H] result of `pending`, once its kernels are done (`after`: as
  in dispatch_done)."""
  if not isinstance(pending, PendingCombine):
    raise ValueError(f"combine_done takes the PendingCombine of combine_start, got "
                     f"{type(pending).__name__}")
  if not pending.on_side:
    return pending.out
  after = tuple(jax.tree.leaves(after))
  return _combine_done_vjp(pending.cfg, pending.out, pending.y, pending.handle, pending.weights,
                           after)


def ordered_after(pending, tree):
  """(pending, tree) tied together so that `tree` is computed only after the
  start ran (XLA could otherwise schedule the compute meant to overlap the
  op before its start). Use the returned pending for the done."""
  return jax.lax.optimization_barrier((pending, tree))


# ------------------------------------------------------------ the two halves

def _f32_weights(out: DispatchOutput) -> DispatchOutput:
  """The start's view of the weights: f32 and always present (the CUDA start
  may not compute on its results, so both backends hand them over as is)."""
  w = out.recv_topk_weights
  shape = out.recv_topk_idx.shape
  w = jnp.zeros(shape, jnp.float32) if w is None else w.astype(jnp.float32)
  return out._replace(recv_topk_weights=w)


def _start_dispatch_impl(cfg, x, topk_idx, topk_weights) -> DispatchOutput:
  def reference(x, topk_idx, topk_weights):
    return _f32_weights(ref.dispatch(
        x, topk_idx, topk_weights, num_experts=cfg.num_experts, axis_name=cfg.axis_name,
        layout=cfg.layout, capacity=cfg.capacity, expert_alignment=cfg.expert_alignment,
        fp8=cfg.fp8, ue8m0=cfg.ue8m0))

  c = _d.choice(cfg, "dispatch_start")
  kernel = lambda x, i, w: _d.kernel_dispatch(cfg, c.comm_id, x, i, w, None)
  return _backend.run(c, reference, kernel, x, topk_idx, topk_weights)


def _done_impl(cfg, results, keep):
  """results, waited for on CUDA (aliased through the done); else as they are.
  The done's choice is its start's: the same arguments, the same chooser."""
  c = _d.choice(cfg, "*_done")
  if not c.kernels:
    return results

  def reference(results, keep):
    del keep
    return results

  def kernel(results, keep):
    leaves, tree = jax.tree.flatten(results)
    return jax.tree.unflatten(tree, ffi.side_done(tuple(leaves), tuple(keep), comm_id=c.comm_id))

  return _backend.run(c, reference, kernel, results, keep)


def _keep(*trees) -> tuple:
  return tuple(l for l in jax.tree.leaves(trees) if hasattr(l, "shape"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_start_vjp(cfg, x, topk_idx, topk_weights):
  return _start_dispatch_impl(cfg, x, topk_idx, topk_weights), x, topk_weights


def _dispatch_start_fwd(cfg, x, topk_idx, topk_weights):
  return _dispatch_start_vjp(cfg, x, topk_idx, topk_weights), None


def _dispatch_start_bwd(cfg, res, ct):
  del cfg, res
  _, dx, dw = ct  # the done put the whole gradient into the pass-through slots
  return dx, None, dw


_dispatch_start_vjp.defvjp(_dispatch_start_fwd, _dispatch_start_bwd)


def _dispatch_done_impl(cfg, out, x, topk_weights, after) -> DispatchOutput:
  h = out.handle
  # Only the start's own results go through the done aliased (topk_idx is
  # an input: it is kept, not aliased).
  moved = (out.recv_x, out.recv_topk_idx, out.recv_topk_weights, out.counts, h.pos_in_rank,
           h.recv_src_rank, h.recv_src_token, h.recv_src_k, h.recv_counts)
  (recv_x, recv_idx, recv_w, counts, pos, src_rank, src_token, src_k, recv_counts) = _done_impl(
      cfg, moved, _keep(x, h.topk_idx, topk_weights, after))
  h = dataclasses.replace(h, pos_in_rank=pos, recv_src_rank=src_rank, recv_src_token=src_token,
                          recv_src_k=src_k, recv_counts=recv_counts)
  w = None if topk_weights is None else recv_w.astype(topk_weights.dtype)
  return DispatchOutput(recv_x, recv_idx, w, counts, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_done_vjp(cfg, out, x, topk_weights, after):
  return _dispatch_done_impl(cfg, out, x, topk_weights, after)


def _dispatch_done_fwd(cfg, out, x, topk_weights, after):
  res = _dispatch_done_impl(cfg, out, x, topk_weights, after)
  # Residuals from the done's outputs, read after the wait; never the
  # start's results themselves (a second reader of those would make XLA
  # copy them before the wait).
  return res, (res.handle, topk_weights is not None)


def _dispatch_done_bwd(cfg, res, ct):
  # The fused dispatch's backward (its residuals are the same pair).
  dx, _, dw, _ = _d._dispatch_bwd(dataclasses.replace(cfg, start=False), res, ct)
  return None, dx, dw, None


_dispatch_done_vjp.defvjp(_dispatch_done_fwd, _dispatch_done_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_start_vjp(cfg, y, handle, weights):
  return _d._combine_impl(cfg, y, handle, weights), y, weights


def _combine_start_fwd(cfg, y, handle, weights):
  return _combine_start_vjp(cfg, y, handle, weights), None


def _combine_start_bwd(cfg, res, ct):
  del cfg, res
  _, dy, dw = ct
  return dy, None, dw


_combine_start_vjp.defvjp(_combine_start_fwd, _combine_start_bwd)


def _combine_done_impl(cfg, out, y, handle, weights, after) -> jax.Array:
  return _done_impl(cfg, out, _keep(y, handle, weights, after))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_done_vjp(cfg, out, y, handle, weights, after):
  return _combine_done_impl(cfg, out, y, handle, weights, after)


def _combine_done_fwd(cfg, out, y, handle, weights, after):
  return _combine_done_impl(cfg, out, y, handle, weights, after), (y, handle, weights)


def _combine_done_bwd(cfg, res, dout):
  fused = dataclasses.replace(cfg, start=False)
  dy, _, dw = _d._combine_bwd(fused, res, dout)
  return None, dy, None, dw, None


_combine_done_vjp.defvjp(_combine_done_fwd, _combine_done_bwd)

