"""Engram remote-row lookups from a table split contiguously over the EP ranks.

Two ways to call it:
- `published = engram_publish(table_shard)` once per table update (once for
  inference; after each optimizer step in training), then any number of
  `engram_fetch(published, indices)`: the publish is paid once, not per fetch.
  Several tables stack in the window with `engram_publish(t2, above=p1)`.
- `engram_fetch(table_shard, indices)`: publish and fetch in one call (what
  the op did before publish existed).

Backends: backend=None / "auto" runs the CUDA path (publish the local shard
into the symmetric window, then one-sided NVLink loads from the owners; an
owner reached by GIN is sent the row ids and puts the rows back) on
the CUDA platform when jax_ep was built with CUDA, a Communicator exists for
the axis, the table's rows suit the kernel and the window holds it (with
`reserved_bytes` below it and the tables `above`); otherwise the reference
(pure JAX request/response all_to_all). "reference" and "cuda" force one;
"cuda" raises where auto would fall back (`jax_ep.ops._backend.choose`). The CUDA path's GPU tests (fused
and published, tables side by side, FP8, bad indices) passed at EP1 on one
H200 and on virtual ranks; the fused publish + fetch also at EP2 (2026-11-30),
the published-table path not yet (benchmarks/RESULTS.md). A fetch from a
publication whose Communicator was closed or replaced raises. The table
gradient sums the row cotangents into the owner's shard in (source rank,
token, slot) order: the reference's
scatter on CPU, a per-row sum kernel on the kernels' path (XLA's GPU
scatter-add has no fixed order).

num_sms (every op here): CUDA: at most this many SMs for the op's kernels
(0 or None: their own count; the publish takes one CTA and the copy engine).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_ep import _window
from jax_ep import reference as ref
from jax_ep._checks import check_sms
from jax_ep._ffi import engram as ffi
from jax_ep._types import Pending, PublishedTable
from jax_ep.ops import _backend

TABLE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)


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


def _gin_ranks(axis_name: str) -> int:
  """The EP size where the axis' Communicator reaches a peer by GIN (its
  fetches then exchange requests and answers through scratch in the window,
  `_window.engram_gin_bytes`), else 0."""
  comm = _backend.cuda_comm(axis_name)
  return int(comm.num_ranks) if _backend.has_gin_peer(comm) else 0


def _kernel_conditions(table, reserved_bytes: int, end: int = 0, *, axis_name: str = "ep",
                       fetch_rows: int = 0) -> dict:
  """What the kernels need of this table, for `_backend.choose`: a dtype and
  row they take, and a window that holds the table above `reserved_bytes`
  and `end` bytes below the window's end (and, for a fetch of `fetch_rows`
  rows with GIN peers, the exchange's scratch below the table)."""
  dtype, (rows, dim) = jnp.dtype(table.dtype), table.shape
  row_bytes = int(dim) * dtype.itemsize
  refusal = None
  if dtype not in [jnp.dtype(d) for d in TABLE_DTYPES]:
    refusal = f"engram (cuda): table dtype must be bf16, f16, f32 or float8_e4m3fn, got {dtype}"
  elif row_bytes == 0 or row_bytes % 16:
    refusal = (f"engram (cuda): a table row (D={dim} x {dtype.itemsize} bytes = {row_bytes}) "
               "must be a positive multiple of 16 bytes")
  gin_ranks = _gin_ranks(axis_name) if fetch_rows > 0 else 0
  need = _window.engram_bytes(rows_per_rank=rows, dim=dim, dtype=dtype,
                              reserved_bytes=reserved_bytes, table_end_offset=end,
                              gin_ranks=gin_ranks, gin_rows=fetch_rows)
  gin = (f", and the GIN request/answer scratch of {fetch_rows} rows below it"
         if gin_ranks else "")
  return dict(refusal=refusal, window_need=need,
              window_what=f"the table shard [{rows} x {row_bytes} bytes] above "
                          f"reserved_bytes={reserved_bytes}, {end} bytes below the end{gin}")


def _reference_rows(table, indices, axis_name):
  return ref.engram_fetch_wait(ref.engram_fetch_start(table, indices, axis_name=axis_name))


def _rows(table, indices, *, choice: _backend.Choice, reserved_bytes: int, num_sms: int):
  """Rows [T, e, D] of the global table (no scales): publish and fetch in one
  custom call on the kernels' path."""
  def kernel(t, i):
    return ffi.publish_fetch(t, i, comm_id=choice.comm_id, reserved_bytes=reserved_bytes,
                             num_sms=num_sms)

  return _backend.run(choice, lambda t, i: _reference_rows(t, i, choice.axis_name), kernel,
                      table, indices.astype(jnp.int32))


def engram_publish(table: jax.Array, scales: Optional[jax.Array] = None, *,
                   axis_name: str = "ep", backend: Optional[str] = None,
                   reserved_bytes: int = 0, above: Optional[PublishedTable] = None,
                   num_sms: Optional[int] = 0) -> PublishedTable:
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
    num_sms: see the module docstring.
  Returns:
    A PublishedTable for engram_fetch / engram_fetch_start.
  """
  if table.ndim != 2:
    raise ValueError(f"table must be the local shard [V/R, D], got shape {list(table.shape)}")
  _check(table, jnp.zeros((0, 1), jnp.int32), scales, axis_name, backend, reserved_bytes)
  sms = check_sms(num_sms)
  if above is not None and not isinstance(above, PublishedTable):
    raise ValueError(f"above must be a PublishedTable, got {type(above).__name__}")
  end = 0
  if above is not None:
    end = above.table_end_offset + _window.engram_slot_bytes(
        rows_per_rank=above.table.shape[0], dim=above.table.shape[1], dtype=above.table.dtype)
  choice = _backend.choose(backend, op="engram_publish", axis_name=axis_name,
                           **_kernel_conditions(table, int(reserved_bytes), end,
                                                axis_name=axis_name))
  if not choice.kernels:
    return PublishedTable(table=table, scales=scales, token=None, axis_name=axis_name,
                          backend="reference", reserved_bytes=int(reserved_bytes),
                          table_end_offset=end)

  def reference(t):  # off CUDA under auto: the reference fetch reads `table`
    return jnp.ones((1,), jnp.int32)

  def kernel(t):
    return ffi.publish(t, comm_id=choice.comm_id, reserved_bytes=int(reserved_bytes),
                       table_end_offset=end, num_sms=sms)

  # The token carries no gradient (the fetches' custom_vjp returns the
  # table's): a publish inside a differentiated step must not be traced for it.
  token = _backend.run(choice, reference, kernel, jax.lax.stop_gradient(table))
  return PublishedTable(table=table, scales=scales, token=token, axis_name=axis_name,
                        backend=choice.kind, reserved_bytes=int(reserved_bytes),
                        table_end_offset=end, comm_id=choice.comm_id)


def _published_choice(p: PublishedTable) -> _backend.Choice:
  return _backend.Choice(p.backend, p.axis_name, p.comm_id)


def _published_rows(p: PublishedTable, indices: jax.Array, num_sms: int) -> jax.Array:
  """Rows [T, e, D] of a published table (no scales), differentiable in p.table."""
  choice = _published_choice(p)
  if not choice.kernels:
    return _fetch_vjp(choice, p.reserved_bytes, num_sms, p.table, indices)
  return _fetch_published_vjp(choice, p.reserved_bytes, p.table_end_offset, num_sms, p.table,
                              p.token, indices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fetch_published_vjp(choice, reserved_bytes, end, num_sms, table, token, indices):
  def reference(token, indices):  # off CUDA under auto: rows straight from the shard
    del token
    return _reference_rows(table, indices, choice.axis_name)

  def kernel(token, indices):
    return ffi.fetch(token, indices, rows_per_rank=table.shape[0], dim=table.shape[1],
                     dtype=table.dtype, comm_id=choice.comm_id, reserved_bytes=reserved_bytes,
                     table_end_offset=end, num_sms=num_sms)

  return _backend.run(choice, reference, kernel, token, indices.astype(jnp.int32))


def _fetch_published_fwd(choice, reserved_bytes, end, num_sms, table, token, indices):
  out = _fetch_published_vjp(choice, reserved_bytes, end, num_sms, table, token, indices)
  return out, _grad_residual(table, indices)


def _fetch_published_bwd(choice, reserved_bytes, end, num_sms, res, d_rows):
  del reserved_bytes, end
  return _shard_grad(choice, num_sms, res, d_rows), None, None


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
                       reserved_bytes: int = 0, num_sms: Optional[int] = 0) -> Any:
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
  num_sms: see the module docstring.
  """
  sms = check_sms(num_sms)
  if isinstance(table, PublishedTable):
    p = table
    _check_published(p, indices)
    if p.backend == "reference":
      return ref.engram_fetch_start(p.table, indices, axis_name=p.axis_name, scales=p.scales)
    return _rows_pending(_published_rows(p, indices, sms), indices, p.scales, p.axis_name,
                         p.table.shape[0])
  _check(table, indices, scales, axis_name, backend, reserved_bytes)
  choice = _backend.choose(backend, op="engram_fetch", axis_name=axis_name,
                           **_kernel_conditions(table, int(reserved_bytes), axis_name=axis_name,
                                                fetch_rows=indices.size))
  if not choice.kernels:
    return ref.engram_fetch_start(table, indices, axis_name=axis_name, scales=scales)
  rows = _rows(table, indices, choice=choice, reserved_bytes=int(reserved_bytes), num_sms=sms)
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
                 reserved_bytes: int = 0, num_sms: Optional[int] = 0) -> Any:
  """Fetches rows `indices` [T, e] (global row ids in [-1, V)) of a table
  whose local shard [V/R, D] is `table`; owner of row i = i // (V/R).

  Differentiable in `table` (bf16/f16/f32): the row cotangents are summed into
  the owner's shard in float32 (the reference's gradient, for either backend).

  backend / reserved_bytes / num_sms: as for `engram_fetch_start` (num_sms
  also bounds the gradient's sum kernel).

  `table` may instead be a PublishedTable from engram_publish: then the rows
  come from that publication (its backend, scales and placement; of the
  other keyword arguments only num_sms is used) and the gradient flows to its
  shard.
  """
  sms = check_sms(num_sms)
  if isinstance(table, PublishedTable):
    _check_published(table, indices)
    if table.scales is not None:
      return engram_fetch_wait(engram_fetch_start(table, indices, num_sms=sms))
    return _published_rows(table, indices, sms)
  _check(table, indices, scales, axis_name, backend, reserved_bytes)
  if scales is not None:
    return engram_fetch_wait(engram_fetch_start(table, indices, axis_name=axis_name,
                                                scales=scales, backend=backend,
                                                reserved_bytes=reserved_bytes, num_sms=sms))
  choice = _backend.choose(backend, op="engram_fetch", axis_name=axis_name,
                           **_kernel_conditions(table, int(reserved_bytes), axis_name=axis_name,
                                                fetch_rows=indices.size))
  return _fetch_vjp(choice, int(reserved_bytes), sms, table, indices)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fetch_vjp(choice, reserved_bytes, num_sms, table, indices):
  return _rows(table, indices, choice=choice, reserved_bytes=reserved_bytes, num_sms=num_sms)


def _grad_residual(table, indices):
  # A [V/R, 0] array carries the shard's shape and dtype as a residual.
  return indices, jnp.zeros((table.shape[0], 0), table.dtype)


def _shard_grad(choice: _backend.Choice, num_sms: int, res, d_rows):
  """The table shard's cotangent: on the kernels' path the reference's
  entries, sorted stably by local row (so each row's entries stay in (source
  rank, token, slot) order) and summed per row in that order by a kernel
  (deterministic, and bitwise the reference's CPU order); else the
  reference's scatter."""
  indices, like = res
  v_l, dtype, axis_name = like.shape[0], like.dtype, choice.axis_name

  def reference(d, i):
    return ref.engram_table_grad(d, i, v_l, dtype, axis_name=axis_name)

  def kernel(d, i):
    # A local kernel; the rows come by the reference's all_gather.
    rows, dd = ref.engram_grad_entries(d, i, v_l, axis_name=axis_name)
    order = jnp.argsort(rows, stable=True).astype(jnp.int32)
    # dd is read through `order` in the kernel, not permuted into a copy.
    return ffi.grad(rows[order], order, dd, rows_per_rank=v_l, num_sms=num_sms).astype(dtype)

  return _backend.run(choice, reference, kernel, d_rows, indices)


def _fetch_fwd(choice, reserved_bytes, num_sms, table, indices):
  out = _fetch_vjp(choice, reserved_bytes, num_sms, table, indices)
  return out, _grad_residual(table, indices)


def _fetch_bwd(choice, reserved_bytes, num_sms, res, d_rows):
  del reserved_bytes
  return _shard_grad(choice, num_sms, res, d_rows), None


_fetch_vjp.defvjp(_fetch_fwd, _fetch_bwd)
