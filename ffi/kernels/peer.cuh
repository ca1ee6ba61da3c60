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
//   a control word                 PutControlWord, PublishOkAndBarrier (ep_copy.cuh)
//   a barrier, refused bit         rank_barrier, refuse_barriers (barrier.cuh)
//   flush                          PeerTransport::Flush, GinFlushWarp (gin.cuh)
//
// Ops whose kernels have no GIN path yet (low latency, Engram) refuse a
// communicator with a GIN peer in their Validate* (AnyGinPeer), so they fail
// with a message instead of faulting on a null window.
#pragma once

#include "common.cuh"

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

}  // namespace jax_ep
