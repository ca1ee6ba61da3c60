"""The symmetric window's layout, in bytes: the one Python owner of every
window formula (the runtime header, normal dispatch / combine, low latency,
Engram tables) and of the size hint built from them.

Each formula mirrors the kernels' own (ffi/kernels/window_layout.h,
low_latency.cuh, engram_layout.h); tests/test_window_bytes.py compares them
with the built module's. Written here, not asked of the module, so that the
package sizes windows (and lowers programs) without the native build.
"""
from __future__ import annotations

import jax.numpy as jnp

from jax_ep import _native

# NCCL's symmetric windows come in 2 MiB granules.
GRANULE = 2 << 20
HEADER_BYTES = _native.WINDOW_HEADER_BYTES
# Low latency and Engram place their areas on 256-byte boundaries.
_ALIGN = 256


def round_up(n: int, m: int) -> int:
  return (n + m - 1) // m * m


def _align16(n: int) -> int:
  return round_up(n, 16)


def _above(reserved_bytes: int) -> int:
  """Where an area placed above `reserved_bytes` (and the header) starts."""
  return round_up(max(int(reserved_bytes), HEADER_BYTES), _ALIGN)


# ---------------------------------------------------------------- normal ops

# window_layout.h kOpAreaOffset: the header, then u32 chunk counters
# [kMaxRanks][kChunksPerSource].
_OP_AREA = HEADER_BYTES + 4 * _native.MAX_RANKS * _native.CHUNKS_PER_SOURCE


def normal_bytes(*, num_ranks: int, tokens_per_rank: int, hidden: int, topk: int,
                 num_experts: int, x_bytes: int = 2, fp8: bool = False,
                 y_bytes: int = 2) -> int:
  """Bytes (header included) normal dispatch + combine need (window_layout.h
  WindowBytesNeeded): they use the same area one after the other, so the
  larger of the two. With FP8 the payload is 1 byte per channel (`x_bytes`
  ignored)."""
  return max(dispatch_end(num_ranks=num_ranks, tokens_per_rank=tokens_per_rank, hidden=hidden,
                          topk=topk, num_experts=num_experts, x_bytes=x_bytes, fp8=fp8),
             _combine_end(num_ranks, tokens_per_rank, hidden, topk, y_bytes))


def dispatch_scratch(*, num_ranks: int, num_experts: int) -> tuple[int, dict]:
  """(offset in the window, {field: first i32 index, "count": i32 total}) of
  a dispatch's scratch words (window_layout.h DispatchWindow.scratch_off,
  DispatchScratch: its fixed slots, then its arrays in this order)."""
  r, e = num_ranks, num_experts
  e_l = e // r
  counts = _align16(_OP_AREA + 8 * r)
  counts_out = _align16(counts + 8 * r * (2 + e_l))  # GIN peers' staged counts
  fields = {"ok": 0, "bad_ids": 2, "send_ok": 3}
  i = 16
  for name, n in (("tokens_per_rank", r), ("entries_per_expert", e), ("prefix", r + 1),
                  ("recv_counts", r), ("group_off", e_l + 1), ("group_size", e_l),
                  ("src_off", e_l * r)):
    fields[name] = i
    i += n
  fields["count"] = i
  return _align16(counts_out + 8 * r * (2 + e_l)), fields


def dispatch_end(*, num_ranks: int, tokens_per_rank: int, hidden: int, topk: int,
                 num_experts: int, x_bytes: int = 2, fp8: bool = False) -> int:
  """End of the bytes a dispatch alone writes (window_layout.h
  DispatchWindow); Engram publications there go stale at each dispatch."""
  r, t, h, k = num_ranks, tokens_per_rank, hidden, topk
  scratch, fields = dispatch_scratch(num_ranks=r, num_experts=num_experts)
  rie = _align16(scratch + 4 * fields["count"])
  recv = _align16(rie + 4 * t * k)
  payload = h * (1 if fp8 else x_bytes)
  scales_off = _align16(payload)
  meta_off = _align16(scales_off + 4 * (h // 128)) if fp8 else scales_off
  row = _align16(meta_off + 4 * (3 * k + 1))
  return recv + 2 * r * t * row  # recv + staging (GIN peers)


def _combine_end(r: int, t: int, h: int, k: int, y_bytes: int) -> int:
  crow = _align16(h * y_bytes) + 16
  crecv = _align16(_OP_AREA + 24 * r)  # ok, sent, sent_out (GIN peers' staged sent words)
  return crecv + (max(t * k, r * t) + r * t) * crow  # recv + staging (both layouts)


# ---------------------------------------------------------------- low latency

def low_latency_bytes(*, num_ranks: int, max_tokens: int, hidden: int, topk: int,
                      num_experts: int, reserved_bytes: int = 0, gin: bool = False) -> int:
  """Bytes from the base that the low-latency kernels lay out (low_latency.cuh
  LlLayout::End): above `reserved_bytes`, two buffers each of dispatch counts,
  source entries and [E_l, R, M] rows of H bf16 (FP8 rows fit in the same
  stride), then two of combine flags and [M, K] rows. With `gin` (a peer
  reached by GIN) one staging area follows: a dispatch buffer's size, and
  combine flags and [R, M, K] rows."""
  r, m, h, k = int(num_ranks), int(max_tokens), int(hidden), int(topk)
  slots = (int(num_experts) // max(r, 1)) * r
  up = lambda n: round_up(n, _ALIGN)
  disp = up(slots * 8) + up(slots * m * 4) + up(slots * m * h * 2)
  comb = up(r * 8) + up(m * k * h * 2)
  stage = disp + up(r * 8) + up(r * m * k * h * 2) if gin else 0
  return _above(reserved_bytes) + 2 * disp + 2 * comb + stage


# ---------------------------------------------------------------- fused MoE

def mega_moe_bytes(*, num_ranks: int, tokens_per_rank: int, hidden: int, topk: int,
                   num_experts: int, reserved_bytes: int = 0) -> int:
  """Bytes from the base that the fused MoE lays out (mega_layout.h
  MegaWindow): above `reserved_bytes`, my tokens in FP8 [T, H] and their
  scales [T, H/128] f32, per source its counts [E_l] and token lists
  [E_l, T] (int32) and a ready word, the combine slots [T, K, H] bf16 and a
  per-token arrival count, each area on a 256-byte boundary. The slots
  dominate: 470 MB of the 505 MB at T = 4096, H = 7168, K = 8."""
  r, t, h, k = int(num_ranks), int(tokens_per_rank), int(hidden), int(topk)
  e_l = int(num_experts) // max(r, 1)
  up = lambda n: round_up(n, _ALIGN)  # noqa: E731
  return (_above(reserved_bytes) + up(t * h) + up(4 * t * (h // 128)) + up(4 * r * e_l)
          + up(4 * r * e_l * t) + up(8 * r) + up(2 * t * k * h) + up(4 * t))


# ---------------------------------------------------------------- Engram

def engram_table_bytes(*, rows_per_rank: int, dim: int, dtype) -> int:
  """Bytes one published shard takes (before the alignment of its start)."""
  return int(rows_per_rank) * int(dim) * jnp.dtype(dtype).itemsize


def engram_slot_bytes(*, rows_per_rank: int, dim: int, dtype) -> int:
  """What a table takes from the end of the window when another is stacked
  below it (engram_publish(above=...)): its bytes rounded up to 256, and 256
  of slack because its start is rounded down to 256."""
  size = engram_table_bytes(rows_per_rank=rows_per_rank, dim=dim, dtype=dtype)
  return round_up(size, _ALIGN) + _ALIGN


def engram_gin_bytes(*, num_ranks: int, rows: int, dim: int, dtype) -> int:
  """The scratch of one Engram fetch of `rows` (T * e) rows on a
  communicator with GIN peers (engram_layout.h EngramGinArea::Bytes): per
  rank a request and an answer slot in and out, each rounded up to 256
  bytes, and where each row arrives (u32 per row)."""
  n = int(rows)
  req = round_up(4 * n, _ALIGN)
  resp = round_up(n * int(dim) * jnp.dtype(dtype).itemsize, _ALIGN)
  return 2 * int(num_ranks) * (req + resp) + req


def engram_bytes(*, rows_per_rank: int, dim: int, dtype, reserved_bytes: int = 0,
                 table_end_offset: int = 0, gin_ranks: int = 0, gin_rows: int = 0) -> int:
  """Smallest window that holds the header, `reserved_bytes` for
  dispatch/combine, the tables above this one (`table_end_offset` bytes at
  the end) and this table's shard below them (engram_layout.h
  EngramWindow::need). With `gin_ranks` > 0 (a communicator of that many
  ranks with GIN peers) also a fetch's request/answer scratch for
  `gin_rows` rows, which sits above `reserved_bytes`, below the tables."""
  gin = (engram_gin_bytes(num_ranks=gin_ranks, rows=gin_rows, dim=dim, dtype=dtype)
         if int(gin_ranks) > 0 else 0)
  return (_above(reserved_bytes) + gin +
          engram_table_bytes(rows_per_rank=rows_per_rank, dim=dim, dtype=dtype) +
          int(table_end_offset))


# ---------------------------------------------------------------- the hint

def get_buffer_size_hint(*, num_ranks: int, tokens_per_rank: int, hidden: int, topk: int,
                         num_experts: int, dtype_bytes: int = 2,
                         low_latency: bool = False, gin: bool = False,
                         engram_tables=(), engram_fetch_rows: int = 0,
                         mega_moe: bool = False) -> int:
  """Window bytes per rank that the ops need for a config.

  Normal mode: exactly what the dispatch/combine kernels lay out
  (`normal_bytes`). Low-latency mode (tokens_per_rank = max_tokens): what
  the low-latency kernels lay out (`low_latency_bytes`: two buffers of
  [E_l, R, max_tokens] rows and the combine's [max_tokens, K] rows); a
  program that also runs the normal ops passes their need as the
  low-latency ops' `reserved_bytes` and adds the two. Rounded up to NCCL's
  2 MiB granule; includes the 4 KiB runtime header. gin: some peer is
  reached by GIN (Communicator.create(transport="gin" / "gin_emulated"), or
  an EP group beyond one NVLink domain): the low-latency kernels then stage
  what they put to it (`low_latency_bytes(gin=True)`).

  engram_tables: the (rows_per_rank, dim, dtype) of every Engram table that
  will be published side by side (engram_publish(..., above=...)) in the
  same window: they sit at its end, each rounded up to 256 bytes plus 256
  bytes of slack, as engram_publish stacks them.
  engram_fetch_rows: with `gin`, the most rows (T * e) one Engram fetch of
  those tables asks for: its request/answer scratch (`engram_gin_bytes`, at
  the widest table's rows) goes below the tables.
  mega_moe: the fused MoE's area (`mega_moe_bytes`, T = tokens_per_rank)
  above the normal (or low-latency) ops' need, as `mega_moe` places it.
  """
  for name, v in (("num_ranks", num_ranks), ("tokens_per_rank", tokens_per_rank),
                  ("hidden", hidden), ("topk", topk), ("num_experts", num_experts),
                  ("dtype_bytes", dtype_bytes)):
    if v < (0 if name == "tokens_per_rank" else 1):
      raise ValueError(f"{name} must be positive, got {v}")
  r, t, h, k, e = num_ranks, tokens_per_rank, hidden, topk, num_experts
  if low_latency:
    need = low_latency_bytes(num_ranks=r, max_tokens=t, hidden=h, topk=k, num_experts=e, gin=gin)
  else:
    need = normal_bytes(num_ranks=r, tokens_per_rank=t, hidden=h, topk=k, num_experts=e,
                        x_bytes=dtype_bytes, y_bytes=max(dtype_bytes, 2))  # combine: bf16 or wider
  if mega_moe:
    need = mega_moe_bytes(num_ranks=r, tokens_per_rank=t, hidden=h, topk=k, num_experts=e,
                          reserved_bytes=need)
  if engram_tables:
    scratch = 0
    if gin and engram_fetch_rows > 0 and r > 1:
      scratch = max(engram_gin_bytes(num_ranks=r, rows=engram_fetch_rows, dim=d, dtype=dt)
                    for _, d, dt in engram_tables)
    need = round_up(need, GRANULE) + round_up(scratch, _ALIGN) + sum(
        engram_slot_bytes(rows_per_rank=v, dim=d, dtype=dt) for v, d, dt in engram_tables)
  return round_up(need, GRANULE)
