// The cross-rank barrier every EP op passes before it touches a peer's
// window and after its control exchange. LSA peers: a flag store into each
// peer's window. GIN peers: a signal-only put on the control channel; its
// count on the receiver is then the number of barriers that peer has entered,
// i.e. its epoch, since signals and epochs both start at 0 at create and
// every barrier (also a failing one) sends exactly one. The control words a
// rank puts to a GIN peer just before (ep_copy.cuh) travel on the same
// context, so the barrier signal vouches for them too; so does a refusing
// rank's flag (refuse_barriers), which is why a GIN peer's flag is read only
// once the signal count has arrived.
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
        if (GinReached(GinReadSignal(p, op, sig), e)) {
          // Only a refusal puts a GIN peer's flag, so it may still hold an
          // old refusal: the bit counts only with an epoch this far.
          const uint64_t v = ld_acquire_sys(mine + r);
          if ((v & kBarrierRefusedBit) && (v & ~kBarrierRefusedBit) >= e) {
            report_error(p, op, Cause::kPeerRefused, static_cast<uint32_t>(r));
            return false;
          }
          break;
        }
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

// A rank that refuses its call (abort.h) stands in for its barriers
// first..last (its epoch is already at last): LSA peers find the refused bit
// in its flag and fail at once. A GIN peer counts control signals, so it gets
// one per barrier stood in for, keeping its count equal to this rank's epoch;
// the flag word goes first on the same context, and the first signal vouches
// for it, so the peer's barrier finds the bit as soon as its count arrives.
// The word is put from this rank's own flag slot, which its next barrier
// overwrites: the flush lets that happen. One thread, after a system fence.
__device__ inline void refuse_barriers(const EpPeers& p, uint64_t first, uint64_t last) {
  for (int r = 0; r < p.nranks; ++r) {
    if (!ReachedByGin(p, r)) st_relaxed_sys(barrier_flags(p, r) + p.rank, last | kBarrierRefusedBit);
  }
  if (!AnyGinPeer(p)) return;
  // This rank is never a GIN peer of its own, so the loop above has written
  // the word into its own slot, the put's source.
  const size_t off = kBarrierFlagsOffset + sizeof(uint64_t) * p.rank;
  const uint32_t sig = GinSignalId(p.rank, kGinControlChannel);
  for (int r = 0; r < p.nranks; ++r) {
    if (!ReachedByGin(p, r)) continue;
    if (!GinPutQuiet(p, Op::kNone, r, off, off, sizeof(uint64_t), sig)) continue;
    for (uint64_t e = first; e <= last; ++e) GinPut(p, Op::kNone, r, 0, 0, 0, sig);
  }
  GinFlush(p, 1u << kGinControlChannel);
}

// Each rank writes (epoch-tag, ok ? ok_value : 0) into every rank's ok[my
// rank], then a rank barrier. Afterwards ok[s] in my window tells whether
// source s is ready to send; `ok_value` (odd, so never 0) also carries what
// the ranks must agree on (config_check.cuh's digest). One thread. (A GIN
// peer's copy goes out from my own ok[my rank], which holds the same word.)
__device__ inline void PublishOkAndBarrier(const EpPeers& p, size_t ok_off, bool ok, uint32_t ok_value,
                                           Op op) {
  const uint64_t tag = *p.epoch + 1;  // the epoch rank_barrier is about to use
  const uint64_t word = MakeTagged(tag, ok ? ok_value : 0u);
  const size_t slot = ok_off + sizeof(uint64_t) * p.rank;
  StU64Volatile(reinterpret_cast<uint64_t*>(MyWindow(p) + slot), word);
  for (int j = 0; j < p.nranks; ++j)
    if (j != p.rank) PutControlWord(p, j, slot, slot, word, op);
  __threadfence_system();
  rank_barrier(p, op);
}

// After PublishOkAndBarrier: did every source publish this rank's own
// `ok_value` for this epoch? Returns -1 when all did, else the first that
// did not. One thread.
__device__ inline int FirstPeerNotOk(const EpPeers& p, size_t ok_off, uint32_t ok_value) {
  const uint64_t tag = *p.epoch;
  const uint64_t* slots = reinterpret_cast<const uint64_t*>(MyWindow(p) + ok_off);
  for (int s = 0; s < p.nranks; ++s) {
    const uint64_t w = LdU64Volatile(slots + s);
    if (!TagMatches(w, tag) || static_cast<uint32_t>(w) != ok_value) return s;
  }
  return -1;
}

}  // namespace jax_ep
