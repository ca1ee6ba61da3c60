// Bulk (TMA) row copies for the normal dispatch: one lane moves a whole row
// global -> shared -> global, so a warp keeps up to two rows in flight without
// holding them in registers (docs/design.md §1).
//
// Why: with register copies a warp has 2 KiB in flight (32 lanes x kUnroll
// x 16 B) and spends its issue slots on 16-byte loads and stores per
// destination; a bulk copy puts a whole 14 KiB row in flight per slot and
// fans it out to every destination from shared memory with one instruction
// each.
//
// Ordering (PTX memory model, async proxy): a bulk store's writes are
// complete for the issuing thread after cp.async.bulk.wait_group; the
// proxy fence then orders them before that thread's generic release (the
// chunk count), so a peer that acquires the count sees the row. A receiver
// that acquired a count fences the same way before its bulk load reads the
// row.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

// Bulk copies and mbarriers with transaction counts need sm_90. On other
// targets the methods trap; the host never selects bulk copies there
// (BulkCopiesEnabled checks the device).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define JAX_EP_BULK_ASM(...) __trap()
#else
#define JAX_EP_BULK_ASM(...) asm volatile(__VA_ARGS__)
#endif

namespace jax_ep {

// Two row slots per warp, 16 warps per CTA where the slots fit, else 8
// (H100/H200: 227 KiB of dynamic shared memory per CTA, 1 KiB kept for the
// kernel's static shared memory). Rows are latency-bound per warp (measured:
// FP8 rows of 7 KiB took as long as BF16 rows of 14 KiB with 8 warps), so
// short rows get more warps rather than deeper slots.
constexpr int kBulkSlots = 2;
constexpr int kBulkMaxWarps = 16;
constexpr size_t kBulkSmemBytes = 227 * 1024 - 1024;
constexpr size_t kBulkMaxRowBytes = kBulkSmemBytes / (8 * kBulkSlots) / 16 * 16;

// Warps per CTA for slots of `slot_bytes`: 16, 8, or 0 (no bulk copies).
inline int BulkWarpsFor(size_t slot_bytes) {
  if (slot_bytes * kBulkSlots * kBulkMaxWarps <= kBulkSmemBytes) return kBulkMaxWarps;
  return slot_bytes <= kBulkMaxRowBytes ? 8 : 0;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One warp's slots: `buf` (kBulkSlots rows of `slot_bytes`), one mbarrier
// per slot, the slots' phase bits and which slot is next. Warp-collective:
// every lane calls every method with the same arguments (so every lane
// keeps the same bookkeeping); lane 0 issues the copies.
struct BulkSlots {
  char* buf;
  uint64_t* bar;
  uint32_t slot_bytes;
  uint32_t phases;  // bit s: parity the next wait on slot s expects
  int next;         // the slot the next Begin takes

  __device__ static bool Issuer() { return (threadIdx.x & 31) == 0; }
  __device__ char* Slot(int s) const { return buf + static_cast<size_t>(s) * slot_bytes; }

  __device__ void Init() {
    if (Issuer()) {
      for (int s = 0; s < kBulkSlots; ++s)
        JAX_EP_BULK_ASM("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SmemAddr(bar + s)) : "memory");
      JAX_EP_BULK_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    phases = 0;
    next = 0;
    __syncwarp();
  }

  // Take the next slot for `bytes` of loads (LoadPart), once the bulk stores
  // that last read it have read it and the lanes are done reading it.
  // kReadPending: how many of the newest committed groups may still be
  // reading their slots. A warp that commits every row before it loads the
  // next leaves the other slot's group newest (kBulkSlots - 1); one that
  // loads the next row while the current one still sits uncommitted in the
  // other slot (prefetch) needs every committed group to have read (0).
  template <int kReadPending = kBulkSlots - 1>
  __device__ int Begin(uint32_t bytes) {
    const int s = next;
    next = (next + 1) % kBulkSlots;
    __syncwarp();
    if (Issuer()) {
      JAX_EP_BULK_ASM("cp.async.bulk.wait_group.read %0;" ::"n"(kReadPending) : "memory");
      // Lanes may have read the slot with ordinary loads (combine's reduce).
      JAX_EP_BULK_ASM("fence.proxy.async.shared::cta;" ::: "memory");
      JAX_EP_BULK_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar + s)), "r"(bytes)
                   : "memory");
    }
    return s;
  }
  // Load `bytes` from `src` to offset `off` of slot s (part of Begin's bytes).
  __device__ void LoadPart(int s, uint32_t off, const void* src, uint32_t bytes) const {
    if (Issuer())
      JAX_EP_BULK_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(SmemAddr(Slot(s) + off)), "l"(src), "r"(bytes), "r"(SmemAddr(bar + s))
                   : "memory");
  }
  template <int kReadPending = kBulkSlots - 1>
  __device__ int Load(const void* src, uint32_t bytes) {
    const int s = Begin<kReadPending>(bytes);
    LoadPart(s, 0, src, bytes);
    return s;
  }

  // Wait until slot s holds what Begin announced (every lane then sees it).
  // Only a byte count that disagrees with the loads (a bug) can make this
  // wait forever: trap after 5 s rather than hang.
  __device__ void Wait(int s) {
    const uint32_t b = SmemAddr(bar + s);
    const uint32_t parity = (phases >> s) & 1u;
    uint32_t done = 0;
    unsigned long long t0 = 0;
    for (unsigned polls = 0; !done; ++polls) {
      if ((polls & 1023u) == 1023u) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (t0 == 0) t0 = now;
        else if (now - t0 > 5000000000ull) __trap();
      }
      JAX_EP_BULK_ASM(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(b), "r"(parity)
          : "memory");
    }
    phases ^= 1u << s;
  }

  // Store slot s's first `bytes` to `dst` (16-byte aligned global memory:
  // an output row or a peer's window row).
  __device__ void Store(int s, void* dst, uint32_t bytes) const {
    if (Issuer())
      JAX_EP_BULK_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                   "r"(SmemAddr(Slot(s))), "r"(bytes)
                   : "memory");
  }
  // The stores of one row form a group (also when there are none, so that
  // groups and slots stay in step).
  __device__ void Commit() const {
    if (Issuer()) JAX_EP_BULK_ASM("cp.async.bulk.commit_group;" ::: "memory");
  }

  // Every group but the newest has written its rows, ordered before the
  // issuing lane's later generic releases (CountRowsDone fences on lane 0).
  __device__ void WaitAllButNewest() const {
    if (Issuer()) {
      JAX_EP_BULK_ASM("cp.async.bulk.wait_group 1;" ::: "memory");
      JAX_EP_BULK_ASM("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
  }
  // Every group has written its rows (and read its slot: before exit).
  __device__ void WaitAll() const {
    if (Issuer()) {
      JAX_EP_BULK_ASM("cp.async.bulk.wait_group 0;" ::: "memory");
      JAX_EP_BULK_ASM("fence.proxy.async.global;" ::: "memory");
    }
    __syncwarp();
  }
};

// This warp's slots in a kernel with `bars` (kBulkSlots per warp) and
// dynamic shared memory `rows` (kBulkSlots slots of `slot_bytes` per warp),
// initialised when kOn (kernels instantiated without bulk copies get an
// unused value).
template <bool kOn>
__device__ __forceinline__ BulkSlots WarpBulkSlots(char* rows, uint64_t* bars, uint32_t slot_bytes) {
  const int warp = static_cast<int>(threadIdx.x >> 5);
  BulkSlots b{rows + static_cast<size_t>(warp) * kBulkSlots * slot_bytes, bars + (kOn ? warp * kBulkSlots : 0),
              slot_bytes, 0u, 0};
  if constexpr (kOn) b.Init();
  return b;
}

// Lets `kernel` take `smem` bytes of dynamic shared memory. The setting is
// per device, so it is made on every launch (a host call; one process may
// drive several GPUs).
template <typename Kernel>
inline cudaError_t AllowBulkSmem(Kernel kernel, size_t smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

// After acquiring a peer's count (generic proxy, lane 0 or the whole warp):
// order the warp's next bulk loads of the rows it announced after that
// acquire.
__device__ __forceinline__ void FenceBeforeBulkRead() {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) JAX_EP_BULK_ASM("fence.proxy.async.global;" ::: "memory");
}

}  // namespace jax_ep
