// How a kernel reaches another rank: the one interface, in op-agnostic
// verbs. A kernel names windows and peers only through it; which peer is
// reached how (LSA: NVLink loads/stores into its window mapped here; GIN:
// GPU-initiated RDMA, or its NVLink emulation) is decided here and in the
// files below, never in an op's own code (tests/test_source_layout.py).
//
//   where my bytes for peer j go   MyWindow / PeerWindow / ReachedByGin, BytesFor
//                                  (here); PeerTransport::RowSlot (transport.cuh)
//   bytes written with a signal    PutBytes / PutBytesWarp / SignalPeer (here);
//                                  PeerTransport::RowsWritten / EndRowPut,
//                                  GinPut / GinPutWarp (gin.cuh)
//   wait for a signal              PeerSignalReached / WaitPeerSignalWarp (here);
//                                  PeerTransport::WaitRow / WaitTokenChunk,
//                                  GinWaitSignalWarp (gin.cuh)
//   a control word                 PutControlWord, MakeTagged / TagMatches,
//                                  StU64Volatile / LdU64Volatile (here);
//                                  PublishOkAndBarrier, FirstPeerNotOk (barrier.cuh)
//   a barrier, refused bit         rank_barrier, refuse_barriers (barrier.cuh)
//   flush                          FlushPeers / FlushPeersWarp (here);
//                                  PeerTransport::Flush, GinFlushWarp (gin.cuh)
//
// Every op that reaches a peer has a GIN path: dispatch / combine through
// transport.cuh, the low-latency kernels through low_latency_peers.cuh,
// Engram's fetch in engram_gin.cu. A handler whose op has none passes no
// gin_data_path to AcquireDevice (handlers/state.h), which refuses a
// communicator with a GIN peer, so the op fails with a message instead of
// faulting on a null window.
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

// Where my bytes for rank j at window offset `off` go: LSA: there, in j's
// window; GIN: offset `stage_off` of this rank's window, which a PutBytes*
// of the same range then carries to `off` on j.
__device__ __forceinline__ char* BytesFor(const EpPeers& p, int j, size_t off, size_t stage_off) {
  return ReachedByGin(p, j) ? MyWindow(p) + stage_off : PeerWindow(p, j) + off;
}

// The bytes BytesFor gave for j are written: LSA: nothing left to do; GIN:
// a put of [stage_off, +bytes) to j's `off` on `channel`, adding 1 to j's
// signal GinSignalId(this rank, channel) once they (and every earlier put on
// the channel's context) have landed when `signal`, else vouched for by the
// next signal on that context. The stage bytes stay unchanged until a
// FlushPeers* of the channel. False (reported) where the put cannot be had.
// PutBytes: one thread, whose writes (or those of threads it synchronised
// with) made the bytes; PutBytesWarp: all 32 lanes, the warp wrote them.
__device__ inline bool PutBytes(const EpPeers& p, Op op, int j, size_t off, size_t stage_off,
                                size_t bytes, int channel, bool signal) {
  if (!ReachedByGin(p, j)) return true;
  const uint32_t sig = GinSignalId(p.rank, channel);
  return signal ? GinPut(p, op, j, off, stage_off, bytes, sig)
                : GinPutQuiet(p, op, j, off, stage_off, bytes, sig);
}
__device__ inline bool PutBytesWarp(const EpPeers& p, Op op, int j, size_t off, size_t stage_off,
                                    size_t bytes, int channel, bool signal) {
  if (!ReachedByGin(p, j)) return true;
  __syncwarp();
  const uint32_t sig = GinSignalId(p.rank, channel);
  return signal ? GinPutWarp(p, op, j, off, stage_off, bytes, sig)
                : GinPutQuietWarp(p, op, j, off, stage_off, bytes, sig);
}

// The signal of `channel` alone to rank j (LSA: nothing): it vouches for
// every put this rank issued to j on the channel's context before it. One thread.
__device__ inline bool SignalPeer(const EpPeers& p, Op op, int j, int channel) {
  return PutBytes(p, op, j, 0, 0, 0, channel, true);
}

// Whether rank j's signal on `channel` here has reached `expected` (low 32
// bits, wrap-safe), so that its puts counted into it are visible to this
// thread. LSA peers send no signals: always true, the caller's word says it
// all. One look, no wait: the caller's loop polls and times out.
__device__ inline bool PeerSignalReached(const EpPeers& p, Op op, int j, int channel, uint64_t expected) {
  if (!ReachedByGin(p, j)) return true;
  const uint64_t v = GinReadSignal(p, op, GinSignalId(j, channel));
  return static_cast<int32_t>(static_cast<uint32_t>(v) - static_cast<uint32_t>(expected)) >= 0;
}

// Waits until rank j's signal on `channel` here has reached `expected`
// (64-bit, wrap-safe), so that the puts counted into it are visible to the
// warp. Signals are never reset: the caller knows the running total it
// expects. LSA peers send no signals: true at once. Lane 0 polls with a
// back-off without looking at the status word (a receiver drains what its
// peers send even after failing on its own); the clock starts at t0. False
// after reporting kPeerTimeout for j, never spins forever. All 32 lanes;
// the same result on every lane.
__device__ inline bool WaitPeerSignalWarp(const EpPeers& p, Op op, int j, int channel, uint64_t expected,
                                          unsigned long long t0) {
  if (!ReachedByGin(p, j)) return true;
  return GinWaitSignalWarp(p, op, GinSignalId(j, channel), expected, j, t0);
}

// After FlushPeers* of `channels` (bit c: channel c), the stage bytes of the
// puts this thread / warp issued there may change. Nothing without GIN peers.
__device__ inline void FlushPeers(const EpPeers& p, uint32_t channels) {
  if (AnyGinPeer(p)) GinFlush(p, channels);
}
__device__ inline void FlushPeersWarp(const EpPeers& p, uint32_t channels) {
  if (AnyGinPeer(p)) GinFlushWarp(p, channels);
}

// A control word for rank j at window offset `off` (u64): LSA peers get a
// store; a GIN peer gets a put on `channel` (by default the control
// channel, quiet, so that the next barrier signal vouches for it; with
// `signal`, the put carries the channel's signal itself) from offset
// `stage_off` of this rank's window, where the word is written first. One
// thread; without `signal`, before that barrier, and the caller fences
// (__threadfence_system) before it.
__device__ inline void PutControlWord(const EpPeers& p, int j, size_t off, size_t stage_off,
                                      uint64_t word, Op op, int channel = kGinControlChannel,
                                      bool signal = false) {
  if (ReachedByGin(p, j)) {
    StU64Volatile(reinterpret_cast<uint64_t*>(MyWindow(p) + stage_off), word);
    __threadfence();
    PutBytes(p, op, j, off, stage_off, sizeof(uint64_t), channel, signal);
  } else {
    StU64Volatile(reinterpret_cast<uint64_t*>(PeerWindow(p, j) + off), word);
  }
}

}  // namespace jax_ep
