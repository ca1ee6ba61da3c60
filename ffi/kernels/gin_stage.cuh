// Rows to GIN peers in the normal dispatch / combine: how they are chunked,
// sent and waited for (the transport itself is gin.cuh).
//
// A sender stages its rows for GIN peer j in its own window (the stage area,
// window_layout.h), counts them on its own chunk
// counters, and the warp that completes a chunk puts the whole chunk to j's
// receive area with the chunk's data signal: channel = chunk index, so chunk
// c of source s is vouched for by signal GinSignalId(s, c) on the receiver.
// Only chunks that hold rows are sent, and the receiver knows which from the
// counts exchange, so every signal it waits for advances by exactly one per
// op (per row in expert-layout combine, where rows go one at a time).
//
// Expected values: signals are never reset. Each op's start kernel copies
// this rank's signal values into EpPeers::gin_snapshot before its first
// barrier; no peer can signal this op's data before that barrier, and every
// signal of the previous op was waited for (receivers drain what was sent
// even when they fail), so "snapshot + what this op sends" is exact.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "ep_copy.cuh"
#include "gin.cuh"
#include "window_layout.h"

namespace jax_ep {

// Rows per GIN chunk for a T-row slot: the chunk counters' size, or longer so
// that the chunks fit the data channels.
JAX_EP_HD int GinChunkRows(long long T) {
  const int base = ChunkRows(T);
  const long long need = (T + kGinDataChannels - 1) / kGinDataChannels;
  return static_cast<int>(need > base ? need : base);
}

// This rank's signals from every GIN source into p.gin_snapshot. All threads
// of one block, before the op's first barrier (the caller __syncthreads
// before thread 0 enters it).
__device__ inline void GinSnapshotSignals(const EpPeers& p, Op op) {
  if (p.gin_mask == 0) return;
  for (int i = threadIdx.x; i < p.nranks * kGinChannels; i += blockDim.x) {
    if ((p.gin_mask >> (i / kGinChannels)) & 1u)
      p.gin_snapshot[i] = GinReadSignal(p, op, static_cast<uint32_t>(i));
  }
}

// What signal (src, channel) reads once `n` more increments of this op have
// landed.
__device__ __forceinline__ uint64_t GinExpected(const EpPeers& p, int src, int channel, uint32_t n) {
  return p.gin_snapshot[src * kGinChannels + channel] + n;
}

// Where chunk `ch` of my rows for rank j sits in my window, and where it
// goes in j's: stage[j][ch * rows] -> recv[me][ch * rows] (dispatch, and
// rank-layout combine: the same [R][T] row geometry).
struct GinChunkGeometry {
  size_t stage_off, recv_off, row_bytes;
  int T, rows;
  __device__ size_t Src(int j, int ch) const {
    return stage_off + (static_cast<size_t>(j) * T + static_cast<size_t>(ch) * rows) * row_bytes;
  }
  __device__ size_t Dst(int me, int ch) const {
    return recv_off + (static_cast<size_t>(me) * T + static_cast<size_t>(ch) * rows) * row_bytes;
  }
};

// The warp has staged its rows for the GIN peers in `mask`; lane j holds its
// row's chunk `ch` (< kGinDataChannels), the chunk's local counter and the
// number of rows that chunk holds. As CountStaged (fence, then count); the
// warp whose count completes a chunk puts it, with the chunk's signal.
// `channels` collects the channels this warp put on (for GinFlushWarp).
// All 32 lanes.
__device__ inline void GinCountStaged(const EpPeers& p, Op op, const GinChunkGeometry& g,
                                      uint32_t* counter, uint32_t rows, int ch, unsigned mask,
                                      uint32_t& channels) {
  __syncwarp();
  if (LaneId() == 0) __threadfence_system();
  for (unsigned m = mask; m; m &= m - 1) {
    const int j = __ffs(m) - 1;
    uint32_t* c = ShflPtr(counter, j);
    const uint32_t n = __shfl_sync(kFullMask, rows, j);
    const int cj = __shfl_sync(kFullMask, ch, j);
    int done = 0;
    if (LaneId() == 0) done = atomicAdd(c, 1u) + 1u == n;
    done = __shfl_sync(kFullMask, done, 0);
    if (!done) continue;
    // Acquire side of the other warps' fence-then-count: their rows are
    // visible to this warp before it reads them for the put.
    __threadfence();
    __syncwarp();
    GinPutWarp(p, op, j, g.Dst(p.rank, cj), g.Src(j, cj), static_cast<size_t>(n) * g.row_bytes,
               GinSignalId(p.rank, cj));
    channels |= 1u << cj;
  }
}

}  // namespace jax_ep
