"""Engram remote-row lookups from a table split contiguously over the EP ranks.

Two ways to call it:
- `published = engram_publish(table_shard)` once per table update (once for
  inference; after each optimizer step in training), then any number of
  `engram_fetch(published, indices)`: the publish is paid once, not per fetch.
  Several tables stack in the window with `engram_publish(t2, above=p1)`.
- `engram_fetch(table_shard, indices)`: publish and fetch in one call (what
  the op did before publish existed).

Backends: backend=None / "auto" runs the CUDA path (publish the local shard
into the symmetric window, then one-sided NVLink loads from the owners) on
the CUDA platform when jax_ep was built with CUDA, a Communicator exists for
the axis, the table's rows suit the kernel and the window holds it (with
`reserved_bytes` below it and the tables `above`); otherwise the reference
(pure JAX request/response all_to_all). "reference" and "cuda" force one;
"cuda" raises where auto would fall back. The CUDA path's GPU tests (fused
and published, tables side by side, FP8, bad indices) passed at EP1 on one
H200 and on virtual ranks; the fused publish + fetch also at EP2 (2026-11-30),
the published-table path not yet (benchmarks/RESULTS.md). A fetch from a
publication whose Communicator was closed or replaced raises. The table
gradient sums the row cotangents into the owner's shard in (source rank,
token, slot) order: the reference's
scatter on CPU, a per-row sum kernel on the kernels' path (XLA's GPU
scatter-add has no fixed order).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import reference as ref
from jax_ep._types import Pending, PublishedTable
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


def _choose(backend: Optional[str], axis_name: str, table, reserved_bytes: int,
            end: int = 0) -> str:
  """"cuda" (forced), "auto" (kernels on the CUDA platform, the reference
  elsewhere) or "reference". Auto picks the kernels only where they can run:
  a Communicator for the axis, a row layout the kernel takes, and a window
  that holds the table above `reserved_bytes` and below `end`."""
  if backend == "cuda":
    return "cuda"
  if backend == "reference":
    return "reference"
  comm = _backend.cuda_comm(axis_name)
  if comm is None:
    return "reference"
  from jax_ep import _ffi_engram
  try:
    _ffi_engram._check_table_dtype(table.dtype)
    _ffi_engram._check_row_bytes(table.shape[1], table.dtype)
  except ValueError:
    return "reference"
  need = _ffi_engram.window_bytes_needed(rows_per_rank=table.shape[0], dim=table.shape[1],
                                         dtype=table.dtype, reserved_bytes=reserved_bytes,
                                         table_end_offset=end)
  return "auto" if need <= comm.num_bytes else "reference"


def _run_kind(kind: str) -> Optional[str]:
  """The _backend.run backend for a _choose result."""
  return {"cuda": "cuda", "auto": None, "reference": "reference"}[kind]


def _reference_rows(table, indices, axis_name):
  return ref.engram_fetch_wait(ref.engram_fetch_start(table, indices, axis_name=axis_name))


def _rows(table, indices, *, axis_name: str, backend: str, reserved_bytes: int):
  """Rows [T, e, D] of the global table (no scales); backend is a _choose
  result."""
  if backend == "reference":
    return _reference_rows(table, indices, axis_name)

  def cuda(comm):
    from jax_ep import _ffi_engram
    return _ffi_engram.fetch_factory(reserved_bytes=reserved_bytes)(comm)

  return _backend.run(_run_kind(backend), axis_name,
                      lambda t, i: _reference_rows(t, i, axis_name), cuda, table,
                      indices.astype(jnp.int32))


_ALIGN = 256


def engram_publish(table: jax.Array, scales: Optional[jax.Array] = None, *,
                   axis_name: str = "ep", backend: Optional[str] = None,
                   reserved_bytes: int = 0,
                   above: Optional[PublishedTable] = None) -> PublishedTable:
  """Makes this rank's shard [V/R, D] of a table readable by every rank.

  Args:
    table: the local shard (bf16/f16/f32, or float8_e4m3fn with `scales`).
    scales: FP8 tables: per-row scales [V] f32, replicated on every rank.
    backend: None / "auto": the kernels where they can run (module
      docstring), else the reference; "reference" keeps the shard where it
      is (the reference fetch exchanges rows by all_to_all); "cuda" copies it
      into the Communicator's symmetric window once, for NVLink-load fetches.
    reserved_bytes: "cuda": window bytes from the base that dispatch/combine
      of the same program need; the tables sit above them, at the end.
    above: another table published into the same window; this one goes just
      below it (one table per Engram layer, side by side).
  Returns:
    A PublishedTable for engram_fetch / engram_fetch_start.
  """
  if table.ndim != 2:
    raise ValueError(f"table must be the local shard [V/R, D], got shape {list(table.shape)}")
  _check(table, jnp.zeros((0, 1), jnp.int32), scales, axis_name, backend, reserved_bytes)
  if above is not None and not isinstance(above, PublishedTable):
    raise ValueError(f"above must be a PublishedTable, got {type(above).__name__}")
  end = 0
  if above is not None:
    from jax_ep import _ffi_engram
    size = _ffi_engram.table_bytes(rows_per_rank=above.table.shape[0], dim=above.table.shape[1],
                                   dtype=above.table.dtype)
    # A table's start is rounded down to 256 bytes: leave that slack too.
    end = above.table_end_offset + -(-size // _ALIGN) * _ALIGN + _ALIGN
  kind = _choose(backend, axis_name, table, int(reserved_bytes), end)
  if kind == "reference":
    return PublishedTable(table=table, scales=scales, token=None, axis_name=axis_name,
                          backend="reference", reserved_bytes=int(reserved_bytes),
                          table_end_offset=end)

  def reference(t):  # off CUDA under auto: the reference fetch reads `table`
    return jnp.ones((1,), jnp.int32)

  def cuda(comm):
    from jax_ep import _ffi_engram
    return lambda t: _ffi_engram.publish_cuda(t, comm_id=comm.comm_id,
                                              reserved_bytes=int(reserved_bytes),
                                              table_end_offset=end)

  token = _backend.run(_run_kind(kind), axis_name, reference, cuda, table)
  comm = _backend.cuda_comm(axis_name)
  return PublishedTable(table=table, scales=scales, token=token, axis_name=axis_name,
                        backend=kind, reserved_bytes=int(reserved_bytes), table_end_offset=end,
                        comm_id=-1 if comm is None else comm.comm_id)


def _published_rows(p: PublishedTable, indices: jax.Array) -> jax.Array:
  """Rows [T, e, D] of a published table (no scales), differentiable in p.table."""
  if p.backend == "reference":
    return _fetch_vjp(p.axis_name, "reference", p.reserved_bytes, p.table, indices)
  return _fetch_published_vjp(p.axis_name, p.reserved_bytes, p.table_end_offset, p.backend,
                              p.table, p.token, indices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fetch_published_vjp(axis_name, reserved_bytes, end, kind, table, token, indices):
  def reference(token, indices):  # off CUDA under auto: rows straight from the shard
    del token
    return _reference_rows(table, indices, axis_name)

  def cuda(comm):
    from jax_ep import _ffi_engram
    return lambda token, indices: _ffi_engram.fetch_cuda(
        token, indices, rows_per_rank=table.shape[0], dim=table.shape[1], dtype=table.dtype,
        comm_id=comm.comm_id, reserved_bytes=reserved_bytes, table_end_offset=end)

  return _backend.run(_run_kind(kind), axis_name, reference, cuda, token,
                      indices.astype(jnp.int32))


def _fetch_published_fwd(axis_name, reserved_bytes, end, kind, table, token, indices):
  out = _fetch_published_vjp(axis_name, reserved_bytes, end, kind, table, token, indices)
  return out, _grad_residual(table, indices)


def _fetch_published_bwd(axis_name, reserved_bytes, end, kind, res, d_rows):
  del reserved_bytes, end
  return _shard_grad(axis_name, res, d_rows, kind), None, None


_fetch_published_vjp.defvjp(_fetch_published_fwd, _fetch_published_bwd)


def _check_published(p: PublishedTable, indices: jax.Array) -> None:
  if indices.ndim != 2 or not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"indices must be int32 [T, e], got {indices.dtype}{list(indices.shape)}")
  if p.backend != "reference" and p.token is None:
    raise ValueError("this PublishedTable has no publish token; make it with engram_publish")
  if p.backend != "reference":
    # Its rows sit in one Communicator's window; once that one is closed or
    # replaced, the rows are gone (or belong to someone else).
    comm = _backend.cuda_comm(p.axis_name)
    if comm is None or comm.comm_id != p.comm_id:
      now = "no open Communicator" if comm is None else f"Communicator {comm.comm_id}"
      raise ValueError(
          f"engram_fetch: this table was published into Communicator {p.comm_id}'s window on "
          f"axis {p.axis_name!r}, which has been closed or replaced since (the axis now has "
          f"{now}); publish it again with engram_publish")


def engram_fetch_start(table: jax.Array, indices: jax.Array, *, axis_name: str = "ep",
                       scales: Optional[jax.Array] = None, backend: Optional[str] = None,
                       reserved_bytes: int = 0) -> Any:
  """Starts fetching rows `indices` [T, e] of the global table; the indices
  depend only on token ids, so this can be issued early. Forward-only: use
  `engram_fetch` when the table needs a gradient.

  backend: None / "auto" -> the kernels where they can run (module
    docstring: publish this shard into the Communicator's window and fetch
    with NVLink loads), else the pure-JAX reference; "reference" / "cuda"
    force one ("cuda" needs a Communicator for `axis_name`).
  reserved_bytes: window bytes (from its base) that dispatch/combine in the
    same program need; the table is placed above them, at the end of the
    window. With backend="cuda" a window too small for both raises; auto
    then runs the reference.
  """
  if isinstance(table, PublishedTable):
    p = table
    _check_published(p, indices)
    if p.backend == "reference":
      return ref.engram_fetch_start(p.table, indices, axis_name=p.axis_name, scales=p.scales)
    return _rows_pending(_published_rows(p, indices), indices, p.scales, p.axis_name,
                         p.table.shape[0])
  _check(table, indices, scales, axis_name, backend, reserved_bytes)
  kind = _choose(backend, axis_name, table, int(reserved_bytes))
  if kind == "reference":
    return ref.engram_fetch_start(table, indices, axis_name=axis_name, scales=scales)
  rows = _rows(table, indices, axis_name=axis_name, backend=kind, reserved_bytes=reserved_bytes)
  return _rows_pending(rows, indices, scales, axis_name, table.shape[0])


def _rows_pending(rows, indices, scales, axis_name, rows_per_rank) -> Pending:
  # backend="cuda" marks the kernels' form of a pending fetch: the rows are
  # already final (under auto they come from either backend; see _rows).
  return Pending((rows, indices, scales), op="engram_fetch", axis_name=axis_name,
                 rows_per_rank=rows_per_rank, backend="cuda")


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

  backend / reserved_bytes: as for `engram_fetch_start`.

  `table` may instead be a PublishedTable from engram_publish: then the rows
  come from that publication (its backend, scales and placement; the other
  keyword arguments are not used) and the gradient flows to its shard.
  """
  if isinstance(table, PublishedTable):
    _check_published(table, indices)
    if table.scales is not None:
      return engram_fetch_wait(engram_fetch_start(table, indices))
    return _published_rows(table, indices)
  _check(table, indices, scales, axis_name, backend, reserved_bytes)
  if scales is not None:
    return engram_fetch_wait(engram_fetch_start(table, indices, axis_name=axis_name,
                                                scales=scales, backend=backend,
                                                reserved_bytes=reserved_bytes))
  kind = _choose(backend, axis_name, table, int(reserved_bytes))
  return _fetch_vjp(axis_name, kind, int(reserved_bytes), table, indices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fetch_vjp(axis_name, backend, reserved_bytes, table, indices):
  return _rows(table, indices, axis_name=axis_name, backend=backend,
               reserved_bytes=reserved_bytes)


def _grad_residual(table, indices):
  # A [V/R, 0] array carries the shard's shape and dtype as a residual.
  return indices, jnp.zeros((table.shape[0], 0), table.dtype)


def _shard_grad(axis_name, res, d_rows, kind):
  """The table shard's cotangent (kind: a _choose result): on the kernels'
  path a deterministic per-row sum kernel, else the reference's scatter."""
  indices, like = res
  v_l, dtype = like.shape[0], like.dtype

  def reference(d, i):
    return ref.engram_table_grad(d, i, v_l, dtype, axis_name=axis_name)

  def cuda(comm):
    del comm  # a local kernel; the rows came by the reference's all_gather
    from jax_ep import _ffi_engram
    return lambda d, i: _ffi_engram.table_grad_cuda(d, i, v_l, dtype, axis_name=axis_name)

  if kind == "reference":
    return reference(d_rows, indices)
  return _backend.run(_run_kind(kind), axis_name, reference, cuda, d_rows, indices)


def _fetch_fwd(axis_name, backend, reserved_bytes, table, indices):
  out = _fetch_vjp(axis_name, backend, reserved_bytes, table, indices)
  return out, _grad_residual(table, indices)


def _fetch_bwd(axis_name, backend, reserved_bytes, res, d_rows):
  del reserved_bytes
  return _shard_grad(axis_name, res, d_rows, backend), None


_fetch_vjp.defvjp(_fetch_fwd, _fetch_bwd)
