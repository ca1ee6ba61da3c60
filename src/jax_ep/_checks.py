"""Argument validation (trace time, ValueError) and device-side error
reporting for the reference backend (run time, an exception naming the op)."""
from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

_FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


class EpRuntimeError(jax.errors.JaxRuntimeError):
  """A device-side problem found while an op ran (bad id, overflow, timeout).

  A `jax.errors.JaxRuntimeError`, which is the one type to catch on both
  backends: the CUDA path raises this class itself (at the next call or
  `Communicator.check()`), the reference's run-time checks surface from the
  jitted call as a JaxRuntimeError whose message holds jax_ep's."""


def is_fp8_pair(x: Any) -> bool:
  return isinstance(x, (tuple, list)) and len(x) == 2


def check_x(x: Any, *, fp8: bool, name: str = "x") -> tuple[int, int]:
  """Validates a dispatch payload; returns (T, H)."""
  if is_fp8_pair(x):
    q, s = x
    if q.ndim != 2 or q.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"{name}[0] must be float8_e4m3fn [T, H], got {q.dtype}{list(q.shape)}")
    t, h = q.shape
    if h % 128:
      raise ValueError(f"{name}: hidden size {h} must be a multiple of 128 for FP8")
    if s.shape != (t, h // 128) or s.dtype != jnp.float32:
      raise ValueError(f"{name}[1] (scales) must be float32 [{t}, {h // 128}], got {s.dtype}{list(s.shape)}")
    if fp8:
      raise ValueError(f"{name} is already FP8; fp8=True casts a bf16/f16/f32 input")
    return t, h
  if x.ndim != 2:
    raise ValueError(f"{name} must be [T, H], got shape {list(x.shape)}")
  if x.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"{name} dtype must be bf16, f16 or f32 (or an FP8 (q, scales) pair), got {x.dtype}")
  t, h = x.shape
  if fp8 and h % 128:
    raise ValueError(f"{name}: hidden size {h} must be a multiple of 128 for fp8=True")
  return t, h


def check_routing(topk_idx, topk_weights, *, num_tokens: int, num_experts: int,
                  num_ranks: int) -> int:
  """Validates routing arrays; returns K."""
  if topk_idx.ndim != 2 or topk_idx.shape[0] != num_tokens:
    raise ValueError(f"topk_idx must be [T={num_tokens}, K], got shape {list(topk_idx.shape)}")
  if not jnp.issubdtype(topk_idx.dtype, jnp.integer):
    raise ValueError(f"topk_idx must be int32, got {topk_idx.dtype}")
  k = topk_idx.shape[1]
  check_experts(num_experts, num_ranks)
  if k < 1 or k > num_experts:
    raise ValueError(f"topk (K={k}) must be in [1, num_experts={num_experts}]")
  if topk_weights is not None:
    if topk_weights.shape != topk_idx.shape:
      raise ValueError(f"topk_weights shape {list(topk_weights.shape)} must equal topk_idx shape {list(topk_idx.shape)}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
      raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
  return k


def check_experts(num_experts: int, num_ranks: int) -> None:
  if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
  if num_experts % num_ranks:
    raise ValueError(f"num_experts={num_experts} must be divisible by the number of ranks {num_ranks}")


def check_positive(name: str, value, *, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_sms(num_sms) -> int:
  """num_sms as the kernels' attribute, the same on every op that launches
  work: 0 (or None) is the op's analytic default, n >= 1 at most n SMs.
  Raises ValueError naming a bad one."""
  return _sm_count("num_sms", num_sms)


def check_recv_sms(recv_sms, num_sms: int) -> int:
  """recv_sms (of dispatch / combine: how many of the num_sms CTAs receive
  or reduce) as the kernels' attribute, 0 (or None) the model's share."""
  q = _sm_count("recv_sms", recv_sms)
  if num_sms and q and q >= num_sms:
    raise ValueError(f"recv_sms ({q}) must be below num_sms ({num_sms}): some CTAs send")
  return q


def _sm_count(name: str, v) -> int:
  if v is None:
    return 0
  if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
    raise ValueError(f"{name} must be an int >= 0 (0 or None: the op's default; n: at most n "
                     f"SMs), got {v!r}")
  return int(v)


def raise_if(bad: jax.Array, message, *details: jax.Array, axis_name: str, carry: Any = (),
             reduce: tuple[str, ...] = ()) -> Any:
  """Raises EpRuntimeError(message) at run time when `bad` is true on any rank
  of `axis_name`; returns `carry` (a pytree of arrays), which the check rides
  on.

  `message` is a format string for the details, or a function of their
  values returning the text. The flag and the details are reduced over the
  axis first (`reduce[i]` "max", the default, or "min"), so every rank raises
  at the same point: a rank that stopped alone would leave its peers waiting
  in the next collective.

  In a program run here the check is a host callback: the exception
  surfaces from the jitted call when a result is read, as a JaxRuntimeError
  whose text holds this message. A host callback cannot be serialised, so in
  a program lowered for `jax.export` the check is data instead: a failed
  check makes every floating-point array of `carry` NaN (integer ones -1) on
  every rank (docs/errors.md, "Exported programs"). Either way the op's
  outputs are never silently truncated data. The check lives as long as one
  array of `carry` is used: give it the op's payload.
  """
  from jax import lax
  bad = lax.pmax(jnp.asarray(bad, jnp.int32), axis_name)
  how = tuple(reduce) + ("max",) * (len(details) - len(reduce))
  details = tuple(lax.pmin(jnp.asarray(d), axis_name) if r == "min" else
                  lax.pmax(jnp.asarray(d), axis_name) for d, r in zip(details, how))
  leaves, tree = jax.tree.flatten(carry)
  _quiet_reports()
  out = _check_p.bind(bad, *details, *leaves, message=message, num_details=len(details))
  return jax.tree.unflatten(tree, out)


def format_report(message, details) -> str:
  values = [np.asarray(v).tolist() for v in details]
  return message(*values) if callable(message) else message.format(*values)


def _report(message, bad, *details) -> None:
  if int(bad):
    raise EpRuntimeError(format_report(message, details))


# jax_ep_check(bad, *details, *carried) -> carried: the identity on
# `carried`, raising (a host callback) or poisoning (exported programs) when
# `bad`. A primitive of its own so that the choice is made where it can be:
# at lowering, which knows whether the program is being exported.
_check_p = jax.extend.core.Primitive("jax_ep_check")
_check_p.multiple_results = True


def _split(args, num_details):
  return args[0], args[1:1 + num_details], args[1 + num_details:]


def _check_impl(*args, message, num_details):
  bad, details, carried = _split(args, num_details)
  _report(message, bad, *details)
  return list(carried)


def _check_abstract_eval(*avals, message, num_details):
  return list(_split(avals, num_details)[2])


def _raising(*args, message, num_details):
  bad, details, carried = _split(args, num_details)
  jax.debug.callback(functools.partial(_report, message), bad, *details)
  return list(carried)


def _poisoning(*args, message, num_details):
  bad, _, carried = _split(args, num_details)
  return [jnp.where(bad != 0, _poison(c), c) for c in carried]


def _poison(a: jax.Array) -> jax.Array:
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return jnp.full_like(a, jnp.nan)
  if a.dtype == jnp.bool_:
    return jnp.zeros_like(a)
  return jnp.full_like(a, -1)


def _check_lowering(ctx, *args, message, num_details):
  fun = _poisoning if ctx.module_context.lowering_parameters.for_export else _raising
  return mlir.lower_fun(fun, multiple_results=True)(ctx, *args, message=message,
                                                   num_details=num_details)


def _check_jvp(primals, tangents, *, message, num_details):
  out = _check_p.bind(*primals, message=message, num_details=num_details)
  return out, list(_split(tangents, num_details)[2])


def _check_batch(args, dims, *, message, num_details):
  def unbatched(a, d):  # any element of the batch counts
    return jnp.max(a, axis=d) if isinstance(d, int) else a
  bad, details, carried = _split(args, num_details)
  bad = unbatched(bad, dims[0])
  details = [unbatched(a, d) for a, d in zip(details, dims[1:1 + num_details])]
  out = _check_p.bind(bad, *details, *carried, message=message, num_details=num_details)
  return out, list(_split(dims, num_details)[2])


_check_p.def_impl(_check_impl)
_check_p.def_abstract_eval(_check_abstract_eval)
mlir.register_lowering(_check_p, _check_lowering)
ad.primitive_jvps[_check_p] = _check_jvp
batching.primitive_batchers[_check_p] = _check_batch


# ------------------------------------------------ which dispatch made an array

# By object identity, weakly (nothing is kept alive): combine(y, handle,
# weights) with y or weights from one dispatch and the handle of another is
# a mix-up no array value shows (same shapes, valid rows); identity shows it
# at trace time for free. Arrays that went through other code first (a jit
# boundary, an optimisation barrier, an elementwise op) are unknown and not
# checked; grouped_matmul passes its group sizes' origin on to its result.
_MADE_BY: dict[int, tuple] = {}


def note_origin(a: Any, origin: int) -> None:
  if isinstance(a, jax.Array):  # tracers are jax.Arrays too
    key = id(a)
    _MADE_BY[key] = (weakref.ref(a, lambda _, k=key: _MADE_BY.pop(k, None)), origin)


def origin_of(a: Any) -> Optional[int]:
  """The origin noted for this very object, or None."""
  got = _MADE_BY.get(id(a))
  return got[1] if got is not None and got[0]() is a else None


def same_origin(result: Any, source: Any) -> Any:
  """result, noted as made by whatever made `source`."""
  origin = origin_of(source)
  if origin is not None:
    note_origin(result, origin)
  return result


_QUIET = False


def _quiet_reports() -> None:
  """The message once, where the user fetches the result (docs/errors.md,
  "When a device-side error is raised").

  Every rank's callback raises (so every rank stops at the same point, see
  raise_if), and jax logs each one with its traceback: that log drops
  EpRuntimeError records. jax also keeps the failed program's runtime
  token and re-raises it at exit ("Exception ignored in atexit callback"):
  an exit handler that runs before jax's waits for those tokens itself and
  reduces a jax_ep error there to one line. Both lean on jax internals
  (the logger's name, jax._src.dispatch.runtime_tokens); if they move,
  the messages are as verbose as before, never lost."""
  global _QUIET
  if _QUIET:
    return
  _QUIET = True
  import atexit
  import logging

  class _DropEpErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
      return not (record.exc_info and isinstance(record.exc_info[1], EpRuntimeError))

  logging.getLogger("jax._src.debugging").addFilter(_DropEpErrors())
  atexit.register(_drain_runtime_tokens)  # atexit is LIFO: before jax's own


def _drain_runtime_tokens() -> None:
  try:
    from jax._src import dispatch
    tokens = dispatch.runtime_tokens
  except (ImportError, AttributeError):
    return
  try:
    tokens.block_until_ready()
  except jax.errors.JaxRuntimeError as e:
    if "EpRuntimeError" not in str(e):
      return  # not ours: jax's own exit handler reports it (once)
    import sys
    line = next((ln for ln in str(e).splitlines() if "EpRuntimeError:" in ln), "")
    print(f"jax_ep: at exit, a program still held a run-time error "
          f"({line.split('EpRuntimeError:', 1)[-1].strip()})", file=sys.stderr)
    tokens.clear()
