"""Engram remote-row lookups from a table split contiguously over the EP ranks."""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import reference as ref
from jax_ep._types import Pending


def _check(table, indices, scales, axis_name):
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


def engram_fetch_start(table: jax.Array, indices: jax.Array, *, axis_name: str = "ep",
                       scales: Optional[jax.Array] = None) -> Any:
  """Starts fetching rows `indices` [T, e] of the global table; the indices
  depend only on token ids, so this can be issued early. Forward-only: use
  `engram_fetch` when the table needs a gradient."""
  _check(table, indices, scales, axis_name)
  return ref.engram_fetch_start(table, indices, axis_name=axis_name, scales=scales)


def engram_fetch_wait(pending: Any) -> Any:
  """Rows [T, e, D] (FP8: (rows [T, e, D], row_scales [T, e])); -1 gives zeros."""
  if not isinstance(pending, Pending) or pending.op != "engram_fetch":
    raise ValueError("pending must be the result of engram_fetch_start")
  return ref.engram_fetch_wait(pending)


def engram_fetch(table: jax.Array, indices: jax.Array, *, axis_name: str = "ep",
                 scales: Optional[jax.Array] = None) -> Any:
  """Fetches rows `indices` [T, e] (global row ids in [-1, V)) of a table
  whose local shard [V/R, D] is `table`; owner of row i = i // (V/R).

  Differentiable in `table` (bf16/f16/f32): the row cotangents are summed into
  the owner's shard in float32.
  """
  _check(table, indices, scales, axis_name)
  if scales is not None:
    return engram_fetch_wait(engram_fetch_start(table, indices, axis_name=axis_name,
                                                scales=scales))
  return _fetch_vjp(axis_name, table, indices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fetch_vjp(axis_name, table, indices):
  return ref.engram_fetch_wait(ref.engram_fetch_start(table, indices, axis_name=axis_name))


def _fetch_fwd(axis_name, table, indices):
  # A [V/R, 0] array carries the shard's shape and dtype as a residual.
  return _fetch_vjp(axis_name, table, indices), (indices, jnp.zeros((table.shape[0], 0), table.dtype))


def _fetch_bwd(axis_name, res, d_rows):
  indices, like = res
  return ref.engram_table_grad(d_rows, indices, like.shape[0], like.dtype, axis_name=axis_name), None


_fetch_vjp.defvjp(_fetch_fwd, _fetch_bwd)
