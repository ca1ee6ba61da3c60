// Row copies through the Hopper bulk-copy (TMA) unit, one staging buffer per
// warp in shared memory.
//
// Why: a warp that copies with 16-byte register loads/stores keeps at most
// 32 * kUnroll * 16 B = 2 KiB in flight, so an SM moves only ~25-30 GB/s
// HBM -> HBM (measured: the dispatch receive copy, 58.5 MB in 90 µs on 24
// SMs), and the NVLink push of 24 SMs stayed at 0.7 x the copy engine. A bulk
// copy keeps a whole staging buffer (kTmaBufBytes) in flight per warp and
// costs one instruction, so the same SMs move several times more, and the
// loaded piece is stored to every destination of the row without reloading.
//
// Only lane 0 issues; the other lanes only take part in the shuffles that
// hand it destination pointers. Ordering rules:
//  - data a peer made visible through a counter (ld.acquire by lane 0) is
//    read by the async proxy only after fence.proxy.async (TmaAcquired);
//  - stores must be complete (wait_group 0) and fenced before the row is
//    counted or the kernel ends (TmaDrain).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "ep_copy.cuh"

namespace jax_ep {

constexpr uint32_t kTmaBufBytes = 6144;  // per warp: 32 warps -> 192 KiB of the SM's 227 KiB

// Dynamic shared memory a CTA of `warps` warps needs (buffers + mbarriers).
constexpr size_t TmaSmemBytes(int warps) { return static_cast<size_t>(warps) * (kTmaBufBytes + 8); }

struct WarpTma {
  uint32_t buf;    // shared address of this warp's staging buffer
  uint32_t mbar;   // its mbarrier (count 1)
  uint32_t phase;  // parity of the next completion
};

// Every warp of the CTA calls it once, before any copy (smem: dynamic,
// TmaSmemBytes(blockDim.x / 32) bytes).
__device__ __forceinline__ WarpTma TmaInit(char* smem) {
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int warps = static_cast<int>(blockDim.x >> 5);
  WarpTma t;
  t.buf = static_cast<uint32_t>(__cvta_generic_to_shared(smem + static_cast<size_t>(warp) * kTmaBufBytes));
  t.mbar = static_cast<uint32_t>(__cvta_generic_to_shared(
      smem + static_cast<size_t>(warps) * kTmaBufBytes + 8 * static_cast<size_t>(warp)));
  t.phase = 0;
  if (LaneId() == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(t.mbar) : "memory");
    // Make the initialised barrier visible to the bulk-copy (async) proxy.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncwarp();
  return t;
}

__device__ __forceinline__ void TmaAcquired() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Lane 0: wait until every bulk store this thread issued is complete, then
// make them visible system-wide (before a counter add / kernel end).
__device__ __forceinline__ void TmaDrainLane0() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __threadfence_system();
}

// Copy `bytes` (multiple of 16, 16-byte aligned ends) from src to every
// destination held by the lanes in masks ma (pointer pa) and mb (pointer
// pb). Whole warp; the stores may still be in flight on return.
__device__ inline void TmaRowCopy(WarpTma& t, const char* src, uint32_t bytes, char* pa, unsigned ma,
                                  char* pb, unsigned mb) {
  const int lane = LaneId();
  for (uint32_t off = 0; off < bytes; off += kTmaBufBytes) {
    const uint32_t n = bytes - off < kTmaBufBytes ? bytes - off : kTmaBufBytes;
    if (lane == 0) {
      // The buffer is free once the previous piece's stores have read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(t.mbar), "r"(n) : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(t.buf),
          "l"(src + off), "r"(n), "r"(t.mbar)
          : "memory");
      uint32_t done = 0;
      while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(t.mbar), "r"(t.phase)
            : "memory");
      }
    }
    t.phase ^= 1u;
    for (unsigned m = ma; m; m &= m - 1) {
      char* d = ShflPtr(pa, __ffs(m) - 1);
      if (lane == 0)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + off), "r"(t.buf), "r"(n)
                     : "memory");
    }
    for (unsigned m = mb; m; m &= m - 1) {
      char* d = ShflPtr(pb, __ffs(m) - 1);
      if (lane == 0)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + off), "r"(t.buf), "r"(n)
                     : "memory");
    }
    if (lane == 0) asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  __syncwarp();
}

// JAX_EP_TMA=0 selects the register-copy kernels (for comparison); read once.
bool UseTma();

}  // namespace jax_ep
