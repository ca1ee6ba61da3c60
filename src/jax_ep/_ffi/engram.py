"""Wrappers of ffi/handlers/engram.cc.

  "jax_ep_engram_publish_fetch": (table, indices) -> rows; both below in one
    call. The public op's fused form uses this one (see publish_fetch).
  "jax_ep_engram_publish": table shard [V/R, D] -> token s32 [1]; copies the
    shard into this rank's symmetric window (at its end, above
    `reserved_bytes`; ffi/kernels/engram_layout.h) between two cross-rank
    barriers.
  "jax_ep_engram_fetch": (token, indices [T, e] s32) -> rows [T, e, D]; plain
    NVLink loads from the owners' windows (an owner reached by GIN gets the
    row ids and puts the rows back: ffi/kernels/engram_gin.cu). Taking the token as an operand is
    what makes XLA run the publish first. For "publish once, fetch many":
    a later publish in the same program must depend on those fetches'
    outputs, or XLA may run it before them.
  "jax_ep_engram_grad": the table gradient's ordered per-row sum (local).

Window layout: `jax_ep._window.engram_bytes`. GPU tests:
tests/test_gpu_engram.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._ffi import call

Array = jax.Array


def publish(table: Array, *, comm_id: int, reserved_bytes: int = 0, table_end_offset: int = 0,
            num_sms: int = 0) -> Array:
  """Copies this rank's shard [V/R, D] into its window (collective: barrier,
  copy, barrier). Returns the s32 [1] token that `fetch` takes. num_sms: at
  most this many SMs (the publish takes one CTA and the copy engine: within
  any n >= 1).

  vmap is refused (vmap_method=None): a batch of tables cannot share the one
  table area of the window.
  """
  return call("jax_ep_engram_publish", jax.ShapeDtypeStruct((1,), jnp.int32), vmap_method=None)(
      table, comm_id=np.int64(comm_id), reserved_bytes=np.int64(reserved_bytes),
      table_end_offset=np.int64(table_end_offset), num_sms=np.int32(num_sms))


def fetch(token: Array, indices: Array, *, rows_per_rank: int, dim: int, dtype, comm_id: int,
          reserved_bytes: int = 0, table_end_offset: int = 0, num_sms: int = 0) -> Array:
  """Rows [T, e, D] of the published table (`dtype`, D = `dim`): -1 -> zeros;
  an index outside [-1, V) -> zeros and an error on the communicator.

  `rows_per_rank`, `dim`, `dtype`, `reserved_bytes` and `table_end_offset`
  must be those of the publish that made `token`. num_sms: at most this many
  SMs (0: the kernel's model). vmap over indices runs the fetches one after
  another (vmap_method="sequential"); the table stays the published one.
  """
  if indices.ndim != 2:
    raise ValueError(f"indices must be [T, e], got shape {list(indices.shape)}")
  t, e = indices.shape
  return call("jax_ep_engram_fetch", jax.ShapeDtypeStruct((t, e, int(dim)), dtype),
              vmap_method="sequential")(
      token, indices.astype(jnp.int32), comm_id=np.int64(comm_id),
      rows_per_rank=np.int64(rows_per_rank), reserved_bytes=np.int64(reserved_bytes),
      table_end_offset=np.int64(table_end_offset), num_sms=np.int32(num_sms))


def publish_fetch(table: Array, indices: Array, *, comm_id: int, reserved_bytes: int = 0,
                  num_sms: int = 0) -> Array:
  """Publish this shard, then fetch rows [T, e, D] of the global table, in ONE
  custom call: what the public op's fused form uses.

  One call, not publish + fetch: XLA orders a fetch after the publish whose
  token it takes, but nothing would order a second publish (of another
  table, in the same program) after the first pair's fetch. vmap runs the
  calls one after another (vmap_method="sequential"); each batch element
  publishes its own table and fetches from it.
  """
  if table.ndim != 2:
    raise ValueError(f"table must be the local shard [V/R, D], got shape {list(table.shape)}")
  if indices.ndim != 2:
    raise ValueError(f"indices must be [T, e], got shape {list(indices.shape)}")
  t, e = indices.shape
  return call("jax_ep_engram_publish_fetch",
              jax.ShapeDtypeStruct((t, e, table.shape[1]), table.dtype),
              vmap_method="sequential")(
      table, indices.astype(jnp.int32), comm_id=np.int64(comm_id),
      reserved_bytes=np.int64(reserved_bytes), num_sms=np.int32(num_sms))


def grad(rows: Array, order: Array, d: Array, *, rows_per_rank: int, num_sms: int = 0) -> Array:
  """g [V/R, D] f32: for each run of equal `rows` (sorted, [n] s32) the sum
  of d [n, D] f32 rows order[i], ... in that order, from +0.0
  (kernels/engram_grad.h). num_sms: at most this many SMs (0: the kernel's
  own count)."""
  return call("jax_ep_engram_grad",
              jax.ShapeDtypeStruct((int(rows_per_rank), d.shape[1]), jnp.float32))(
      rows, order, d, num_sms=np.int32(num_sms))
