// Where Engram's published table lives inside the symmetric window.
//
// Every rank's window is [runtime header (kWindowHeaderBytes)] [op area ...].
// Normal dispatch / combine use the op area from kWindowHeaderBytes upwards
// (window_layout.h) and, in a training step, run interleaved with Engram
// fetches. So the table does NOT share their area: it sits at the END of the
// window,
//
//   table_off   = AlignDown256(window_bytes - table_bytes)
//   table_bytes = rows_per_rank * row_bytes          (row_bytes = D * elem)
//   row i of rank s's shard at  base[s] + table_off + i * row_bytes
//
// and the handlers require table_off >= max(kWindowHeaderBytes,
// reserved_bytes), where reserved_bytes (an attribute of both targets, from
// Python) is the number of bytes from the window base that the normal ops of
// the same program need (jax_ep._ffi_dispatch.window_bytes_needed). The window
// is symmetric (same size on every rank) and every rank publishes a shard of
// the same shape, so every rank computes the same table_off for every peer.
//
// Several tables (one per Engram layer) sit side by side, stacked downwards
// from the end: a table published with end_offset = E ends E bytes below the
// window's end (the tables above it take those bytes; Python adds them up,
// docs/design.md §2), so
//
//   table_off = AlignDown256(window_bytes - end_offset - table_bytes).
//
// The kernels cannot check reserved_bytes against what a dispatch/combine
// actually writes: a caller that under-states it gets a dispatch that
// overwrites the table's first rows. The error is raised only when the
// window is too small for header + reserved + table.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace jax_ep {

constexpr size_t kEngramAlign = 256;

struct EngramWindow {
  size_t table_bytes = 0;  // rows_per_rank * row_bytes
  size_t table_off = 0;    // from the window base; valid only when fits
  size_t need = 0;         // smallest window that holds reserved + table
  bool fits = false;

  EngramWindow(size_t window_bytes, int64_t rows_per_rank, size_t row_bytes, size_t reserved_bytes,
               size_t end_offset = 0) {
    table_bytes = static_cast<size_t>(rows_per_rank) * row_bytes;
    const size_t low = reserved_bytes > kWindowHeaderBytes ? reserved_bytes : kWindowHeaderBytes;
    const size_t low_aligned = (low + kEngramAlign - 1) / kEngramAlign * kEngramAlign;
    need = low_aligned + table_bytes + end_offset;
    if (window_bytes >= table_bytes + end_offset) {
      table_off = (window_bytes - end_offset - table_bytes) / kEngramAlign * kEngramAlign;
      fits = table_off >= low;
    }
  }
};

}  // namespace jax_ep
