// How the low-latency kernels reach their peers: their whole use of
// peer.cuh's verbs, so that low_latency.cu names no window of another rank
// and asks no peer how it is reached.
//
//   LSA: rows, source entries and the count / flag words are stored
//        straight into the peer's window; a word's release store orders it
//        after the rows (the grid barrier AllSent comes first).
//   GIN: the same bytes go to this rank's staging area (LlLayout::Stage*,
//        laid out so that each (destination, expert) run of dispatch rows is
//        one put) and are put to the same places on the peer: a combine
//        row by the warp that wrote it, dispatch runs and their count words
//        by CTA 0 once the grid has written them. Then one signal per call
//        and peer on the op's channel (kGinLlDispatchChannel /
//        kGinLlCombineChannel) vouches for all of them, so the receiver
//        reads a GIN peer's word only once that signal has reached the
//        call's sequence number: every rank sends each peer exactly one
//        signal per call (a refused call's stand-in too), and sequence
//        numbers and signals both start at 0 at create.
//   Refused calls: an LSA peer reads the refuser's OpConfig record
//        (config_check.cuh); a GIN peer cannot map it, so the refuser puts
//        a word tagged with the call into the peer's kLlRefusalsOffset
//        slot ahead of the call's signal.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "config_check.cuh"
#include "low_latency.cuh"
#include "peer.cuh"

namespace jax_ep {

__device__ __forceinline__ int LlChannel(Op op) {
  return op == Op::kLowLatencyCombine ? kGinLlCombineChannel : kGinLlDispatchChannel;
}

__device__ __forceinline__ void StReleaseSys(uint64_t* ptr, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// A count / flag word's value: `low` (16 bits) under the digest of `mine`.
__device__ __forceinline__ uint32_t LlWordValue(const OpConfig& mine, uint32_t low) {
  return (ConfigDigest(mine) << 16) | low;
}

// ---------------------------------------------------------------- dispatch

// The first row of my [l][me][*] run for local expert l on its owner, and
// of the same run in my staging area, laid out [d][l][*] so that each
// (destination, expert) run is contiguous.
__device__ __forceinline__ size_t LlDispCell(const EpPeers& p, const LlLayout& L, int l) {
  return (static_cast<size_t>(l) * L.R + p.rank) * L.M;
}
__device__ __forceinline__ size_t LlDispStage(const LlLayout& L, int d, int l) {
  return (static_cast<size_t>(d) * L.E_l + l) * L.M;
}

// Where my row `slot` for local expert l of rank d goes (its [l][me][slot]
// cell there), and that row's source entry.
__device__ __forceinline__ char* LlDispRowFor(const EpPeers& p, const LlLayout& L, int b, int d, int l,
                                              int slot) {
  const size_t cell = LlDispCell(p, L, l) + slot, stage = LlDispStage(L, d, l) + slot;
  return BytesFor(p, d, L.DispRows(b) + cell * L.row_bytes, L.StageDispRows() + stage * L.row_bytes);
}
__device__ __forceinline__ int32_t* LlDispMetaFor(const EpPeers& p, const LlLayout& L, int b, int d, int l,
                                                  int slot) {
  const size_t cell = LlDispCell(p, L, l) + slot, stage = LlDispStage(L, d, l) + slot;
  return reinterpret_cast<int32_t*>(BytesFor(p, d, L.DispMeta(b) + cell * 4, L.StageDispMeta() + stage * 4));
}

// CTA 0 of a dispatch send, every thread, after every CTA's rows (AllSent):
// the count word (seq, rows of expert e from this rank) for each expert e,
// into its owner's window; a GIN owner's rows and source entries go with it.
__device__ void LlPostDispatchCounts(const EpPeers& p, const LlLayout& L, int b, uint64_t seq,
                                     const OpConfig& mine, const int32_t* s_count) {
  const int E = L.E_l * L.R;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int d = e / L.E_l, l = e - d * L.E_l;
    if (ReachedByGin(p, d)) continue;
    const uint32_t rows = static_cast<uint32_t>(min(s_count[e], L.M));
    uint64_t* word = reinterpret_cast<uint64_t*>(PeerWindow(p, d) + L.DispCounts(b)) +
                     static_cast<size_t>(l) * L.R + p.rank;
    StReleaseSys(word, MakeTagged(seq, LlWordValue(mine, rows)));
  }
  if (!AnyGinPeer(p)) return;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int e = warp; e < E; e += warps) {
    const int d = e / L.E_l, l = e - d * L.E_l;
    if (!ReachedByGin(p, d)) continue;
    const int rows = min(s_count[e], L.M);
    const size_t cell = LlDispCell(p, L, l), stage = LlDispStage(L, d, l);
    const size_t word = L.DispCounts(b) + 8 * (static_cast<size_t>(l) * L.R + p.rank);
    const size_t stage_word = L.StageDispCounts() + 8 * (static_cast<size_t>(d) * L.E_l + l);
    if ((threadIdx.x & 31) == 0) {
      StU64Volatile(reinterpret_cast<uint64_t*>(MyWindow(p) + stage_word),
                    MakeTagged(seq, LlWordValue(mine, static_cast<uint32_t>(rows))));
    }
    const Op op = Op::kLowLatencyDispatch;
    if (rows > 0) {
      PutBytesWarp(p, op, d, L.DispRows(b) + cell * L.row_bytes, L.StageDispRows() + stage * L.row_bytes,
                   rows * L.row_bytes, kGinLlDispatchChannel, false);
      PutBytesWarp(p, op, d, L.DispMeta(b) + cell * 4, L.StageDispMeta() + stage * 4, rows * 4,
                   kGinLlDispatchChannel, false);
    }
    PutBytesWarp(p, op, d, word, stage_word, sizeof(uint64_t), kGinLlDispatchChannel, false);
  }
  __syncthreads();  // every warp's puts before the signals that vouch for them
  for (int d = threadIdx.x; d < L.R; d += blockDim.x) {
    if (ReachedByGin(p, d)) SignalPeer(p, Op::kLowLatencyDispatch, d, kGinLlDispatchChannel);
  }
  FlushPeersWarp(p, 1u << kGinLlDispatchChannel);  // the staging is rewritten by the next call
}

// ---------------------------------------------------------------- combine

// Where my expert output for source s's entry q = t * K + k goes.
__device__ __forceinline__ char* LlCombRowFor(const EpPeers& p, const LlLayout& L, int b, int s, int q) {
  const size_t stage = static_cast<size_t>(s) * L.M * L.K + q;
  return BytesFor(p, s, L.CombRows(b) + static_cast<size_t>(q) * L.y_row_bytes,
                  L.StageCombRows() + stage * L.y_row_bytes);
}

// The warp wrote the row LlCombRowFor gave: a GIN source gets it now (its
// call's flag signal vouches for it). All 32 lanes.
__device__ __forceinline__ void LlCombRowWritten(const EpPeers& p, const LlLayout& L, int b, int s, int q) {
  const size_t stage = static_cast<size_t>(s) * L.M * L.K + q;
  PutBytesWarp(p, Op::kLowLatencyCombine, s, L.CombRows(b) + static_cast<size_t>(q) * L.y_row_bytes,
               L.StageCombRows() + stage * L.y_row_bytes, L.y_row_bytes, kGinLlCombineChannel, false);
}

// Thread s < R of CTA 0, after every CTA's rows (AllSent): this rank's
// flag word in source s's window; to a GIN source, put with the call's
// signal.
__device__ __forceinline__ void LlPostCombineFlag(const EpPeers& p, const LlLayout& L, int b, int s,
                                                  uint64_t word) {
  const size_t off = L.CombFlags(b) + sizeof(uint64_t) * p.rank;
  if (ReachedByGin(p, s)) {
    PutControlWord(p, s, off, L.StageCombFlags() + sizeof(uint64_t) * s, word, Op::kLowLatencyCombine,
                   kGinLlCombineChannel, true);
  } else {
    StReleaseSys(reinterpret_cast<uint64_t*>(PeerWindow(p, s) + off), word);
  }
}

// ---------------------------------------------------------------- refusals

__device__ __forceinline__ size_t LlRefusalSlot(Op op, int rank) {
  return kLlRefusalsOffset + sizeof(uint64_t) * ((op == Op::kLowLatencyCombine ? kMaxRanks : 0) + rank);
}

// The refused call `seq` of `op` (abort.h LaunchLlRefusal) told to every GIN
// peer: the word, then the call's one signal. One thread.
__device__ inline void LlTellGinPeersRefused(const EpPeers& p, Op op, uint64_t seq) {
  if (!AnyGinPeer(p)) return;
  const size_t off = LlRefusalSlot(op, p.rank);
  for (int r = 0; r < p.nranks; ++r) {
    if (ReachedByGin(p, r)) PutControlWord(p, r, off, off, MakeTagged(seq, 1u), op, LlChannel(op), true);
  }
  FlushPeers(p, 1u << LlChannel(op));
}

// ---------------------------------------------------------------- waiting

constexpr int64_t kWaitTimedOut = -1, kWaitMismatch = -2, kWaitRefused = -3;

// Waits until `word` (in this rank's window, written by peer `peer`)
// carries tag `seq` and returns its low 16 bits. kWaitMismatch when the
// word carries another digest than `mine`'s, or while waiting, the peer's
// record for this call differs from `mine` (its words went to its own
// layout's places; a GIN peer: its call's signal came but not this word);
// kWaitRefused (reported) when the peer refused this call (abort.h);
// kWaitTimedOut after reporting a timeout.
__device__ int64_t WaitTagged(const EpPeers& p, Op op, const uint64_t* word, uint64_t seq,
                              int peer, const OpConfig& mine) {
  const unsigned long long t0 = globaltimer_ns();
  const uint32_t digest = ConfigDigest(mine);
  unsigned polls = 0;
  while (true) {
    const bool landed = PeerSignalReached(p, op, peer, LlChannel(op), seq);
    const uint64_t w = ld_acquire_sys(word);
    if (landed && TagMatches(w, seq)) {
      return static_cast<uint32_t>(w) >> 16 == digest ? static_cast<int64_t>(w & 0xffffull) : kWaitMismatch;
    }
    if (landed && ReachedByGin(p, peer)) {
      const uint64_t* refusal = reinterpret_cast<const uint64_t*>(MyWindow(p) + LlRefusalSlot(op, peer));
      if (TagMatches(LdU64Volatile(refusal), seq)) {
        report_error(p, op, Cause::kPeerRefused, static_cast<uint32_t>(peer));
        return kWaitRefused;
      }
      return kWaitMismatch;
    }
    if ((++polls & 255u) == 0u) {
      bool torn = false;
      const OpConfig theirs = peer == p.rank ? mine : ReadConfig(p, peer, &torn);
      if (!torn && theirs.tag == mine.tag && theirs.op == mine.op) {
        if (IsRefused(theirs)) {
          report_error(p, op, Cause::kPeerRefused, static_cast<uint32_t>(peer));
          return kWaitRefused;
        }
        if (!SameFields(theirs, mine)) return kWaitMismatch;
      }
      if (globaltimer_ns() - t0 > p.timeout_ns) {
        report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(peer));
        return kWaitTimedOut;
      }
    }
  }
}

}  // namespace jax_ep
