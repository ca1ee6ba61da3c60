// Device-side plumbing shared by every jax_ep kernel: the view of the
// symmetric window that a kernel gets, the status word, and the cross-rank
// barrier with a timeout. No NCCL types here, so kernels stay testable
// against plain peer pointers.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace jax_ep {

constexpr int kMaxRanks = 8;

// Bytes at the start of every rank's window that belong to the runtime:
// barrier flags (one 64-bit slot per source rank) and scratch counters.
// Ops lay out their own data from kWindowHeaderBytes on.
constexpr size_t kWindowHeaderBytes = 4096;
constexpr size_t kBarrierFlagsOffset = 0;  // uint64_t[kMaxRanks]

// Status word: 0 = fine. Otherwise (op << 16) | (cause << 8) | detail.
// The first error wins (atomicCAS from 0); the host reads it through
// mapped pinned memory before the next launch on the same communicator.
enum class Op : uint32_t {
  kNone = 0, kLayout = 1, kProbe = 2, kDispatch = 3, kCombine = 4,
  kLowLatencyDispatch = 5, kLowLatencyCombine = 6, kEngramFetch = 7,
};
enum class Cause : uint32_t {
  kNone = 0, kBadExpertId = 1, kCapacityOverflow = 2, kPeerTimeout = 3,
  kBadIndex = 4, kWindowTooSmall = 5,
};

// What a kernel knows about the communicator, passed by value.
struct EpPeers {
  char* base[kMaxRanks];          // each rank's window, mapped here (LSA)
  int rank;
  int nranks;
  size_t window_bytes;
  uint32_t* status;               // mapped pinned host word (device pointer)
  unsigned long long* epoch;      // device-local barrier epoch counter
  unsigned long long* grid_sync;  // device-local, 0 between kernels (CeReleaseOnExit)
  unsigned long long timeout_ns;  // give up waiting on a peer after this
  uint32_t gin_mask;              // bit j: rank j is reached by GIN, base[j] is null
  const void* gin;                // GIN state (gin.cuh's GinComm), null without GIN
};

__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void report_error(const EpPeers& p, Op op, Cause cause,
                                             uint32_t detail = 0) {
  uint32_t code = (static_cast<uint32_t>(op) << 16) |
                  (static_cast<uint32_t>(cause) << 8) | (detail & 0xffu);
  atomicCAS_system(p.status, 0u, code);
  __threadfence_system();
}

__device__ __forceinline__ bool has_error(const EpPeers& p) {
  return *reinterpret_cast<volatile uint32_t*>(p.status) != 0u;
}

__device__ __forceinline__ uint64_t* barrier_flags(const EpPeers& p, int rank) {
  return reinterpret_cast<uint64_t*>(p.base[rank] + kBarrierFlagsOffset);
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t* ptr, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

// Cross-rank barrier, called by ONE thread (after the caller has made its
// CTA's / grid's writes visible). Every rank runs the same sequence of ops, so
// the epoch counters agree. Returns false (and reports) on timeout.
__device__ inline bool rank_barrier(const EpPeers& p, Op op) {
  const uint64_t e = *p.epoch + 1;
  *p.epoch = e;
  // fence.sc.sys followed by relaxed stores is a release pattern for every
  // flag: one MEMBAR.SYS instead of one per st.release.sys.
  __threadfence_system();
  for (int r = 0; r < p.nranks; ++r) st_relaxed_sys(barrier_flags(p, r) + p.rank, e);
  const uint64_t* mine = barrier_flags(p, p.rank);
  const unsigned long long t0 = globaltimer_ns();
  // The status word is mapped host memory: one read is a PCIe round trip
  // (~1 µs), so the spin looks at it only every 256 polls, not every poll.
  unsigned polls = 0;
  for (int r = 0; r < p.nranks; ++r) {
    while (ld_acquire_sys(mine + r) < e) {
      if ((++polls & 255u) == 0u && has_error(p)) return false;
      if (globaltimer_ns() - t0 > p.timeout_ns) {
        report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(r));
        return false;
      }
    }
  }
  return true;
}

}  // namespace jax_ep
