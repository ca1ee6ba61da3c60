// Device-side plumbing shared by every jax_ep kernel: the view of the
// symmetric window that a kernel gets and the status word. No NCCL types
// here, so kernels stay testable against plain peer pointers. (The
// cross-rank barrier, which may need GIN, is in barrier.cuh.)
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace jax_ep {

constexpr int kMaxRanks = 8;

// Number of LSA barriers the device communicator is created with (one per
// CTA that synchronises with its peers' CTAs through it). Kernels launching
// more CTAs than this must not use ncclLsaBarrierSession with blockIdx.x as
// the index.
constexpr int kLsaBarrierCount = 64;

// Bytes at the start of every rank's window that belong to the runtime:
// barrier flags (one 64-bit slot per source rank) and scratch counters.
// Ops lay out their own data from kWindowHeaderBytes on.
constexpr size_t kWindowHeaderBytes = 4096;
constexpr size_t kBarrierFlagsOffset = 0;  // uint64_t[kMaxRanks]
// Transport "gin_emulated": the GIN signal counters that peers add to
// (gin.cuh), u64 per signal id, in the upper half of the header. A real GIN
// keeps its signals inside NCCL, so nothing is written here then.
constexpr size_t kGinEmuSignalsOffset = 2048;
// The op this rank is in and what it was called with (config_check.cuh).
constexpr int kOpConfigFields = 8;
constexpr size_t kOpConfigBytes = 8 + 4 * kOpConfigFields;
constexpr size_t kOpConfigOffset = 1024;
static_assert(kBarrierFlagsOffset + 8 * kMaxRanks <= kOpConfigOffset &&
                  kOpConfigOffset + kOpConfigBytes <= kGinEmuSignalsOffset,
              "the header's parts do not overlap");
// The low-latency ops' refusals from GIN peers (low_latency_peers.cuh):
// u64 [2 (dispatch, combine)][kMaxRanks], a source rank's word tagged with
// the sequence number of the call it refused. An LSA peer reads the
// refuser's OpConfig record instead; a GIN peer cannot map it.
constexpr size_t kLlRefusalsOffset = 1792;
static_assert(kOpConfigOffset + kOpConfigBytes <= kLlRefusalsOffset &&
                  kLlRefusalsOffset + 16 * kMaxRanks <= kGinEmuSignalsOffset,
              "the low-latency refusal words overlap another part of the header");
// [1280, 1792) of the header: the Engram GIN exchange's control words
// (engram_layout.h kEngramGinWordsOffset).
// The status allocation (mapped pinned host memory, EpPeers::status): the
// u64 status word, then on a configuration mismatch the two records that
// differ [mine, the peer's], which the host reads with plain loads (no CUDA
// call in the error path, which may run during a stream capture).
constexpr size_t kStatusReportOffset = 8;
constexpr size_t kStatusBytes = kStatusReportOffset + 2 * kOpConfigBytes;

// Status word: 0 = fine. Otherwise (op << 16) | (cause << 8) | detail.
// The first error wins (atomicCAS from 0); the host reads it through
// mapped pinned memory before the next launch on the same communicator.
enum class Op : uint32_t {
  kNone = 0, kLayout = 1, kProbe = 2, kDispatch = 3, kCombine = 4,
  kLowLatencyDispatch = 5, kLowLatencyCombine = 6, kEngramFetch = 7,
};
enum class Cause : uint32_t {
  kNone = 0, kBadExpertId = 1, kCapacityOverflow = 2, kPeerTimeout = 3,
  kBadIndex = 4, kWindowTooSmall = 5, kStalePublication = 6, kOutOfOrder = 7,
  kPeerRefused = 8, kConfigMismatch = 9,
};

// A barrier flag with this bit set: the rank that wrote it refused its call
// before launching it and stands for every barrier up to the value in the
// other bits (abort.h), so peers waiting there fail at once.
constexpr unsigned long long kBarrierRefusedBit = 1ull << 63;

// Device counter slot (comm.h) the dispatch setup kernel's prep blocks
// count up as they finish; its control block waits for them and resets it.
constexpr int kDispatchPrepCounter = 1;
// The expert-layout combine's scanner blocks: the rows they found per source
// rank and a bad-row flag (slots 16..24), how many are done (slot 25); the
// control block reads and resets them. (Slots 2..15: low_latency.cuh.)
constexpr int kCombineScanCounters = 16;
constexpr int kCombineScanDoneCounter = kCombineScanCounters + kMaxRanks + 1;

// What a kernel knows about the communicator, passed by value.
struct EpPeers {
  char* base[kMaxRanks];          // each rank's window, mapped here (LSA)
  int rank;
  int nranks;
  size_t window_bytes;
  // Mapped pinned host words (device pointer): one u64, the first error's
  // code in the low half and the low 32 bits of `call` of the op that
  // reported it in the high half, written together (so the host never sees
  // one without the other).
  uint32_t* status;
  unsigned long long call;        // this op's number on its device (AcquireDevice)
  unsigned long long* epoch;      // device-local barrier epoch counter
  unsigned long long timeout_ns;  // give up waiting on a peer after this
  uint32_t gin_mask;              // bit j: rank j is reached by GIN, base[j] is null
  const void* gin;                // GIN state (gin.cuh's GinComm), null without GIN
  // Transport "gin_emulated": rank j's window, mapped over NVLink, for
  // gin.cuh's emulated puts alone (base[j] stays null for a GIN peer, so a
  // kernel that forgets to branch on gin_mask faults instead of passing).
  // All null otherwise.
  char* gin_emu[kMaxRanks];
  bool gin_emulated;
  // Device-local u64[kMaxRanks][kGinChannels]: this rank's signal values
  // taken at the start of the current op (gin_stage.cuh), null without GIN.
  unsigned long long* gin_snapshot;
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
  // Only the first error is kept, with the number of the call that made it
  // (a deferred report must name the call, not the one that finds it).
  const unsigned long long word =
      (static_cast<unsigned long long>(static_cast<uint32_t>(p.call)) << 32) | code;
  atomicCAS_system(reinterpret_cast<unsigned long long*>(p.status), 0ull, word);
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

}  // namespace jax_ep
