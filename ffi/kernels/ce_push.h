// Remote rows by copy engine (LSA peers): the data kernels stage each
// destination's rows in this rank's own window (HBM stores, no NVLink), and a
// second stream moves every staged chunk to the destination's window with
// cudaMemcpyAsync, then copies the barrier epoch into the destination's
// arrived flag. The receiving CTAs wait on that flag instead of the chunk
// counters.
//
// Why: on H200 the SM's 16-byte NVLink stores stream at ~0.55-0.67 x of
// what the copy engine moves (benchmarks/RESULTS.md), however many CTAs push.
// Status (2026-11-30, RESULTS.md "Copy-engine path"): bitwise correct, but
// slower than SM stores at the Normal shape (dispatch 419 vs 346 us, combine
// 336 vs 311 us): each 7.4 MB copy runs at ~342 GB/s, yet the staged chunks
// come ready irregularly (one slow warp holds a chunk back), each chunk adds
// ~7 us of flag copy + wait, and calls leave idle gaps. So it is opt-in.
//
// Why a fixed-size copy: cudaMemcpyAsync takes its size from the host, and
// the host never sees the routing. Each destination's whole T-row slot is
// copied, in `copies` chunks; the bytes past its real rows are never read.
// That costs nothing at R = 2 with top-k >= 4 (almost every token goes to
// both ranks) and up to (R-1)x the needed bytes when routing is skewed, so
// the mode is chosen by UseCopyEngine (env JAX_EP_REMOTE).
//
// Order of one op, s = XLA's stream, q = this device's copy-engine stream:
//   s: prep/control (barriers passed) -> record fork -> data kernel -> wait join
//   q: wait fork; per chunk c, per peer j: wait ready[j][c] == seq (set by the
//      data kernel once chunk c's rows are staged), copy the rows to j's
//      recv[me], copy the epoch word to j's arrived[me][c]; record join.
// Three orderings matter:
//  - The fork is recorded before the data kernel: were q to wait for the
//    data kernel, whose receivers wait for the peer's copies, two ranks
//    would wait on each other.
//  - q's work is enqueued *after* the data kernel's launch: streams can
//    share a hardware queue (CUDA_DEVICE_MAX_CONNECTIONS), and a wait on a
//    ready flag queued ahead of the kernel that raises it never ends.
//  - The last CTA of the data kernel raises every ready flag on its way out
//    (CeReleaseOnExit): should a flag stay down (a bug), q still finishes
//    once the data kernel has (the peer's receivers time out and report), so
//    the op ends with an error instead of a hang.
// The join keeps the next op (which reuses the window) behind the copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "common.cuh"

namespace jax_ep {

// One per local device (DeviceResources), made by CreateComm.
struct CeLane {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  uint32_t seq = 0;  // ops so far; the value of this op's ready flags
};

cudaError_t CreateCeLane(CeLane& lane);
void DestroyCeLane(CeLane& lane);

// What moves in one op: [stage_off + (j*T + row) * row_bytes] of this rank's
// window to [recv_off + (me*T + row) * row_bytes] of rank j's, rows [0, T).
struct CeCopy {
  size_t stage_off = 0;
  size_t recv_off = 0;
  size_t row_bytes = 0;
  int T = 0;
  int chunk_rows = 0;  // CeChunkRows(T, copies)
  uint32_t seq = 0;    // lane.seq after NextCeSeq
};

// True when this op's remote rows go by copy engine: every peer is LSA,
// R >= 2 and JAX_EP_REMOTE=ce ("auto", the default, and "sm" mean SM
// stores). Must give the same answer on every rank.
bool UseCopyEngine(int num_ranks, uint32_t gin_mask);
// Copies per destination slot (env JAX_EP_CE_COPIES, default 8).
int CeCopies();

// Records the fork on `s` (call before launching the data kernel).
cudaError_t CeFork(CeLane& lane, cudaStream_t s);
// After the data kernel's launch: q's side of the op (see above), and `s`
// waiting for q.
cudaError_t EnqueueCeCopies(CeLane& lane, const EpPeers& p, const CeCopy& c, cudaStream_t s);

// The copy of an op whose window (DispatchWindow / CombineWindow) stages
// rows at stage_off and receives them at recv_off.
template <typename Window>
CeCopy CeCopyOf(const Window& w, int T, int chunk_rows, uint32_t seq) {
  CeCopy c;
  c.stage_off = w.stage_off;
  c.recv_off = w.recv_off;
  c.row_bytes = w.row_bytes;
  c.T = T;
  c.chunk_rows = chunk_rows;
  c.seq = seq;
  return c;
}

}  // namespace jax_ep
