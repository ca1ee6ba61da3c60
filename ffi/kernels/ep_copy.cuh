// Device helpers shared by the normal dispatch / combine kernels: 16-byte
// global loads/stores with cache hints, warp helpers, chunk counters. The
// control words and the "publish ok + rank barrier" step are peer verbs
// (peer.cuh, barrier.cuh).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "barrier.cuh"
#include "common.cuh"
#include "gin.cuh"
#include "peer.cuh"
#include "window_layout.h"

namespace jax_ep {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kUnroll = 4;    // 16-byte loads in flight per lane (benchmarks/RESULTS.md)
constexpr int kMaxTopk = 32;  // one lane per top-k slot

// Data that no one writes while the kernel runs (inputs x, y; a peer window
// filled before a barrier an earlier kernel passed): bypass L1, read once.
__device__ __forceinline__ uint4 LdNcNa(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Data written by a peer before a barrier that an earlier kernel passed:
// an ordinary (coherent) load.
__device__ __forceinline__ uint4 LdV4(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Data a peer wrote during this kernel, read after an acquire of the word
// that announced it: cached in L2 only, never a stale L1 line.
__device__ __forceinline__ uint4 LdCg(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}
__device__ __forceinline__ int32_t LdCgI32(const int32_t* ptr) {
  int32_t v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
}

// Store that does not allocate in L1 (local output or a peer's window).
__device__ __forceinline__ void StNa(uint4* ptr, const uint4& v) {
  asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// A warp moves a row in chunks of 32 * kUnroll 16-byte vectors: lane `lane`
// holds vectors base + u * 32 + lane (u < kUnroll), those below `nvec`.
__device__ __forceinline__ void LoadChunk(const uint4* src, int base, int nvec, int lane,
                                          uint4 (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int idx = base + u * 32 + lane;
    if (idx < nvec) v[u] = LdV4(src + idx);
  }
}
__device__ __forceinline__ void StoreChunk(uint4* dst, int base, int nvec, int lane,
                                           const uint4 (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int idx = base + u * 32 + lane;
    if (idx < nvec) StNa(dst + idx, v[u]);
  }
}

__device__ __forceinline__ int LaneId() { return threadIdx.x & 31; }

// Pointer held by lane `src` (all lanes participate).
template <typename P>
__device__ __forceinline__ P* ShflPtr(P* ptr, int src) {
  return reinterpret_cast<P*>(
      __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(ptr), src));
}

// Index of the n-th set bit of `mask` (n < popc(mask)).
__device__ __forceinline__ int NthSetBit(unsigned mask, int n) {
  for (int i = 0; i < n; ++i) mask &= mask - 1;
  return __ffs(mask) - 1;
}

// ---------------------------------------------------------------- chunk counters
// See window_layout.h. Counter of chunk c from source `src` in `owner`'s window.
__device__ __forceinline__ uint32_t* ChunkCounter(char* owner_base, int src, int c) {
  return reinterpret_cast<uint32_t*>(owner_base + kChunkCountersOffset) +
         static_cast<size_t>(src) * kChunksPerSource + c;
}

// Zero the counters that sources may use in this op (n chunks each). The
// caller fences and passes a rank barrier before any peer adds again.
__device__ inline void ZeroChunkCounters(const EpPeers& p, int n) {
  uint32_t* c0 = ChunkCounter(MyWindow(p), 0, 0);
  for (int i = threadIdx.x; i < p.nranks * kChunksPerSource; i += blockDim.x) {
    if (i % kChunksPerSource < n) c0[i] = 0u;
  }
}

// One thread: wait until `n` blocks of this launch have counted `*done` up
// (each adds 1 once its writes are fenced), then reset it for the next op
// and order their writes before this thread's later reads. Those blocks
// never wait, so this ends unless the GPU cannot schedule them beside this
// one (a partition of one SM): then it reports after the op's timeout and
// returns false, having taken the n off the count, so that the late
// blocks' adds bring it back to zero for the next op.
__device__ inline bool WaitBlocksDone(const EpPeers& p, unsigned long long* done, int n, Op op) {
  volatile unsigned long long* v = done;
  const unsigned long long t0 = globaltimer_ns();
  while (*v < static_cast<unsigned long long>(n)) {
    if (globaltimer_ns() - t0 > p.timeout_ns) {
      report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(p.rank));
      atomicAdd(done, 0ull - static_cast<unsigned long long>(n));
      return false;
    }
    __nanosleep(64);
  }
  *v = 0;
  __threadfence();
  return true;
}

// The warp has finished storing its rows to the destinations in `mask`; lane
// j holds the chunk counter of its row in rank j's window. Make the rows
// visible system-wide, then count each. bar.warp.sync orders the other
// lanes' stores before lane 0's fence, which is cumulative.
__device__ __forceinline__ void CountRowsDone(uint32_t* counter, unsigned mask) {
  __syncwarp();
  if (LaneId() == 0) __threadfence_system();
  for (unsigned m = mask; m; m &= m - 1) {
    uint32_t* c = ShflPtr(counter, __ffs(m) - 1);
    if (LaneId() == 0) asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
  }
}

// Warp-wide wait until `counter` reaches `expected` (acquire; the warp may
// then load the chunk's rows). False after reporting a timeout. The status
// word is not looked at: a wait only happens once every rank has agreed to
// send, and a receiver that has failed on its own must still drain the
// chunks (late adds would corrupt the next op's counters).
__device__ inline bool WaitChunk(const EpPeers& p, const uint32_t* counter, uint32_t expected,
                                 Op op, int src, unsigned long long t0) {
  int ok = 1;
  if (LaneId() == 0) {
    unsigned polls = 0;
    for (;;) {
      uint32_t v;
      asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (v >= expected) break;
      // Hundreds of warps poll: back off so the polls do not crowd the L2
      // slices that the peer's row stores and counter adds go through.
      __nanosleep(128);
      if ((++polls & 63u) == 0u && globaltimer_ns() - t0 > p.timeout_ns) {
        report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(src));
        ok = 0;
        break;
      }
    }
  }
  ok = __shfl_sync(kFullMask, ok, 0);
  __syncwarp();
  return ok != 0;
}

}  // namespace jax_ep
