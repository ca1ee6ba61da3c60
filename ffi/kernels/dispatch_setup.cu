// Dispatch's setup kernel (ep_kernels.h gives the op's kernel sequence):
// one launch of two roles, the prep blocks that place every token in its
// destination ranks (pos_in_rank) and experts (rie), and the control block
// that exchanges the counts with the peers and leaves this rank's output
// offsets and the capacity check in the scratch words (dispatch.cuh).
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "bulk_copy.cuh"
#include "config_check.cuh"
#include "dispatch.cuh"
#include "ep_copy.cuh"
#include "kernel_load.h"
#include "launch_policy.h"
#include "peer.cuh"
#include "setup_stamps.h"
#include "transport.cuh"
#include "window_layout.h"

namespace jax_ep {
namespace {

constexpr int kPrepThreads = 1024;  // 32 warps: one warp per 1/32 of the tokens / entries

// Off (null), a stamp is one untaken branch (setup_stamps.h).
__device__ __forceinline__ void Stamp(const DispatchCfg& c, int slot) {
  if (c.stamps != nullptr && slot < kStampSlots) c.stamps[slot] = globaltimer_ns();
}


// ---------------------------------------------------------------- prep
// Blocks [0, R): pos_in_rank[:, j] (ascending t) and tokens_per_rank[j];
// block 0 also checks every id. Blocks from R on (expert layout), one per
// c.prep_experts experts: rie[t, k] = rank of (t, k) among this rank's entries
// for its expert e, in (t, k) order, and the entries per expert.
//
// Each warp owns a contiguous span of tokens (rank blocks) or of flat (t, k)
// entries (expert blocks) and walks it one item per lane, so every load is
// coalesced (16-byte loads where the shape allows); ballots give the rank
// inside a step, a scan of the warp totals gives each warp's start. That is
// exactly the sequential count in ascending order the reference uses.
constexpr int kPrepWarps = kPrepThreads / 32;
// At most this many experts per expert-layout prep block. A block's work
// grows with its experts (compares per entry and expert in both passes,
// ballots in the second): 8 per block on 32 blocks took the setup from
// 26.7 us (1 on 256) to 43.0 us (2026-12-02). So the host spreads the experts over the SMs, and a
// block takes more than one only when there are more experts than SMs.
constexpr int kPrepExperts = 8;
static_assert(kPrepThreads == kControlThreads, "prep and control blocks share one launch");
static_assert(kPrepWarps <= 32, "one warp scans the warp totals");

// Exclusive offsets of this warp's totals n[v] (lane 0's values are used)
// among the warps, and the block totals, for NV values at once (one scan
// per value, by warp v). Every thread of the block calls it.
template <int NV>
__device__ __forceinline__ void PrepWarpOffsets(const int (&n)[NV], int (*s_warp)[kPrepWarps], int (&off)[NV],
                                                int (&total)[NV]) {
  static_assert(NV <= kPrepWarps, "one warp scans each value");
  const int lane = LaneId(), warp = static_cast<int>(threadIdx.x >> 5);
  if (lane == 0)
#pragma unroll
    for (int v = 0; v < NV; ++v) s_warp[v][warp] = n[v];
  __syncthreads();
  if (warp < NV) {
    int x = lane < kPrepWarps ? s_warp[warp][lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(kFullMask, x, d);
      if (lane >= d) x += u;
    }
    if (lane < kPrepWarps) s_warp[warp][lane] = x;  // inclusive
  }
  __syncthreads();
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    total[v] = s_warp[v][kPrepWarps - 1];
    off[v] = warp == 0 ? 0 : s_warp[v][warp - 1];
  }
}

// One id of a token: `in` if it lies in [lo, hi) (inside [0, E), so bad
// ids never count), `bad` if it lies outside [-1, E).
__device__ __forceinline__ void NoteId(int id, int lo, int hi, int E, bool& in, bool& bad) {
  bad |= id < -1 || id >= E;
  in |= id >= lo && id < hi;
}

// Does token t choose an expert in [lo, hi) (rank j's experts; that range
// lies inside [0, E), so bad ids never count)? `bad` collects ids outside
// [-1, E).
__device__ __forceinline__ bool TokenInRank(const DispatchCfg& c, const int32_t* __restrict__ topk,
                                            int t, int lo, int hi, bool vec4, bool& bad) {
  const int32_t* row = topk + static_cast<size_t>(t) * c.K;
  bool in = false;
  auto one = [&](int id) { NoteId(id, lo, hi, c.E, in, bad); };
  if (vec4) {
    for (int k = 0; k < c.K; k += 4) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(row + k));
      one(v.x);
      one(v.y);
      one(v.z);
      one(v.w);
    }
  } else {
    for (int k = 0; k < c.K; ++k) one(__ldg(row + k));
  }
  return in;
}

__device__ __forceinline__ void DispatchPrep(const DispatchCfg& c, const DispatchWindow& w, const EpPeers& p,
                                             const int32_t* __restrict__ topk,
                                             int32_t* __restrict__ pos_in_rank, int b) {
  __shared__ int s_warp[kPrepExperts][kPrepWarps];
  __shared__ int s_bad;
  const int R = p.nranks;
  const DispatchScratch sc(R, c.E);
  int* scratch = ScratchOf(p, w);
  int* rie = reinterpret_cast<int*>(MyWindow(p) + w.rie_off);
  const int lane = LaneId(), warp = static_cast<int>(threadIdx.x >> 5);
  const unsigned lt = (1u << lane) - 1u;  // lanes below this one
  const bool aligned16 = (reinterpret_cast<uintptr_t>(topk) & 15u) == 0;
  if (threadIdx.x == 0) {
    s_bad = 0;
    Stamp(c, kStampPhases + 2 * b);
  }
  __syncthreads();
  if (b < R) {
    const int j = b, lo = j * c.El, hi = lo + c.El;
    const bool vec4 = aligned16 && c.K % 4 == 0;
    const int span = ((c.T + kPrepWarps - 1) / kPrepWarps + 31) / 32 * 32;
    const int t0 = static_cast<int>(min(static_cast<long long>(c.T), static_cast<long long>(warp) * span));
    const int t1 = static_cast<int>(min(static_cast<long long>(c.T), static_cast<long long>(t0) + span));
    const int steps = (t1 - t0 + 31) / 32;
    int n = 0;
    bool bad = false;
    // Each lane's answers for up to 32 steps (T <= 32768) stay in `bits`,
    // so the second pass reads nothing; longer spans read topk again.
    const bool keep = steps <= 32;
    uint32_t bits = 0;
    if (vec4 && c.K <= 8) {
      // Up to 8 ids per token in two 16-byte loads: each group of 4 steps
      // issues all its loads before it looks at any, so they are in flight
      // together (one load per round trip made the 4096-token block take
      // 6.4 us, 2026-12-02).
      constexpr int kGroup = 4;
      const int4 none = make_int4(-1, -1, -1, -1);
      for (int g = 0; g < steps; g += kGroup) {
        int4 a[kGroup], z[kGroup];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          const int t = t0 + (g + u) * 32 + lane;
          const int4* row = reinterpret_cast<const int4*>(topk + static_cast<size_t>(t) * c.K);
          const bool ok = g + u < steps && t < t1;
          a[u] = ok ? __ldg(row) : none;
          z[u] = ok && c.K > 4 ? __ldg(row + 1) : none;
        }
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          bool in = false;
          const int ids[8] = {a[u].x, a[u].y, a[u].z, a[u].w, z[u].x, z[u].y, z[u].z, z[u].w};
#pragma unroll
          for (int k = 0; k < 8; ++k) NoteId(ids[k], lo, hi, c.E, in, bad);
          if (g + u < steps) {
            if (keep) bits |= static_cast<uint32_t>(in) << (g + u);
            n += in ? 1 : 0;
          }
        }
      }
    } else {
#pragma unroll 4
      for (int i = 0; i < steps; ++i) {
        const int t = t0 + i * 32 + lane;
        const bool in = t < t1 && TokenInRank(c, topk, t, lo, hi, vec4, bad);
        if (keep) bits |= static_cast<uint32_t>(in) << i;
        n += in ? 1 : 0;
      }
    }
    if (bad) atomicOr(&s_bad, 1);
    n = __reduce_add_sync(kFullMask, n);  // lanes counted their own tokens
    int offs[1], totals[1];
    PrepWarpOffsets<1>({n}, s_warp, offs, totals);
    int off = offs[0];
    const int total = totals[0];
#pragma unroll 4
    for (int i = 0; i < steps; ++i) {
      const int t = t0 + i * 32 + lane;
      bool unused = false;
      const bool in = keep ? ((bits >> i) & 1u) != 0 : t < t1 && TokenInRank(c, topk, t, lo, hi, vec4, unused);
      const unsigned m = __ballot_sync(kFullMask, in);
      if (t < t1) pos_in_rank[static_cast<size_t>(t) * R + j] = in ? off + __popc(m & lt) : -1;
      off += __popc(m);
    }
    if (threadIdx.x == 0) {
      scratch[sc.tokens_per_rank + j] = total;
      if (j == 0) {
        scratch[DispatchScratch::kBadIds] = s_bad;
        if (s_bad) report_error(p, Op::kDispatch, Cause::kBadExpertId);
      }
    }
  } else {
    // c.prep_experts experts per block, [e0, e0 + ne): one pass over the
    // entries counts them all.
    const int e0 = (b - R) * c.prep_experts;
    const int ne = min(min(c.prep_experts, kPrepExperts), c.E - e0);
    const int N = c.T * c.K;  // < 2^31 (ValidateDispatch)
    // 16-byte path: lane holds entries base + 4 lane + q, q < 4; the warp
    // span is a multiple of 128 entries and N % 4 == 0, so no load crosses
    // the span's end.
    const bool vec4 = aligned16 && N % 4 == 0;
    const int per = vec4 ? 128 : 32;  // entries per warp step
    const int span = ((N + kPrepWarps - 1) / kPrepWarps + per - 1) / per * per;
    const int i0 = static_cast<int>(min(static_cast<long long>(N), static_cast<long long>(warp) * span));
    const int i1 = static_cast<int>(min(static_cast<long long>(N), static_cast<long long>(i0) + span));
    const int steps = (i1 - i0 + per - 1) / per;
    // Entries at or past i1 read as -1 (no expert).
    auto load4 = [&](int s) {
      const int i = i0 + s * 128 + 4 * lane;
      return i < i1 ? __ldg(reinterpret_cast<const int4*>(topk + i)) : make_int4(-1, -1, -1, -1);
    };
    auto load1 = [&](int s) {
      const int i = i0 + s * 32 + lane;
      return i < i1 ? __ldg(topk + i) : -1;
    };
    // Pass 1 only counts, so each lane adds its own matches and the warp
    // sums them once at the end (ncu, 2026-12-02: the prep blocks kept the
    // SMs 30 % busy for 14 us with four ballots per step and expert).
    int n[kPrepExperts] = {};
    // 16-byte path with at most 8 steps per warp (N <= 32768 entries): the
    // first pass keeps each entry's match with each expert as a bit (4 s + q
    // of hb[x]), so the second pass reads nothing; each group of 4 steps
    // issues its loads before using any (2026-12-02: a 2-expert block took
    // 11.8 us, most of it waiting on one or two loads at a time).
    constexpr int kGroup = 4;
    const bool keep = vec4 && steps <= 8;
    uint32_t hb[kPrepExperts] = {};
    if (vec4) {
      for (int g = 0; g < steps; g += kGroup) {
        int4 v[kGroup];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) v[u] = g + u < steps ? load4(g + u) : make_int4(-1, -1, -1, -1);
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          if (g + u >= steps) break;
#pragma unroll
          for (int x = 0; x < kPrepExperts; ++x) {
            if (x >= ne) break;
            const int e = e0 + x;
            const uint32_t q = static_cast<uint32_t>(v[u].x == e) | static_cast<uint32_t>(v[u].y == e) << 1 |
                               static_cast<uint32_t>(v[u].z == e) << 2 | static_cast<uint32_t>(v[u].w == e) << 3;
            n[x] += __popc(q);
            if (keep) hb[x] |= q << (4 * (g + u));
          }
        }
      }
    } else {
#pragma unroll 2
      for (int s = 0; s < steps; ++s) {
        const int v = load1(s);
#pragma unroll
        for (int x = 0; x < kPrepExperts; ++x) {
          if (x >= ne) break;
          n[x] += v == e0 + x ? 1 : 0;
        }
      }
    }
#pragma unroll
    for (int x = 0; x < kPrepExperts; ++x)
      if (x < ne) n[x] = __reduce_add_sync(kFullMask, n[x]);
    int off[kPrepExperts], total[kPrepExperts];
    PrepWarpOffsets<kPrepExperts>(n, s_warp, off, total);
    // Each entry matches at most one expert, so its rie is written once.
    if (vec4) {
#pragma unroll 2
      for (int s = 0; s < steps; ++s) {
        const int i = i0 + s * 128 + 4 * lane;
        const int4 v = keep ? make_int4(-1, -1, -1, -1) : load4(s);
#pragma unroll
        for (int x = 0; x < kPrepExperts; ++x) {
          if (x >= ne) break;
          const int e = e0 + x;
          const uint32_t hq = keep ? (hb[x] >> (4 * (s & 7))) & 15u : 0u;
          const bool h0 = keep ? (hq & 1u) != 0 : v.x == e, h1 = keep ? (hq & 2u) != 0 : v.y == e;
          const bool h2 = keep ? (hq & 4u) != 0 : v.z == e, h3 = keep ? (hq & 8u) != 0 : v.w == e;
          // Most steps hold none of a block's experts (1 in E per entry).
          if (!__any_sync(kFullMask, h0 | h1 | h2 | h3)) continue;
          const unsigned m0 = __ballot_sync(kFullMask, h0), m1 = __ballot_sync(kFullMask, h1);
          const unsigned m2 = __ballot_sync(kFullMask, h2), m3 = __ballot_sync(kFullMask, h3);
          int o = off[x] + __popc(m0 & lt) + __popc(m1 & lt) + __popc(m2 & lt) + __popc(m3 & lt);
          if (h0) rie[i] = o++;
          if (h1) rie[i + 1] = o++;
          if (h2) rie[i + 2] = o++;
          if (h3) rie[i + 3] = o;
          off[x] += __popc(m0) + __popc(m1) + __popc(m2) + __popc(m3);
        }
      }
    } else {
#pragma unroll 2
      for (int s = 0; s < steps; ++s) {
        const int i = i0 + s * 32 + lane;
        const int v = load1(s);
#pragma unroll
        for (int x = 0; x < kPrepExperts; ++x) {
          if (x >= ne) break;
          const bool h = v == e0 + x;
          const unsigned m = __ballot_sync(kFullMask, h);
          if (h) rie[i] = off[x] + __popc(m & lt);
          off[x] += __popc(m);
        }
      }
    }
    if (threadIdx.x == 0)
#pragma unroll
      for (int x = 0; x < kPrepExperts; ++x)
        if (x < ne) scratch[sc.entries_per_expert + e0 + x] = total[x];
  }
  // Done: the control block may read what thread 0 wrote into the scratch.
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p.epoch + kDispatchPrepCounter, 1ull);
    Stamp(c, kStampPhases + 2 * b + 1);
  }
}

// ---------------------------------------------------------------- control
// One block. Start barrier (peers are done reading our area from the previous
// op), counts to every receiver, barrier, then this rank's output offsets and
// the capacity check. Counts slot i of source s: [0] token rows, [1] (t, k)
// entries, [2 + e] entries for local expert e (expert layout only). The
// prep blocks of the same grid run meanwhile; the counts wait for them
// (each of the `prep_items` counts kDispatchPrepCounter up; this block resets it).
__device__ __forceinline__ void DispatchControl(const DispatchCfg& c, const DispatchWindow& w,
                                                const EpPeers& p, const PushIO& io, int prep_items) {
  using Scan = cub::BlockScan<int, kControlThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int s_fail;
  __shared__ int s_err;
  __shared__ int s_total;
  __shared__ unsigned s_badpeer;
  __shared__ unsigned long long s_tag;
  extern __shared__ int s_counts[];  // [R][nslots]
  const int R = p.nranks, r = p.rank, El = c.El;
  const DispatchScratch sc(R, c.E);
  int* scratch = ScratchOf(p, w);
  const int nslots = c.expert ? w.counts_stride : 2;
  const int tid = threadIdx.x;
  const PeerTransport tr{p, PeerWindow(p, r), 0, {}};  // control words only
  if (tid == 0) Stamp(c, kStampStart);

  // This op's chunk counters start from zero; the barrier below publishes
  // that before any peer can add (window_layout.h).
  ZeroChunkCounters(p, NumChunks(c.T, ChunkRows(c.T)));
  GinSnapshotSignals(p, Op::kDispatch);
  __syncthreads();
  // The status word is mapped host memory (a PCIe round trip): another warp
  // reads it while thread 0 is in the start barrier, instead of before it.
  if (tid == 32) s_err = has_error(p);
  if (tid == 0) {
    bool fail = false;
    // What every rank must have called with: what the window geometry and
    // the received rows follow from (not the capacity, the receiver's own
    // business, nor ue8m0, the sender's), checked before any row moves.
    const uint32_t elem = c.has_scales ? 1u : static_cast<uint32_t>(c.in_bytes);  // payload bytes
    const uint32_t v[] = {static_cast<uint32_t>(c.T), static_cast<uint32_t>(c.H), static_cast<uint32_t>(c.K),
                          static_cast<uint32_t>(c.E), FormatWord(elem, c.has_scales, c.expert)};
    Stamp(c, kStampZeroed);
    PublishConfig(p, MakeOpConfig(Op::kDispatch, v), static_cast<uint32_t>(*p.epoch + 1));
    if (!rank_barrier(p, Op::kDispatch)) fail = true;
    Stamp(c, kStampBarrier1);
    if (!fail && !PeersShareConfig(p, Op::kDispatch)) fail = true;
    Stamp(c, kStampConfig);
    // The prep blocks' scratch words (read below, volatile: other SMs wrote
    // them during this kernel).
    if (!WaitBlocksDone(p, p.epoch + kDispatchPrepCounter, prep_items, Op::kDispatch)) fail = true;
    Stamp(c, kStampPrepWait);
    if (static_cast<volatile int*>(scratch)[DispatchScratch::kBadIds] != 0) fail = true;
    s_fail = fail;
    s_tag = *p.epoch;
    s_badpeer = 0;
  }
  __syncthreads();
  if (tid == 0 && s_err) s_fail = 1;
  __syncthreads();
  if (!s_fail) {
    const volatile int* prep = scratch;  // written by the prep blocks
    // Expert layout: the entries to each rank, summed over its experts by
    // the whole block (integer adds: any order gives the same sum) into
    // s_counts, free until the counts are read back below.
    if (c.expert) {
      for (int j = tid; j < R; j += blockDim.x) s_counts[j] = 0;
      __syncthreads();
      for (int e = tid; e < c.E; e += blockDim.x) atomicAdd(&s_counts[e / El], prep[sc.entries_per_expert + e]);
      __syncthreads();
    }
    for (int idx = tid; idx < R * nslots; idx += blockDim.x) {
      const int j = idx / nslots, i = idx % nslots;
      int v = 0;
      if (i == 0) v = prep[sc.tokens_per_rank + j];
      else if (i == 1) v = c.expert ? s_counts[j] : 0;
      else v = prep[sc.entries_per_expert + j * El + (i - 2)];
      const uint64_t word = MakeTagged(s_tag, static_cast<uint32_t>(v));
      // A GIN peer's row is staged here; thread 0 puts it below.
      StU64Volatile(tr.ControlWord(j, w.counts_off, w.counts_out_off, w.counts_stride, i), word);
    }
    // Each writer, only: its counts are visible before the barrier's
    // release (1024 threads' system fences cost ~2 us, 2026-12-02).
    if (tid < R * nslots) __threadfence_system();
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();
    Stamp(c, kStampCounts);
    if (!s_fail) tr.PutControlRows(Op::kDispatch, w.counts_off, w.counts_out_off, w.counts_stride, nslots);
    if (!rank_barrier(p, Op::kDispatch)) s_fail = 1;
    Stamp(c, kStampBarrier2);
  }
  __syncthreads();
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(PeerWindow(p, r) + w.counts_off);
  for (int idx = tid; idx < R * nslots; idx += blockDim.x) {
    const int s = idx / nslots, i = idx % nslots;
    const uint64_t word = LdU64Volatile(mine + static_cast<size_t>(s) * w.counts_stride + i);
    if (!TagMatches(word, s_tag)) atomicOr(&s_badpeer, 1u << s);
    s_counts[idx] = static_cast<int>(static_cast<uint32_t>(word));
  }
  __syncthreads();
  if (tid == 0) Stamp(c, kStampReadCounts);
  if (tid == 0 && !s_fail && s_badpeer != 0) {
    report_error(p, Op::kDispatch, Cause::kPeerTimeout, 0x80u | (__ffs(s_badpeer) - 1));
  }
  const bool fail = s_fail || s_badpeer != 0;  // block-uniform
  // Token-row prefix per source: rank-layout output offsets, and in both
  // layouts where each source's rows sit in our window.
  if (tid == 0) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      scratch[sc.prefix + s] = acc;
      acc += fail ? 0 : s_counts[s * nslots];
    }
    scratch[sc.prefix + R] = acc;
    if (!c.expert) s_total = acc;
  }
  int padded = 0;
  if (c.expert) {
    int gsize = 0;
    if (tid < El && !fail) {
      for (int s = 0; s < R; ++s) gsize += s_counts[s * nslots + 2 + tid];
      padded = (gsize + c.align - 1) / c.align * c.align;
    }
    int goff, total;
    Scan(tmp).ExclusiveSum(padded, goff, total);
    if (tid < El) {
      scratch[sc.group_off + tid] = goff;
      scratch[sc.group_size + tid] = gsize;
      int a = goff;
      for (int s = 0; s < R; ++s) {
        scratch[sc.src_off + tid * R + s] = a;
        a += fail ? 0 : s_counts[s * nslots + 2 + tid];
      }
    }
    if (tid == 0) {
      scratch[sc.group_off + El] = total;
      s_total = total;
    }
  }
  __syncthreads();
  const bool overflow = !fail && s_total > c.C;
  const bool ok = !fail && !overflow;
  if (tid == 0) {
    if (overflow) report_error(p, Op::kDispatch, Cause::kCapacityOverflow);
    scratch[DispatchScratch::kOk] = ok ? 1 : 0;
    scratch[DispatchScratch::kSendOk] = fail ? 0 : 1;
  }
  if (tid < R) {
    const int v = ok ? s_counts[tid * nslots + (c.expert ? 1 : 0)] : 0;
    scratch[sc.recv_counts + tid] = v;
    io.recv_counts[tid] = v;
    if (!c.expert) io.counts[tid] = v;
  }
  if (c.expert && tid < El) io.counts[tid] = ok ? padded : 0;
  if (tid == 0) Stamp(c, kStampEnd);
}

// One launch for both: block 0 is the control block, blocks 1.. the prep
// blocks, so the start barrier (waiting for the peers) overlaps the prep
// instead of following it. `prep_items` pieces of prep (the R ranks, then
// the groups of c.prep_experts experts), one per prep block unless the op's
// num_sms caps the grid, when each prep block takes every (gridDim.x - 1)-th.
// Only block 0 waits, and only for blocks that never wait, so residency
// does not matter.
__global__ void __launch_bounds__(kControlThreads, 1) DispatchSetupKernel(DispatchCfg c, DispatchWindow w,
                                                                         EpPeers p, PushIO io, int prep_items) {
  if (blockIdx.x == 0) {
    DispatchControl(c, w, p, io, prep_items);
  } else {
    for (int b = static_cast<int>(blockIdx.x) - 1; b < prep_items; b += static_cast<int>(gridDim.x) - 1)
      DispatchPrep(c, w, p, io.topk, io.pos_in_rank, b);
  }
}

}  // namespace

// Experts per expert-layout prep block: the fewest that keep the blocks
// (beside the control block and the R rank blocks) within one wave of SMs.
static int PrepExpertsPerBlock(int E, int R, int sms) {
  const int free_sms = std::max(1, sms - 1 - R);
  return std::min(kPrepExperts, std::max(1, (E + free_sms - 1) / free_sms));
}

cudaError_t LoadDispatchSetupKernels() { return LoadEach(DispatchSetupKernel); }

void LaunchDispatchSetup(DispatchCfg& c, const DispatchWindow& w, const EpPeers& p, const PushIO& io,
                         int num_sms, bool beside_compute, cudaStream_t stream) {
  const int R = p.nranks;
  const int nslots = c.expert ? w.counts_stride : 2;
  // The prep blocks read topk twice (count, then place), through L1; after a
  // bulk data kernel the SMs sit in its all-shared-memory split, and the
  // setup took ~4 us longer there than after register copies (2026-12-02:
  // 17.6 against 13.6; asking for all-shared made it no better). A guess
  // to measure: ask for the largest L1.
  if (cudaFuncSetAttribute(DispatchSetupKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxL1) != cudaSuccess)
    (void)cudaGetLastError();  // a hint: the launch works without it
  // The op's num_sms caps the setup too. Without it: beside compute (a
  // *_start), the prep takes about as many SMs as the data kernel's budget,
  // else all of them.
  const int sms = num_sms > 0 ? num_sms : beside_compute ? kSmBudget + 1 + R : LaunchDeviceSms();
  c.prep_experts = PrepExpertsPerBlock(c.E, R, sms);
  const int expert_blocks = c.expert ? (c.E + c.prep_experts - 1) / c.prep_experts : 0;
  const int prep_items = R + expert_blocks;
  // The control block waits for a prep block: two blocks at the least.
  const int blocks = num_sms > 0 ? std::max(2, std::min(num_sms, 1 + prep_items)) : 1 + prep_items;
  c.stamps = SetupStampsBuffer(stream);
  DispatchSetupKernel<<<blocks, kControlThreads, sizeof(int) * R * nslots, stream>>>(c, w, p, io, prep_items);
  if (c.stamps != nullptr) ReportSetupStamps(stream, c.stamps, prep_items, R, c.expert != 0);
}

}  // namespace jax_ep
