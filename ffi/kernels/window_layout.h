// Where normal dispatch / combine put their data inside the symmetric window.
//
// Every rank's window is [runtime header (kWindowHeaderBytes)] [chunk
// counters] [op area]. The op area is shared by all ops; that is safe because
// every dispatch / combine starts with a rank barrier before its first store
// into a peer's window, so a peer can never still be reading the previous
// op's data there.
//
// Chunk counters (u32 [kMaxRanks][kChunksPerSource], a fixed region so that
// nothing but counters is ever written there): counter [s][c] of a rank counts
// the rows of chunk c that source s has finished storing into this window in
// the current op. Senders add 1 per row after a system fence; receivers wait
// for the full count, so they copy / reduce each chunk while later chunks are
// still crossing the link. Each op zeroes its own counters before its first
// barrier; peers only add after that barrier, and the previous op's adds had
// all landed (its receiver waited for them) before the zeroing.
//
// Dispatch op area (offsets from the window base, all 16-byte aligned, from
// kOpAreaOffset on):
//   ok      u64[R]            tagged "my pushes are complete" word per source
//   counts  u64[R][2 + E_l]   per source: [0] token rows it sends here, [1]
//                             (t, k) entries, [2 + e] entries for local
//                             expert e; tagged with the barrier epoch
//                             (tag << 32 | value)
//   counts_out u64[R][2 + E_l] GIN peers: my counts for rank j, staged here
//                             for the put into rank j's counts[me]
//   scratch i32[...]          this rank's own bookkeeping (never written by a
//                             peer): DispatchScratch below
//   rie     i32[T][K]         rank of (t, k) among this rank's entries that
//                             chose the same expert (expert layout)
//   recv    rows[R][T]        row [s][p] = the p-th token of source s that
//                             comes here; a source writes its own rows at
//                             known offsets, so it needs nothing from us.
//   stage   rows[R][T]        GIN peers: row [j][p] =
//                             my p-th token for rank j, staged here for the
//                             GIN puts, which move [j][0, T)
//                             to rank j's recv[me].
// A dispatch row: payload (H * elem bytes, padded to 16), FP8 scales
// (H/128 f32, padded to 16, only for FP8 payloads), then meta: ids[K] (local
// expert id or -1, already converted by the sender for this destination),
// weights[K] f32 (0 where id -1), rie[K] i32, src token i32, padded to 16.
//
// Combine op area (from kOpAreaOffset on):
//   ok      u64[R]            tagged "my handle checks out" word per source
//   sent    u64[R]            per source: tagged number of rows it sends here
//   sent_out u64[R]           GIN peers: my sent word for rank j, staged here
//   recv    rows[R][T] (rank layout, slot [j][pos_in_rank[t, j]]) or
//           rows[T][K] (expert layout, slot [t][k])
//   stage   rows[R][T]        GIN peers, rank layout: row
//                             [s][p] = my row for source s's slot [me][p];
//                             GIN peers, expert layout: one row per sending
//                             warp, put to the slot [t][k] one at a time
// A combine row: payload (H * y elem bytes, padded to 16), then a 16-byte
// trailer: the weight f32, and in expert layout for a row of this rank's own
// token (never copied) its y row and the op's epoch (combine.cu LocalNote,
// written by the start kernel before the start barrier, as dispatch's rie;
// a peer that was given up on in an earlier op could still overwrite it,
// but then the next op is refused anyway).
//
// Bytes the window needs (see WindowBytesNeeded; mirrored in Python by
// jax_ep._ffi_dispatch.window_bytes_needed):
//   header 4096 + counters 128 KiB
//     + max(dispatch_op_bytes, combine_op_bytes)
// with, for the normal shape (R=2, T=4096, H=7168, K=8, E=256, bf16):
//   dispatch = 2 * 2*4096*(14336 + 112) + small ≈ 237 MB,
//   combine expert layout = (4096*8 + 2*4096)*(14336 + 16) ≈ 588 MB.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace jax_ep {

#define JAX_EP_HD __host__ __device__ __forceinline__

JAX_EP_HD size_t Align16(size_t x) { return (x + 15) & ~static_cast<size_t>(15); }

constexpr int kChunksPerSource = 4096;
constexpr size_t kChunkCountersOffset = kWindowHeaderBytes;
constexpr size_t kOpAreaOffset =
    kChunkCountersOffset + 4 * static_cast<size_t>(kMaxRanks) * kChunksPerSource;

// Rows per chunk when a source sends at most `max_rows` rows to one rank:
// 32 rows (~450 KB of BF16 H=7168 rows) keeps the receiver a few µs behind the
// sender; longer chunks only when the counters would not fit.
JAX_EP_HD int ChunkRows(long long max_rows) {
  const long long need = (max_rows + kChunksPerSource - 1) / kChunksPerSource;
  return static_cast<int>(need > 32 ? need : 32);
}
JAX_EP_HD int NumChunks(long long rows, int chunk_rows) {
  return static_cast<int>((rows + chunk_rows - 1) / chunk_rows);
}

// Layout of the i32 scratch a rank keeps for itself during a dispatch.
struct DispatchScratch {
  // Fixed slots.
  static constexpr int kOk = 0;          // 1: this op may write outputs
  // slot 1 unused
  static constexpr int kBadIds = 2;      // set by the prep blocks
  static constexpr int kSendOk = 3;      // 1: every rank agreed to send (counts exchanged)
  static constexpr int kFixed = 16;
  // Arrays (i32 offsets into scratch).
  int tokens_per_rank;     // [R]   sender side: tokens this rank sends to j
  int entries_per_expert;  // [E]   sender side: (t,k) entries for expert e
  int prefix;              // [R+1] receiver: rank layout row offset per source
  int recv_counts;         // [R]   receiver: rows / entries from each source
  int group_off;           // [E_l+1] receiver: padded group starts
  int group_size;          // [E_l] receiver: unpadded group sizes
  int src_off;             // [E_l][R] receiver: first row of (expert, source)
  int count;               // total i32 elements

  JAX_EP_HD DispatchScratch(int R, int E) {
    const int El = E / R;
    int o = kFixed;
    tokens_per_rank = o; o += R;
    entries_per_expert = o; o += E;
    prefix = o; o += R + 1;
    recv_counts = o; o += R;
    group_off = o; o += El + 1;
    group_size = o; o += El;
    src_off = o; o += El * R;
    count = o;
  }
};

struct DispatchWindow {
  size_t ok_off, counts_off, counts_out_off, scratch_off, rie_off, recv_off, stage_off;
  size_t payload_bytes;  // H * elem
  size_t scales_off;     // inside a row (FP8 only; == meta_off otherwise)
  size_t meta_off;       // inside a row
  size_t row_bytes;
  size_t end;            // bytes from the window base to the end of the area
  int counts_stride;     // 2 + E_l

  JAX_EP_HD DispatchWindow(int R, int T, int H, int K, int E, int elem_bytes, bool fp8_scales) {
    const int El = E / R;
    counts_stride = 2 + El;
    ok_off = kOpAreaOffset;
    counts_off = Align16(ok_off + 8 * static_cast<size_t>(R));
    counts_out_off = Align16(counts_off + 8 * static_cast<size_t>(R) * counts_stride);
    scratch_off = Align16(counts_out_off + 8 * static_cast<size_t>(R) * counts_stride);
    rie_off = Align16(scratch_off + 4 * static_cast<size_t>(DispatchScratch(R, E).count));
    recv_off = Align16(rie_off + 4 * static_cast<size_t>(T) * K);
    payload_bytes = static_cast<size_t>(H) * elem_bytes;
    scales_off = Align16(payload_bytes);
    meta_off = fp8_scales ? Align16(scales_off + 4 * static_cast<size_t>(H / 128)) : scales_off;
    row_bytes = Align16(meta_off + 4 * (3 * static_cast<size_t>(K) + 1));
    stage_off = recv_off + static_cast<size_t>(R) * T * row_bytes;
    end = stage_off + static_cast<size_t>(R) * T * row_bytes;
  }
  JAX_EP_HD size_t row(int src, int slot, int T) const {
    return recv_off + (static_cast<size_t>(src) * T + slot) * row_bytes;
  }
};

struct CombineWindow {
  size_t ok_off, sent_off, sent_out_off, recv_off, stage_off;
  size_t payload_bytes, weight_off, row_bytes, end;

  JAX_EP_HD CombineWindow(int R, int T, int H, int K, int elem_bytes, bool expert_layout) {
    ok_off = kOpAreaOffset;
    sent_off = ok_off + 8 * static_cast<size_t>(R);
    sent_out_off = sent_off + 8 * static_cast<size_t>(R);
    recv_off = Align16(sent_out_off + 8 * static_cast<size_t>(R));
    payload_bytes = static_cast<size_t>(H) * elem_bytes;
    weight_off = Align16(payload_bytes);
    row_bytes = weight_off + 16;
    const size_t slots = expert_layout ? static_cast<size_t>(T) * K : static_cast<size_t>(R) * T;
    stage_off = recv_off + slots * row_bytes;
    end = stage_off + static_cast<size_t>(R) * T * row_bytes;
  }
};


// Window bytes for dispatch (both layouts, payload of `x_elem_bytes`, FP8
// scales if `fp8`; an FP8 payload is 1 byte per channel) and combine (both layouts, `y_elem_bytes`) of one config.
inline size_t WindowBytesNeeded(int R, int T, int H, int K, int E, int x_elem_bytes, bool fp8,
                                int y_elem_bytes) {
  const size_t d = DispatchWindow(R, T, H, K, E, fp8 ? 1 : x_elem_bytes, fp8).end;
  const size_t c = CombineWindow(R, T, H, K, y_elem_bytes, /*expert_layout=*/true).end;
  const size_t c2 = CombineWindow(R, T, H, K, y_elem_bytes, /*expert_layout=*/false).end;
  size_t m = d > c ? d : c;
  return m > c2 ? m : c2;
}

}  // namespace jax_ep
