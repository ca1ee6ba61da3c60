"""Engram remote-row lookups from a table split contiguously over the EP ranks.

Backends: the reference (pure JAX request/response all_to_all) unless the
caller passes backend="cuda" explicitly; backend=None / "auto" / "reference"
all run the reference. The CUDA path (publish the local shard into the
symmetric window, then one-sided NVLink loads from the owners) is not yet
validated on a GPU, so it is never picked automatically. The gradient is the
reference's `engram_table_grad` for both backends.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import reference as ref
from jax_ep._types import Pending
from jax_ep.ops import _backend


def _check(table, indices, scales, axis_name, backend, reserved_bytes):
  _backend.check_backend(backend)
  if table.ndim != 2:
    raise ValueError(f"table must be the local shard [V/R, D], got shape {list(table.shape)}")
  if indices.ndim != 2 or not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"indices must be int32 [T, e], got {indices.dtype}{list(indices.shape)}")
  is_fp8 = table.dtype == jnp.float8_e4m3fn
  if is_fp8 != (scales is not None):
    raise ValueError("scales: an FP8 table needs per-row scales [V] (replicated); "
                     "other tables take none")
  if scales is not None:
    v = table.shape[0] * ref.axis_size(axis_name)
    if scales.shape != (v,):
      raise ValueError(f"scales must be [V={v}] float32, got shape {list(scales.shape)}")
  if reserved_bytes < 0:
    raise ValueError(f"reserved_bytes must be >= 0, got {reserved_bytes}")
  if backend == "cuda":
    from jax_ep import _ffi_engram
    _ffi_engram._check_table_dtype(table.dtype)
    _ffi_engram._check_row_bytes(table.shape[1], table.dtype)


def _rows(table, indices, *, axis_name: str, backend: Optional[str], reserved_bytes: int):
  """Rows [T, e, D] of the global table by the chosen backend (no scales)."""
  if backend != "cuda":
    return ref.engram_fetch_wait(ref.engram_fetch_start(table, indices, axis_name=axis_name))

  def reference(table, indices):  # unused with backend="cuda"; run() wants one
    return ref.engram_fetch_wait(ref.engram_fetch_start(table, indices, axis_name=axis_name))

  def cuda(comm):
    from jax_ep import _ffi_engram
    return _ffi_engram.fetch_factory(reserved_bytes=reserved_bytes)(comm)

  return _backend.run("cuda", axis_name, reference, cuda, table, indices.astype(jnp.int32))


def engram_fetch_start(table: jax.Array, indices: jax.Array, *, axis_name: str = "ep",
                       scales: Optional[jax.Array] = None, backend: Optional[str] = None,
                       reserved_bytes: int = 0) -> Any:
  """Starts fetching rows `indices` [T, e] of the global table; the indices
  depend only on token ids, so this can be issued early. Forward-only: use
  `engram_fetch` when the table needs a gradient.

  backend: None / "auto" / "reference" -> the pure-JAX reference (the default
    everywhere, GPUs included); "cuda" -> publish this shard into the
    Communicator's window and fetch with NVLink loads (not yet validated on
    a GPU; needs a Communicator for `axis_name`).
  reserved_bytes: backend="cuda" only: window bytes (from its base) that
    dispatch/combine in the same program need; the table is placed above
    them, at the end of the window, and a window too small for both raises.
  """
  _check(table, indices, scales, axis_name, backend, reserved_bytes)
  if backend != "cuda":
    return ref.engram_fetch_start(table, indices, axis_name=axis_name, scales=scales)
  rows = _rows(table, indices, axis_name=axis_name, backend=backend,
               reserved_bytes=reserved_bytes)
  return Pending((rows, indices, scales), op="engram_fetch", axis_name=axis_name,
                 rows_per_rank=table.shape[0], backend="cuda")


def engram_fetch_wait(pending: Any) -> Any:
  """Rows [T, e, D] (FP8: (rows [T, e, D], row_scales [T, e])); -1 gives zeros."""
  if not isinstance(pending, Pending) or pending.op != "engram_fetch":
    raise ValueError("pending must be the result of engram_fetch_start")
  if pending.backend != "cuda":
    return ref.engram_fetch_wait(pending)
  rows, indices, scales = pending.arrays
  if scales is None:
    return rows
  return rows, ref.engram_row_scales(indices, scales)


def engram_fetch(table: jax.Array, indices: jax.Array, *, axis_name: str = "ep",
                 scales: Optional[jax.Array] = None, backend: Optional[str] = None,
                 reserved_bytes: int = 0) -> Any:
  """Fetches rows `indices` [T, e] (global row ids in [-1, V)) of a table
  whose local shard [V/R, D] is `table`; owner of row i = i // (V/R).

  Differentiable in `table` (bf16/f16/f32): the row cotangents are summed into
  the owner's shard in float32 (the reference's gradient, for either backend).

  backend / reserved_bytes: as for `engram_fetch_start`; the reference unless
  backend="cuda" is passed explicitly.
  """
  _check(table, indices, scales, axis_name, backend, reserved_bytes)
  if scales is not None:
    return engram_fetch_wait(engram_fetch_start(table, indices, axis_name=axis_name,
                                                scales=scales, backend=backend,
                                                reserved_bytes=reserved_bytes))
  backend = "cuda" if backend == "cuda" else "reference"
  return _fetch_vjp(axis_name, backend, int(reserved_bytes), table, indices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fetch_vjp(axis_name, backend, reserved_bytes, table, indices):
  return _rows(table, indices, axis_name=axis_name, backend=backend,
               reserved_bytes=reserved_bytes)


def _fetch_fwd(axis_name, backend, reserved_bytes, table, indices):
  # A [V/R, 0] array carries the shard's shape and dtype as a residual.
  out = _fetch_vjp(axis_name, backend, reserved_bytes, table, indices)
  return out, (indices, jnp.zeros((table.shape[0], 0), table.dtype))


def _fetch_bwd(axis_name, backend, reserved_bytes, res, d_rows):
  del backend, reserved_bytes  # the gradient is the reference's for both backends
  indices, like = res
  return ref.engram_table_grad(d_rows, indices, like.shape[0], like.dtype, axis_name=axis_name), None


_fetch_vjp.defvjp(_fetch_fwd, _fetch_bwd)
