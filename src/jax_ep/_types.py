"""Result and handle types shared by the reference and the CUDA backends.

Both backends must return exactly these pytrees (same shapes and dtypes), so
that `lax.platform_dependent` can pick either and `combine` accepts a handle
from either.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax

Array = jax.Array


class Layout(NamedTuple):
  """`get_dispatch_layout` result, counted over this rank's tokens."""
  num_tokens_per_rank: Array    # [R] i32
  num_tokens_per_expert: Array  # [E] i32, one per valid (token, k)
  is_token_in_rank: Array       # [T, R] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
  """Routing of one dispatch: enough to repeat it (cached dispatch) or undo it
  (combine). Array fields are per rank (inside shard_map)."""
  topk_idx: Array       # [T, K] i32: the source routing (this rank's tokens)
  pos_in_rank: Array    # [T, R] i32: index of token t among this rank's tokens sent to rank j, or -1
  recv_src_rank: Array  # [C] i32: source rank of each received row, -1 for padding
  recv_src_token: Array  # [C] i32: source token index, -1 for padding
  recv_src_k: Array     # [C] i32: expert layout: the row's top-k slot; rank layout: -1
  recv_counts: Array    # [R] i32: rows (rank layout) or (token, k) entries (expert layout) per source
  layout: str = dataclasses.field(metadata=dict(static=True), default="rank")
  num_experts: int = dataclasses.field(metadata=dict(static=True), default=0)
  capacity: int = dataclasses.field(metadata=dict(static=True), default=0)
  expert_alignment: int = dataclasses.field(metadata=dict(static=True), default=1)


class DispatchOutput(NamedTuple):
  """`dispatch` result.

  rank layout:   recv_x [C, H], recv_topk_idx [C, K] (local ids or -1),
                 recv_topk_weights [C, K], counts [R] (rows per source rank).
  expert layout: recv_x [C, H], recv_topk_idx [C] (local expert of the row,
                 -1 for padding), recv_topk_weights [C], counts = group_sizes [E_l].
  FP8: recv_x is a tuple (q [C, H] float8_e4m3fn, scales [C, H // 128] f32).
  """
  recv_x: Any
  recv_topk_idx: Array
  recv_topk_weights: Optional[Array]
  counts: Array
  handle: DispatchHandle


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
  """Where each received low-latency row came from."""
  src_entry: Array   # [E_l, R * max_tokens] i32: flat (src_rank, token, k) index, -1 for empty
  recv_count: Array  # [E_l] i32
  max_tokens: int = dataclasses.field(metadata=dict(static=True), default=0)
  num_experts: int = dataclasses.field(metadata=dict(static=True), default=0)


class LowLatencyDispatchOutput(NamedTuple):
  recv_x: Any         # [E_l, R * max_tokens, H] (or (q, scales [E_l, R*max_tokens, H//128]))
  recv_count: Array   # [E_l] i32
  handle: LowLatencyHandle


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pending:
  """State between a *_start and its *_done / *_wait: the arrays in flight
  and the static configuration, so that the second half needs nothing else."""
  arrays: Any
  op: str = dataclasses.field(metadata=dict(static=True), default="")
  axis_name: str = dataclasses.field(metadata=dict(static=True), default="ep")
  num_experts: int = dataclasses.field(metadata=dict(static=True), default=0)
  max_tokens: int = dataclasses.field(metadata=dict(static=True), default=0)
  rows_per_rank: int = dataclasses.field(metadata=dict(static=True), default=0)
  # Which implementation produced `arrays` ("reference" or "cuda"): their
  # in-flight arrays differ, the second halves' results do not.
  backend: str = dataclasses.field(metadata=dict(static=True), default="reference")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PublishedTable:
  """A table shard that every rank can read (engram_publish's result).

  Valid until the next publish into the same window area (the next
  optimizer step's publish of this table); fetches that consume it run after
  the publish that made it, because they take `token` (CUDA) or `table`.
  """
  table: Array                  # [V/R, D] this rank's shard (the gradient flows to it)
  scales: Optional[Array]       # FP8 tables: per-row scales [V], replicated; else None
  token: Optional[Array]        # CUDA: s32 [1] from the publish kernel; reference: None
  axis_name: str = dataclasses.field(metadata=dict(static=True), default="ep")
  backend: str = dataclasses.field(metadata=dict(static=True), default="reference")
  reserved_bytes: int = dataclasses.field(metadata=dict(static=True), default=0)
  # Window bytes between this table's end and the window's end: the tables
  # published above it (ffi/kernels/engram_layout.h).
  table_end_offset: int = dataclasses.field(metadata=dict(static=True), default=0)
  # The Communicator whose window holds the rows (kernels' publications;
  # -1 for the reference's): a fetch after it was closed or replaced raises.
  comm_id: int = dataclasses.field(metadata=dict(static=True), default=-1)
