// How a kernel reaches another rank: the one interface, in op-agnostic
// verbs. A kernel names windows and peers only through it; which peer is
// reached how (LSA: NVLink loads/stores into its window mapped here; GIN:
// GPU-initiated RDMA, or its NVLink emulation) is decided here and in the
// files below, never in an op's own code (tests/test_source_layout.py).
//
//   where my bytes for peer j go   MyWindow / PeerWindow / ReachedByGin (here);
//                                  PeerTransport::RowSlot (transport.cuh)
//   bytes written with a signal    PeerTransport::RowsWritten / EndRowPut,
//                                  GinPut / GinPutWarp (gin.cuh)
//   wait for a signal              PeerTransport::WaitRow / WaitTokenChunk,
//                                  GinWaitSignalWarp (gin.cuh)
//   a control word                 PutControlWord, MakeTagged / TagMatches,
//                                  StU64Volatile / LdU64Volatile (here);
//                                  PublishOkAndBarrier, FirstPeerNotOk (barrier.cuh)
//   a barrier, refused bit         rank_barrier, refuse_barriers (barrier.cuh)
//   flush                          PeerTransport::Flush, GinFlushWarp (gin.cuh)
//
// Ops whose kernels have no GIN path yet (low latency, Engram) refuse a
// communicator with a GIN peer in their Validate* (AnyGinPeer), so they fail
// with a message instead of faulting on a null window.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "gin.cuh"

namespace jax_ep {

// This rank's own window.
__host__ __device__ __forceinline__ char* MyWindow(const EpPeers& p) { return p.base[p.rank]; }

// Rank j's window as mapped here (LSA): where my bytes for it go (j may be
// this rank). Null for a peer reached by GIN, whose window is not mapped.
__host__ __device__ __forceinline__ char* PeerWindow(const EpPeers& p, int j) { return p.base[j]; }

// Whether rank j is reached by GIN (then PeerWindow(p, j) is null).
__host__ __device__ __forceinline__ bool ReachedByGin(const EpPeers& p, int j) { return (p.gin_mask >> j) & 1u; }

// Whether any peer is reached by GIN.
__host__ __device__ __forceinline__ bool AnyGinPeer(const EpPeers& p) { return p.gin_mask != 0; }

// Control words: a u64 that one thread stores into a window (its own or a
// peer's) and another reads with plain volatile loads once a barrier or an
// acquire has ordered it; tagged with the op's epoch or sequence number in
// the high half so a reader tells this op's word from an earlier one.
__device__ __forceinline__ void StU64Volatile(uint64_t* ptr, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t LdU64Volatile(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t MakeTagged(uint64_t tag, uint32_t value) {
  return (tag << 32) | value;
}
__device__ __forceinline__ bool TagMatches(uint64_t word, uint64_t tag) {
  return (word >> 32) == (tag & 0xffffffffull);
}

// A control word for rank j at window offset `off` (u64): LSA peers get a
// store; a GIN peer gets a quiet put on the control channel from offset
// `stage_off` of this rank's window, where the caller has written the same
// word, so the next barrier signal vouches for it. One thread, before that
// barrier; the caller fences (__threadfence_system) before the barrier.
__device__ inline void PutControlWord(const EpPeers& p, int j, size_t off, size_t stage_off,
                                      uint64_t word, Op op) {
  if (ReachedByGin(p, j)) {
    StU64Volatile(reinterpret_cast<uint64_t*>(MyWindow(p) + stage_off), word);
    __threadfence();
    GinPutQuiet(p, op, j, off, stage_off, sizeof(uint64_t), GinSignalId(p.rank, kGinControlChannel));
  } else {
    StU64Volatile(reinterpret_cast<uint64_t*>(PeerWindow(p, j) + off), word);
  }
}

}  // namespace jax_ep
