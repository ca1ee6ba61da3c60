// How the normal dispatch / combine reach a peer: the one place that
// chooses, per peer, between LSA and GIN (docs/design.md §7). The kernels
// say where a row goes, that rows were written (a count), and wait for a
// count; they never look at EpPeers::gin_mask themselves.
//
//   LSA: a row is stored straight into the peer's window (mapped here) and
//        counted on the peer's chunk counter for this source (chunks of
//        `chunk` rows, ChunkRows); the receiver waits for the row count.
//   GIN: a row is staged in this rank's window; the warp that completes a
//        chunk of geo.rows rows puts it with the chunk's signal (dispatch,
//        rank-layout combine), or each row is put alone with its token
//        chunk's signal (expert-layout combine); the receiver waits for the
//        number of puts (gin_stage.cuh).
//
// Rank-layout slots: source s's row `pos` sits at [s][pos] of the
// receiver's area, geo.recv_off + (s * T + pos) * row_bytes; staged for GIN
// peer j at geo.stage_off + (j * T + pos) * row_bytes (window_layout.h).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "ep_copy.cuh"
#include "gin.cuh"
#include "gin_stage.cuh"

namespace jax_ep {

struct PeerTransport {
  const EpPeers& p;
  char* my;              // this rank's window
  int chunk;             // LSA rows per chunk counter
  GinChunkGeometry geo;  // slots and staging; geo.rows: GIN rows per chunk

  __device__ __forceinline__ bool Gin(int j) const { return (p.gin_mask >> j) & 1u; }
  __device__ __forceinline__ bool AnyGin() const { return p.gin_mask != 0; }
  // Rows (rank layout) or tokens (expert layout) per counted chunk for peer j.
  __device__ __forceinline__ int RowsPerChunk(int j) const { return Gin(j) ? geo.rows : chunk; }

  // ---- sending

  // Where my row `pos` for peer j is written (`jbase`: j's window as this
  // lane holds it, null for a GIN peer).
  __device__ __forceinline__ char* RowSlot(int j, char* jbase, int pos) const {
    return Gin(j) ? my + geo.stage_off + (static_cast<size_t>(j) * geo.T + pos) * geo.row_bytes
                  : jbase + geo.recv_off + (static_cast<size_t>(p.rank) * geo.T + pos) * geo.row_bytes;
  }

  // The warp wrote its token's rows for the peers in `remote`; lane j holds
  // that row's slot `pos` in j's area (-1: none), j's window `jbase` and
  // `sends`, the rows this rank sends j this op. All 32 lanes.
  __device__ __forceinline__ void RowsWritten(Op op, unsigned remote, char* jbase, int j, int pos,
                                              int sends, uint32_t& channels) const {
    const bool gin_lane = pos >= 0 && Gin(j);
    const unsigned lsa = remote & ~p.gin_mask, gin = remote & p.gin_mask;
    if (lsa != 0) CountRowsDone(pos >= 0 && !gin_lane ? ChunkCounter(jbase, p.rank, pos / chunk) : nullptr, lsa);
    if (gin != 0) {
      const int gch = gin_lane ? pos / geo.rows : 0;
      GinCountStaged(p, op, geo, gin_lane ? ChunkCounter(my, j, gch) : nullptr,
                     static_cast<uint32_t>(min(geo.rows, sends - gch * geo.rows)), gch, gin, channels);
    }
  }

  // The warp wrote my row `pos` for the one peer j (every lane the same
  // j, `jbase`, `pos`, `sends`).
  __device__ __forceinline__ void RowWritten(Op op, int j, char* jbase, int pos, int sends,
                                             uint32_t& channels) const {
    if (Gin(j)) {
      const int ch = pos / geo.rows;
      GinCountStaged(p, op, geo, ChunkCounter(my, j, ch),
                     static_cast<uint32_t>(min(geo.rows, sends - ch * geo.rows)), ch, 1u << j, channels);
    } else {
      CountRowsDone(ChunkCounter(jbase, p.rank, pos / chunk), 1u);
    }
  }

  // Expert-layout combine: one row to source s's slot `slot_off` (its [t][k]),
  // token t. BeginRowPut gives where the warp writes the row (GIN: this
  // warp's stage row `stage_off`, once the card has read its previous put),
  // EndRowPut sends or counts it.
  __device__ __forceinline__ char* BeginRowPut(int s, char* sbase, size_t slot_off, size_t stage_off,
                                               uint32_t& channels) const {
    if (!Gin(s)) return sbase + slot_off;
    GinFlushWarp(p, channels);
    channels = 0;
    return my + stage_off;
  }
  __device__ __forceinline__ void EndRowPut(Op op, int s, char* sbase, size_t slot_off, size_t stage_off,
                                            int t, uint32_t& channels) const {
    if (Gin(s)) {
      __syncwarp();
      const int ch = t / geo.rows;
      GinPutWarp(p, op, s, slot_off, stage_off, geo.row_bytes, GinSignalId(p.rank, ch));
      channels |= 1u << ch;
    } else {
      CountRowsDone(ChunkCounter(sbase, p.rank, t / chunk), 1u);
    }
  }

  // The puts of this warp may still read their staged rows until this.
  __device__ __forceinline__ void Flush(uint32_t channels) const { GinFlushWarp(p, channels); }

  // ---- control words (dispatch's counts exchange)

  // Where my word `i` of the row for rank j goes: straight into j's
  // [me][i] (LSA), or staged at my [j][i] for PutControlRows (GIN).
  __device__ __forceinline__ uint64_t* ControlWord(int j, size_t in_off, size_t out_off, size_t stride,
                                                   int i) const {
    return Gin(j) ? reinterpret_cast<uint64_t*>(my + out_off) + static_cast<size_t>(j) * stride + i
                  : reinterpret_cast<uint64_t*>(p.base[j] + in_off) + static_cast<size_t>(p.rank) * stride + i;
  }
  // One thread, after the staged words are fenced: each GIN peer's row of
  // `n` words, on the control channel ahead of the barrier signal that
  // vouches for it.
  __device__ __forceinline__ void PutControlRows(Op op, size_t in_off, size_t out_off, size_t stride,
                                                 int n) const {
    for (int j = 0; j < p.nranks; ++j) {
      if (Gin(j))
        GinPutQuiet(p, op, j, in_off + 8 * static_cast<size_t>(p.rank) * stride,
                    out_off + 8 * static_cast<size_t>(j) * stride, 8 * static_cast<size_t>(n),
                    GinSignalId(p.rank, kGinControlChannel));
    }
  }

  // ---- receiving (warp-wide; false after a reported timeout)

  // Row `pos` of the `n` rows source s sends me this op, into my [s][pos].
  __device__ __forceinline__ bool WaitRow(Op op, int s, int pos, int n, unsigned long long t0) const {
    if (Gin(s)) {
      const int ch = pos / geo.rows;
      return GinWaitSignalWarp(p, op, GinSignalId(s, ch), GinExpected(p, s, ch, 1), s, t0);
    }
    const int ch = pos / chunk;
    const uint32_t expected = static_cast<uint32_t>(min(chunk, n - ch * chunk));
    return WaitChunk(p, ChunkCounter(my, s, ch), expected, op, s, t0);
  }

  // One look, no wait: has row `pos` of the `n` rows source s sends me
  // arrived? A hint only (WaitRow still acquires it). Warp-wide.
  __device__ __forceinline__ bool RowArrived(Op op, int s, int pos, int n) const {
    int got = 0;
    if (LaneId() == 0) {
      if (Gin(s)) {
        const int ch = pos / geo.rows;
        got = GinReached(GinReadSignal(p, op, GinSignalId(s, ch)), GinExpected(p, s, ch, 1));
      } else {
        const int ch = pos / chunk;
        got = *reinterpret_cast<volatile uint32_t*>(ChunkCounter(my, s, ch)) >=
              static_cast<uint32_t>(min(chunk, n - ch * chunk));
      }
    }
    return __shfl_sync(kFullMask, got, 0) != 0;
  }

  // The `rows` rows of token chunk `ch` (RowsPerChunk(s) tokens) that
  // source s puts one at a time (expert-layout combine).
  __device__ __forceinline__ bool WaitTokenChunk(Op op, int s, int ch, uint32_t rows,
                                                 unsigned long long t0) const {
    if (Gin(s)) return GinWaitSignalWarp(p, op, GinSignalId(s, ch), GinExpected(p, s, ch, rows), s, t0);
    return WaitChunk(p, ChunkCounter(my, s, ch), rows, op, s, t0);
  }

  // Draining after a mismatch: how many counts source s's `announced`
  // rows make (LSA: rows; GIN: puts, one per chunk of geo.rows, or one per
  // row with `row_puts`), and this lane's part of what has arrived so far
  // (sum it over the warp; `nch` LSA chunks).
  __device__ __forceinline__ int AnnouncedCounts(int s, int announced, bool row_puts) const {
    return !Gin(s) || row_puts ? announced : NumChunks(announced, geo.rows);
  }
  __device__ __forceinline__ int ArrivedPart(Op op, int s, int nch) const {
    int got = 0;
    const int lane = LaneId();
    if (Gin(s)) {
      if (lane < kGinDataChannels)
        got = static_cast<int>(GinReadSignal(p, op, GinSignalId(s, lane)) - GinExpected(p, s, lane, 0));
    } else {
      for (int ch = lane; ch < nch; ch += 32)
        got += static_cast<int>(*reinterpret_cast<volatile uint32_t*>(ChunkCounter(my, s, ch)));
    }
    return got;
  }
};

}  // namespace jax_ep
