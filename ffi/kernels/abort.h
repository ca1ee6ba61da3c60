// A rank whose handler refuses a call after its peers may already be in the
// call's barriers (an earlier fatal error, a start still pending, a bad
// argument on this rank only) tells them so through their windows instead of
// leaving them to wait out the timeout (docs/errors.md).
//
// The refusing rank stands in for the `barriers` barriers the call's kernels
// pass when their first barrier fails (every op enters the same number
// then), so the epochs stay in step: its epoch advances by `barriers`, and
// its flag in every peer's window becomes (its last epoch |
// kBarrierRefusedBit), stored to an LSA peer, put to a GIN peer ahead of one
// control signal per barrier (barrier.cuh refuse_barriers). A peer waiting at
// any of those barriers sees the bit and fails with Cause::kPeerRefused at
// once; at the next call's barrier the flag is below the epoch waited for
// and the peer waits as usual. If every rank refuses, every epoch advances
// alike and nobody waits. Only where that
// stand-in is safe (handlers/state.h RefusalNotice): one rank per process,
// no start pending, not a refusal after a fatal error.
//
// It covers the refused op only. A refusal ends the refusing rank's whole
// program; in deferred mode a peer goes on to the program's next op with a
// barrier and waits out the timeout there. In checked mode the peer's op
// fails too, so its program stops where the refuser's did.
#pragma once

#include <cuda_runtime.h>

#include "common.cuh"

namespace jax_ep {

cudaError_t LaunchRefusedBarriers(const EpPeers& p, int barriers, cudaStream_t stream);

// The low-latency ops have no barrier in their steady state: a refused
// sending call (fused, or the send part) stands in for the call on the
// device instead. The op's sequence number advances as if the call had run
// and been received, and this rank's header gets a refused record
// (config_check.cuh) tagged with that number; a peer waiting for this
// rank's count / flag words reads it and fails with Cause::kPeerRefused at
// once. Not when the peers' call changes the layout (they wait in the
// reset's barrier, and time out). `combine`: which op. (low_latency.cu)
cudaError_t LaunchLlRefusal(const EpPeers& p, bool combine, unsigned long long* counters,
                            cudaStream_t stream);

// An Engram fetch where a peer is on GIN has no barrier either: its peers
// wait for this rank's request and answer. A refused fetch advances this
// rank's fetch sequence as if it had fetched, and each GIN peer gets a
// refused request and a refused answer with their signals, so it fails at
// once and the counts stay in step. (engram_gin.cu)
cudaError_t LaunchEngramGinRefusal(const EpPeers& p, unsigned long long* counters,
                                   cudaStream_t stream);

}  // namespace jax_ep
