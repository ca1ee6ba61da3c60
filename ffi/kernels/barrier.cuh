// The cross-rank barrier every EP op passes before it touches a peer's
// window and after its control exchange. LSA peers: a flag store into each
// peer's window. GIN peers: a signal-only put on the control channel; its
// count on the receiver is then the number of barriers that peer has entered,
// i.e. its epoch, since signals and epochs both start at 0 at create and
// every barrier (also a failing one) sends exactly one. The control words a
// rank puts to a GIN peer just before (ep_copy.cuh) travel on the same
// context, so the barrier signal vouches for them too.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "gin.cuh"
#include "peer.cuh"

namespace jax_ep {

// Called by ONE thread (after the caller has made its CTA's / grid's writes
// visible). Every rank runs the same sequence of ops, so the epoch counters
// agree. Returns false (and reports) on timeout.
__device__ inline bool rank_barrier(const EpPeers& p, Op op) {
  const uint64_t e = *p.epoch + 1;
  *p.epoch = e;
  // One rank: nobody else reads this window or waits on its flag (the
  // stream orders this rank's own ops), so the fence and the flag round
  // trip would only cost time (~2-3 us per barrier at EP1, measured 2026-12-02).
  if (p.nranks == 1) return true;
  // fence.sc.sys followed by relaxed stores is a release pattern for every
  // flag: one MEMBAR.SYS instead of one per st.release.sys.
  __threadfence_system();
  bool sent = true;
  for (int r = 0; r < p.nranks; ++r) {
    if (ReachedByGin(p, r)) {
      sent &= GinPut(p, op, r, 0, 0, 0, GinSignalId(p.rank, kGinControlChannel));
    } else {
      st_relaxed_sys(barrier_flags(p, r) + p.rank, e);
    }
  }
  if (!sent) return false;
  const uint64_t* mine = barrier_flags(p, p.rank);
  const unsigned long long t0 = globaltimer_ns();
  // The status word is mapped host memory: one read is a PCIe round trip
  // (~1 µs), so the spin looks at it only every 256 polls, not every poll.
  unsigned polls = 0;
  for (int r = 0; r < p.nranks; ++r) {
    const bool gin = ReachedByGin(p, r);
    const uint32_t sig = GinSignalId(r, kGinControlChannel);
    for (;;) {
      if (gin) {
        if (GinReached(GinReadSignal(p, op, sig), e)) break;
      } else {
        const uint64_t v = ld_acquire_sys(mine + r);
        if ((v & ~kBarrierRefusedBit) >= e) {
          if (v & kBarrierRefusedBit) {
            report_error(p, op, Cause::kPeerRefused, static_cast<uint32_t>(r));
            return false;
          }
          break;
        }
      }
      if ((++polls & 255u) == 0u && has_error(p)) return false;
      if (globaltimer_ns() - t0 > p.timeout_ns) {
        report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(r));
        return false;
      }
    }
  }
  return true;
}

// A rank that refuses its call (abort.h) stands in for every barrier up to
// epoch `last` (its epoch is already there): LSA peers find the refused bit
// in its flag and fail at once. A GIN peer's barrier counts control signals
// only and learns nothing from a flag, so it waits until its timeout; giving
// it the bit (a flag put before the signals) is still to do. One thread,
// after a system fence.
__device__ inline void refuse_barriers(const EpPeers& p, uint64_t last) {
  for (int r = 0; r < p.nranks; ++r) {
    if (!ReachedByGin(p, r)) st_relaxed_sys(barrier_flags(p, r) + p.rank, last | kBarrierRefusedBit);
  }
}

}  // namespace jax_ep
