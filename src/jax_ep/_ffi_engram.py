"""`jax.ffi.ffi_call` wrappers for the Engram kernels (ffi/handlers/engram.cc).

Targets:
  "jax_ep_engram_publish_fetch": (table, indices) -> rows; both below in one
    call. The public op uses this one (see publish_and_fetch for why).
  "jax_ep_engram_publish": table shard [V/R, D] -> token s32 [1]; copies the
    shard into this rank's symmetric window (at its end, above
    `reserved_bytes`; ffi/kernels/engram_layout.h) between two cross-rank
    barriers.
  "jax_ep_engram_fetch": (token, indices [T, e] s32) -> rows [T, e, D]; plain
    NVLink loads from the owners' windows. Taking the token as an operand is
    what makes XLA run the publish first. For "publish once, fetch many":
    a later publish in the same program must depend on those fetches'
    outputs, or XLA may run it before them.

They run inside `shard_map` on one rank's shard. User-facing checks live in
`jax_ep.ops.engram`; here only what the kernels rely on.

`jax_ep.ops.engram` picks them by default (backend=None) where they can run;
their GPU tests are in tests/test_gpu_engram.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native
from jax_ep._ffi import _call

Array = jax.Array

TABLE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
_ALIGN = 256
_HEADER_BYTES = _native.WINDOW_HEADER_BYTES


def _row_bytes(dim: int, dtype) -> int:
  return int(dim) * jnp.dtype(dtype).itemsize


def _check_table_dtype(dtype) -> None:
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in TABLE_DTYPES]:
    raise ValueError(f"engram (cuda): table dtype must be bf16, f16, f32 or float8_e4m3fn, "
                     f"got {dtype}")


def _check_row_bytes(dim: int, dtype) -> None:
  rb = _row_bytes(dim, dtype)
  if rb == 0 or rb % 16:
    raise ValueError(f"engram (cuda): a table row (D={dim} x {jnp.dtype(dtype).itemsize} bytes "
                     f"= {rb}) must be a positive multiple of 16 bytes")


def table_bytes(*, rows_per_rank: int, dim: int, dtype) -> int:
  """Window bytes one published shard takes (before the 256-byte alignment
  of its start)."""
  return int(rows_per_rank) * _row_bytes(dim, dtype)


def window_bytes_needed(*, rows_per_rank: int, dim: int, dtype, reserved_bytes: int = 0,
                        table_end_offset: int = 0) -> int:
  """Smallest symmetric window (bytes per GPU) that holds the runtime header,
  `reserved_bytes` for dispatch/combine, the tables above this one
  (`table_end_offset` bytes at the end) and the table shard below them.
  Mirrors EngramWindow::need in ffi/kernels/engram_layout.h."""
  low = max(int(reserved_bytes), _HEADER_BYTES)
  low = (low + _ALIGN - 1) // _ALIGN * _ALIGN
  return low + table_bytes(rows_per_rank=rows_per_rank, dim=dim, dtype=dtype) + int(
      table_end_offset)


def publish_cuda(table: Array, *, comm_id: int, reserved_bytes: int = 0,
                 table_end_offset: int = 0) -> Array:
  """Copies this rank's shard [V/R, D] into its window (collective: barrier,
  copy, barrier). Returns the s32 [1] token that `fetch_cuda` takes.

  vmap is refused (vmap_method=None): a batch of tables cannot share the one
  table area of the window.
  """
  if table.ndim != 2:
    raise ValueError(f"table must be the local shard [V/R, D], got shape {list(table.shape)}")
  _check_table_dtype(table.dtype)
  _check_row_bytes(table.shape[1], table.dtype)
  return _call("jax_ep_engram_publish", jax.ShapeDtypeStruct((1,), jnp.int32), vmap_method=None)(
      table, comm_id=np.int64(comm_id), reserved_bytes=np.int64(reserved_bytes),
      table_end_offset=np.int64(table_end_offset))


def fetch_cuda(token: Array, indices: Array, *, rows_per_rank: int, dim: int, dtype,
               comm_id: int, reserved_bytes: int = 0, table_end_offset: int = 0,
               num_sms: int = 0) -> Array:
  """Rows [T, e, D] of the published table (`dtype`, D = `dim`): -1 -> zeros;
  an index outside [-1, V) -> zeros and an error on the communicator.

  `rows_per_rank`, `dim`, `dtype`, `reserved_bytes` and `table_end_offset`
  must be those of the publish that made `token`. vmap over indices runs the fetches one after
  another (vmap_method="sequential"); the table stays the published one.
  """
  if indices.ndim != 2:
    raise ValueError(f"indices must be [T, e], got shape {list(indices.shape)}")
  _check_table_dtype(dtype)
  _check_row_bytes(dim, dtype)
  t, e = indices.shape
  return _call("jax_ep_engram_fetch", jax.ShapeDtypeStruct((t, e, int(dim)), dtype),
               vmap_method="sequential")(
      token, indices.astype(jnp.int32), comm_id=np.int64(comm_id),
      rows_per_rank=np.int64(rows_per_rank), reserved_bytes=np.int64(reserved_bytes),
      table_end_offset=np.int64(table_end_offset), num_sms=np.int32(num_sms))


def publish_and_fetch(table: Array, indices: Array, *, comm_id: int, reserved_bytes: int = 0,
                      num_sms: int = 0) -> Array:
  """Publish this shard, then fetch rows [T, e, D] of the global table, in ONE
  custom call ("jax_ep_engram_publish_fetch"): what the public op uses.

  One call, not publish_cuda + fetch_cuda: XLA orders a fetch after the
  publish whose token it takes, but nothing would order a second publish (of
  another table, in the same program) after the first pair's fetch.
  vmap runs the calls one after another (vmap_method="sequential"); each
  batch element publishes its own table and fetches from it.
  """
  if table.ndim != 2:
    raise ValueError(f"table must be the local shard [V/R, D], got shape {list(table.shape)}")
  if indices.ndim != 2:
    raise ValueError(f"indices must be [T, e], got shape {list(indices.shape)}")
  _check_table_dtype(table.dtype)
  _check_row_bytes(table.shape[1], table.dtype)
  t, e = indices.shape
  return _call("jax_ep_engram_publish_fetch",
               jax.ShapeDtypeStruct((t, e, table.shape[1]), table.dtype),
               vmap_method="sequential")(
      table, indices.astype(jnp.int32), comm_id=np.int64(comm_id),
      reserved_bytes=np.int64(reserved_bytes), num_sms=np.int32(num_sms))


def fetch_factory(*, reserved_bytes: int = 0, num_sms: int = 0):
  """The hook `jax_ep.ops.engram` uses: comm -> fn(table, indices) -> rows."""
  def with_comm(comm):
    def fn(table, indices):
      return publish_and_fetch(table, indices, comm_id=comm.comm_id,
                               reserved_bytes=reserved_bytes, num_sms=num_sms)
    return fn
  return with_comm


def table_grad_cuda(d_rows: Array, indices: Array, v_l: int, dtype, *, axis_name: str) -> Array:
  """The table shard's cotangent on the GPU: the reference's entries, sorted
  stably by local row (so each row's entries stay in (source rank, token,
  slot) order), summed per row in that order by a kernel
  (ffi/kernels/engram_grad.cu): deterministic, and bitwise the reference's
  CPU order."""
  from jax_ep import reference as ref
  rows, d = ref.engram_grad_entries(d_rows, indices, v_l, axis_name=axis_name)
  order = jnp.argsort(rows, stable=True).astype(jnp.int32)
  # d is read through `order` in the kernel, not permuted into a copy.
  g = _call("jax_ep_engram_grad", jax.ShapeDtypeStruct((v_l, d.shape[1]), jnp.float32))(
      rows[order], order, d)
  return g.astype(dtype)
