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
//
// A fetch from a communicator with GIN peers cannot load a GIN owner's rows
// (its window is not mapped here): it sends the owner the row ids and the
// owner puts the rows back (engram_gin.cu). That exchange needs scratch in
// every window, the EngramGinArea, which sits right above reserved_bytes,
// below every table: the tables then need gin_bytes more room beneath them,
// and a fetch's area never reaches a published table.
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

  size_t gin_off = 0;      // the EngramGinArea's start (gin_bytes > 0)

  // gin_bytes: EngramGinArea::Bytes of the fetch, 0 without GIN peers.
  EngramWindow(size_t window_bytes, int64_t rows_per_rank, size_t row_bytes, size_t reserved_bytes,
               size_t end_offset = 0, size_t gin_bytes = 0) {
    table_bytes = static_cast<size_t>(rows_per_rank) * row_bytes;
    const size_t low = reserved_bytes > kWindowHeaderBytes ? reserved_bytes : kWindowHeaderBytes;
    const size_t low_aligned = (low + kEngramAlign - 1) / kEngramAlign * kEngramAlign;
    gin_off = low_aligned;
    need = low_aligned + gin_bytes + table_bytes + end_offset;
    if (window_bytes >= table_bytes + end_offset) {
      table_off = (window_bytes - end_offset - table_bytes) / kEngramAlign * kEngramAlign;
      // table_off is 256-aligned: >= low_aligned + gin_bytes iff >= low + gin_bytes rounded.
      fits = table_off >= low_aligned + gin_bytes;
    }
  }
};

// The GIN exchange's scratch (engram_gin.cu), for n = T * e rows of a fetch
// at R ranks. Slots are indexed by the peer's rank (this rank's own stay
// unused, which keeps every offset a function of R, n and row_bytes alone):
//
//   req_in [R]   row ids a peer asks of this rank's shard (u32 each)
//   req_out[R]   the ids this rank asks of each owner, staged for the put
//   resp_in[R]   the rows each owner sent back, in the order asked
//   resp_out[R]  the rows this rank serves each peer, staged for the put
//   pos [n]      where row i of this fetch arrives in its owner's resp_in
//
// Every rank must fetch the same n (the ranks run one program); the
// header words (kEngramGinWordsOffset) carry n so that a difference is
// reported instead of read.
struct EngramGinArea {
  size_t base = 0;
  int nranks = 0;
  size_t req_slot = 0;   // bytes of one req_in / req_out slot
  size_t resp_slot = 0;  // bytes of one resp_in / resp_out slot

  EngramGinArea() = default;
  EngramGinArea(size_t base_off, int R, int64_t n, size_t row_bytes)
      : base(base_off), nranks(R), req_slot(Up(4 * static_cast<size_t>(n))),
        resp_slot(Up(static_cast<size_t>(n) * row_bytes)) {}

  static constexpr size_t Up(size_t b) { return (b + kEngramAlign - 1) / kEngramAlign * kEngramAlign; }
  static size_t Bytes(int R, int64_t n, size_t row_bytes) {
    const EngramGinArea a(0, R, n, row_bytes);
    return a.end();
  }
  __host__ __device__ size_t req_in(int s) const { return base + req_slot * s; }
  __host__ __device__ size_t req_out(int o) const { return base + req_slot * (nranks + o); }
  __host__ __device__ size_t resp_in(int o) const { return base + req_slot * 2 * nranks + resp_slot * o; }
  __host__ __device__ size_t resp_out(int s) const {
    return base + req_slot * 2 * nranks + resp_slot * (nranks + s);
  }
  __host__ __device__ size_t pos() const { return base + (req_slot + resp_slot) * 2 * nranks; }
  __host__ __device__ size_t end() const { return pos() + req_slot; }  // pos is n u32 too
};

// The exchange's control words in the runtime header: 16 bytes per rank
// and kind, [req_in | resp_in | req_out | resp_out][kMaxRanks]. Here, not
// in the area above, so a refusing rank (abort.h) reaches them without
// knowing the fetch's shape: word 0 MakeTagged(sequence, count | flags),
// word 1 the sender's n.
constexpr size_t kEngramGinWordBytes = 16;
constexpr size_t kEngramGinWordsOffset = 1280;
static_assert(kOpConfigOffset + kOpConfigBytes <= kEngramGinWordsOffset &&
                  kEngramGinWordsOffset + 4 * kMaxRanks * kEngramGinWordBytes <= kLlRefusalsOffset,
              "the Engram GIN words sit between the config record and the low-latency refusal words");
enum class EngramGinWord : int { kReqIn = 0, kRespIn = 1, kReqOut = 2, kRespOut = 3 };
__host__ __device__ constexpr size_t EngramGinWordOff(EngramGinWord kind, int rank) {
  return kEngramGinWordsOffset + kEngramGinWordBytes * (static_cast<size_t>(kind) * kMaxRanks + rank);
}

}  // namespace jax_ep
