// Normal (high-throughput) dispatch: see ep_kernels.h for the kernel
// sequence, window_layout.h for where the bytes go and transport.cuh for how
// a peer is reached (LSA or GIN).
//
// Why push into [source][slot] rows: XLA's output buffers cannot be mapped by
// the peers, so every remote row must land in the receiver's symmetric window
// first. Indexing the receive area by (source rank, pos_in_rank) lets each
// sender write its rows at offsets it computes alone (pos_in_rank is its own
// prefix sum), so the data phase needs no round trip. The counts exchange
// that precedes it is only for the receiver's output offsets, which lets the
// sender also write its *local* rows straight into the outputs while the
// NVLink stores are in flight (the local copy is then off the critical path).
//
// Errors: a rank that has failed (bad expert id, status already set, peer
// timeout) still takes part in every barrier but stores nothing into peers'
// windows; peers notice through the epoch-tagged counts / ok words and zero
// their outputs (and report), so nothing wrong is ever written.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <string>

#include "bulk_copy.cuh"
#include "handlers/device_sms.h"
#include "config_check.cuh"
#include "ep_copy.cuh"
#include "ep_kernels.h"
#include "fp8.cuh"
#include "kernel_load.h"
#include "transport.cuh"
#include "window_layout.h"

namespace jax_ep {

int EpDtypeBytes(EpDtype d) {
  switch (d) {
    case EpDtype::kBF16: return 2;
    case EpDtype::kF16: return 2;
    case EpDtype::kF32: return 4;
    case EpDtype::kFp8E4m3: return 1;
  }
  return 0;
}

namespace {

constexpr int kPrepThreads = 1024;  // 32 warps: one warp per 1/32 of the tokens / entries
constexpr int kControlThreads = 1024;   // one thread per local expert in the control block
constexpr int kDataThreads = 1024;      // 32 warps: one token (row) per warp at a time
constexpr int kCastThreads = 512;       // push kernel with the in-kernel FP8 cast
constexpr int kMaxLocalExperts = kControlThreads;

struct DispatchCfg {
  int T, H, K, E, El, C, align;
  int expert;       // layout == expert
  int in_bytes;     // bytes per element of x
  int has_scales;   // payload is FP8 (input FP8 or cast)
  int ue8m0;
  int gin_rows;     // > 0: rows to GIN peers are staged and put in chunks of this many (gin_stage.cuh)
  int prep_experts; // expert layout: experts per prep block, 1..kPrepExperts (PrepExpertsPerBlock)
  unsigned long long* stamps;  // debug (JAX_EP_SETUP_STAMPS): the setup's phase times; null: none
};

// Where the setup kernel's time goes (docs/design.md §7, JAX_EP_SETUP_STAMPS):
// the control block's thread 0 notes the global timer after each phase
// (slots [0, kStampPhases)), each prep block its start and end
// (kStampPhases + 2 b, + 1). Off (null), a stamp is one untaken branch.
enum SetupStamp : int {
  kStampStart, kStampZeroed, kStampBarrier1, kStampConfig, kStampPrepWait, kStampCounts,
  kStampBarrier2, kStampReadCounts, kStampEnd, kStampPhases
};
constexpr int kStampSlots = 1024;
__device__ __forceinline__ void Stamp(const DispatchCfg& c, int slot) {
  if (c.stamps != nullptr && slot < kStampSlots) c.stamps[slot] = globaltimer_ns();
}

struct PushIO {
  const void* x;
  const float* x_scales;
  const int32_t* topk;
  const float* topk_w;
  int32_t* pos_in_rank;  // written by the prep blocks, read by the data kernel
  void* recv_x;
  float* recv_scales;
  int32_t* recv_topk_idx;
  float* recv_topk_w;
  int32_t* src_rank;
  int32_t* src_token;
  int32_t* src_k;
  int32_t* counts;
  int32_t* recv_counts;
};

__device__ __forceinline__ int* ScratchOf(const EpPeers& p, const DispatchWindow& w) {
  return reinterpret_cast<int*>(p.base[p.rank] + w.scratch_off);
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
  int* rie = reinterpret_cast<int*>(p.base[p.rank] + w.rie_off);
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
// (`prep_blocks` of them count kDispatchPrepCounter up; this block resets it).
__device__ __forceinline__ void DispatchControl(const DispatchCfg& c, const DispatchWindow& w,
                                                const EpPeers& p, const PushIO& io, int prep_blocks) {
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
  const PeerTransport tr{p, p.base[r], 0, {}};  // control words only
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
    if (!WaitBlocksDone(p, p.epoch + kDispatchPrepCounter, prep_blocks, Op::kDispatch)) fail = true;
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
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(p.base[r] + w.counts_off);
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
// blocks (ranks, then experts), so the start barrier (waiting for the
// peers) overlaps the prep instead of following it. Only block 0 waits,
// and only for blocks that never wait, so residency does not matter.
__global__ void __launch_bounds__(kControlThreads, 1) DispatchSetupKernel(DispatchCfg c, DispatchWindow w,
                                                                         EpPeers p, PushIO io) {
  if (blockIdx.x == 0) DispatchControl(c, w, p, io, static_cast<int>(gridDim.x) - 1);
  else DispatchPrep(c, w, p, io.topk, io.pos_in_rank, static_cast<int>(blockIdx.x) - 1);
}

// ---------------------------------------------------------------- data
// One kernel, two roles, so that the window -> output copy runs behind the
// link instead of after it:
//  - CTAs [0, S) send. Warp w takes tokens t = w, w + S*32, ...: it loads
//    x[t] once and stores it into every destination's window row [me][pos]
//    (then counts the row on that rank's chunk counter [me][pos / chunk]) and,
//    for this rank, straight into the output rows. pos grows with t, so the
//    chunks fill roughly in order.
//  - CTAs [S, S + Q) receive. Warp w takes positions w, w + Q*32, ... of
//    each source: it waits until the row's chunk is complete and copies it
//    from the window into the outputs (fanning out per local expert in
//    expert layout).
// Senders never wait, so the roles need not be co-resident.
//
// kSendOk (agreed by every rank in the control block) gates all sending and
// waiting; kOk (this rank's own view: no overflow either) gates all writes
// of outputs. A receiver that is not ok still drains its chunks, and the
// whole grid zeroes the outputs at the end.

// What a sender needs of token t, one word per lane: lane j < R its row
// position in rank j (-1: none), lane k < K its k-th expert id, weight and
// (expert layout) rank among this rank's entries for that expert. Loaded a
// token ahead of use so that no sender waits on them.
struct TokenMeta {
  int pos = -1, id = -1, rv = -1;
  float wt = 0.f;
};

__device__ __forceinline__ TokenMeta LoadTokenMeta(const DispatchCfg& c, int R, const PushIO& io,
                                                   const int* rie, int t) {
  const int lane = LaneId();
  TokenMeta m;
  if (lane < R) m.pos = io.pos_in_rank[static_cast<size_t>(t) * R + lane];
  if (lane < c.K) {
    const size_t i = static_cast<size_t>(t) * c.K + lane;
    m.id = io.topk[i];
    m.wt = io.topk_w[i];
    if (c.expert) m.rv = rie[i];
  }
  return m;
}

// Token t to the ranks in `dest` (lane j < R holds its row position in rank
// j as `pos`, and lane_rows = where row 0 of this rank's slot for rank j
// is: rank j's window, or for a GIN peer the staging area), payload
// cast to FP8 on the way if kCast. Returns with the stores possibly still
// in flight. kBulk: the payload goes through lane 0's bulk slots (one
// group per token, bulk_copy.cuh) instead of registers, from `slot`, where
// the caller has started loading the row (so that it loads while the warp
// still stores the previous token).
template <typename TIn, bool kCast, bool kBulk>
__device__ __forceinline__ void SendToken(const DispatchCfg& c, const DispatchWindow& w,
                                          const EpPeers& p, const PushIO& io, const int* scratch,
                                          int t, const TokenMeta& tm, unsigned dest,
                                          char* lane_rows, int local_prefix, BulkSlots& bulk,
                                          int slot) {
  static_assert(!(kBulk && kCast), "the cast needs the row in registers");
  const int R = p.nranks, r = p.rank, El = c.El, K = c.K;
  const DispatchScratch sc(R, c.E);
  const int lane = LaneId();
  const size_t in_row_bytes = static_cast<size_t>(c.H) * c.in_bytes;
  const char* xrow = static_cast<const char*>(io.x) + t * in_row_bytes;
  const unsigned remote_mask = dest & ~(1u << r);
  const bool to_me = (dest >> r) & 1u;
  const int pos = tm.pos, id = tm.id, rv = tm.rv;
  const float wt = tm.wt;
  const int drank = (id >= 0 && id < c.E) ? id / El : -1;
  // Lane j < R: this token's row in rank j's window.
  char* const lane_row = ((remote_mask >> lane) & 1u) ? lane_rows + static_cast<size_t>(pos) * w.row_bytes : nullptr;
  int local_row = -1;  // expert layout: output row of (t, lane) if its expert is here
  if (to_me && c.expert && drank == r) local_row = scratch[sc.src_off + (id - r * El) * R + r] + rv;
  const unsigned local_mask = __ballot_sync(kFullMask, local_row >= 0);
  const int my_pos = __shfl_sync(kFullMask, pos, r);
  const int rank_row = (to_me && !c.expert) ? local_prefix + my_pos : -1;
  const unsigned out_mask = c.expert ? local_mask : (rank_row >= 0 ? 1u : 0u);
  char* const recv_x = static_cast<char*>(io.recv_x);
  const int H128 = c.H / 128;
  // Lane i in out_mask: an output row this token fills here.
  const int lane_out = c.expert ? local_row : rank_row;
  char* const lane_out_row = lane_out >= 0 ? recv_x + static_cast<size_t>(lane_out) * w.payload_bytes : nullptr;
  auto lane_out_scales = [&]() -> float* {
    return lane_out >= 0 ? io.recv_scales + static_cast<size_t>(lane_out) * H128 : nullptr;
  };

  // Metadata: remote rows (ids already converted for that destination).
  for (unsigned m = remote_mask; m; m &= m - 1) {
    const int j = __ffs(m) - 1;
    int* meta = reinterpret_cast<int*>(ShflPtr(lane_row, j) + w.meta_off);
    if (lane < K) {
      const int lid = drank == j ? id - j * El : -1;
      meta[lane] = lid;
      reinterpret_cast<float*>(meta)[K + lane] = lid >= 0 ? wt : 0.f;
      meta[2 * K + lane] = lid >= 0 ? rv : -1;
    }
    if (lane == 0) meta[3 * K] = t;
  }
  // Metadata: local output rows.
  if (!c.expert) {
    if (rank_row >= 0) {
      if (lane < K) {
        const int lid = drank == r ? id - r * El : -1;
        io.recv_topk_idx[static_cast<size_t>(rank_row) * K + lane] = lid;
        io.recv_topk_w[static_cast<size_t>(rank_row) * K + lane] = lid >= 0 ? wt : 0.f;
      }
      if (lane == 0) {
        io.src_rank[rank_row] = r;
        io.src_token[rank_row] = t;
        io.src_k[rank_row] = -1;
      }
    }
  } else if (local_row >= 0) {
    io.recv_topk_idx[local_row] = id - r * El;
    io.recv_topk_w[local_row] = wt;
    io.src_rank[local_row] = r;
    io.src_token[local_row] = t;
    io.src_k[local_row] = lane;
  }

  if constexpr (kBulk) {
    bulk.Wait(slot);
    const uint32_t nb = static_cast<uint32_t>(in_row_bytes);
    for (unsigned m = remote_mask; m; m &= m - 1) bulk.Store(slot, ShflPtr(lane_row, __ffs(m) - 1), nb);
    for (unsigned m = out_mask; m; m &= m - 1) bulk.Store(slot, ShflPtr(lane_out_row, __ffs(m) - 1), nb);
    bulk.Commit();
  } else {
    const int nvec = static_cast<int>(in_row_bytes / 16);
    const uint4* xv = reinterpret_cast<const uint4*>(xrow);
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * 32 + lane;
        v[u] = idx < nvec ? LdNcNa(xv + idx) : make_uint4(0, 0, 0, 0);
      }
      if constexpr (!kCast) {
        for (unsigned m = remote_mask; m; m &= m - 1)
          StoreChunk(reinterpret_cast<uint4*>(ShflPtr(lane_row, __ffs(m) - 1)), base, nvec, lane, v);
        for (unsigned m = out_mask; m; m &= m - 1)
          StoreChunk(reinterpret_cast<uint4*>(ShflPtr(lane_out_row, __ffs(m) - 1)), base, nvec, lane, v);
      } else {
        constexpr int LPB = kFp8Block / Vec16<TIn>::N;  // lanes per 128-channel block
        using QT = Fp8Vec<TIn>;
        QT q[kUnroll];
        float s[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) q[u] = CastVec16Fp8<TIn>(v[u], c.ue8m0 != 0, s[u]);
        // Each lane's 16 input bytes become V output bytes at channel idx*V.
        auto put = [&](char* row, float* srow) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int idx = base + u * 32 + lane;
            if (idx < nvec) {
              reinterpret_cast<QT*>(row)[idx] = q[u];
              if (lane % LPB == 0) srow[idx / LPB] = s[u];
            }
          }
        };
        for (unsigned m = remote_mask; m; m &= m - 1) {
          char* row = ShflPtr(lane_row, __ffs(m) - 1);
          put(row, reinterpret_cast<float*>(row + w.scales_off));
        }
        for (unsigned m = out_mask; m; m &= m - 1)
          put(ShflPtr(lane_out_row, __ffs(m) - 1), ShflPtr(lane_out_scales(), __ffs(m) - 1));
      }
    }
  }
  // FP8 input: the scales travel with the row.
  if (!kCast && c.has_scales) {
    const float* xs = io.x_scales + static_cast<size_t>(t) * H128;
    for (unsigned m = remote_mask; m; m &= m - 1) {
      float* srow = reinterpret_cast<float*>(ShflPtr(lane_row, __ffs(m) - 1) + w.scales_off);
      for (int i = lane; i < H128; i += 32) srow[i] = xs[i];
    }
    for (unsigned m = out_mask; m; m &= m - 1) {
      float* srow = ShflPtr(lane_out_scales(), __ffs(m) - 1);
      for (int i = lane; i < H128; i += 32) srow[i] = xs[i];
    }
  }
}

struct RowWriter {
  const DispatchCfg& c;
  const DispatchWindow& w;
  const PushIO& io;
  int lane;

  __device__ void Zero(int row) const {
    const int nv = static_cast<int>(w.payload_bytes / 16);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(io.recv_x) + static_cast<size_t>(row) * w.payload_bytes);
    for (int i = lane; i < nv; i += 32) StNa(dst + i, make_uint4(0, 0, 0, 0));
    if (c.has_scales) {
      const int H128 = c.H / 128;
      for (int i = lane; i < H128; i += 32) io.recv_scales[static_cast<size_t>(row) * H128 + i] = 0.f;
    }
    if (!c.expert) {
      if (lane < c.K) {
        io.recv_topk_idx[static_cast<size_t>(row) * c.K + lane] = -1;
        io.recv_topk_w[static_cast<size_t>(row) * c.K + lane] = 0.f;
      }
    } else if (lane == 0) {
      io.recv_topk_idx[row] = -1;
      io.recv_topk_w[row] = 0.f;
    }
    if (lane == 0) {
      io.src_rank[row] = -1;
      io.src_token[row] = -1;
      io.src_k[row] = -1;
    }
  }
};

// Row p from source s (already complete in this rank's window) into the
// outputs: rank layout row prefix[s] + p; expert layout one row per local
// expert the token chose, at the sender's rie inside the (expert, s) block.
// kBulk: the payload through lane 0's bulk slots, one group per row, from
// `slot`, where the caller has started loading it (RecvLoad).
template <bool kBulk>
__device__ __forceinline__ void RecvRow(const DispatchCfg& c, const DispatchWindow& w,
                                        const EpPeers& p, const PushIO& io, const int* scratch,
                                        const int* s_prefix, int s, int pos, BulkSlots& bulk,
                                        int slot) {
  const int R = p.nranks, El = c.El, K = c.K;
  const DispatchScratch sc(R, c.E);
  const int lane = LaneId();
  const char* src = p.base[p.rank] + w.row(s, pos, c.T);
  const int* meta = reinterpret_cast<const int*>(src + w.meta_off);
  char* recv_x = static_cast<char*>(io.recv_x);
  const int nvec = static_cast<int>(w.payload_bytes / 16);
  const int H128 = c.H / 128;
  const uint4* sv = reinterpret_cast<const uint4*>(src);
  const uint32_t nb = static_cast<uint32_t>(w.payload_bytes);
  if (!c.expert) {
    const int row = s_prefix[s] + pos;
    uint4* dst = reinterpret_cast<uint4*>(recv_x + static_cast<size_t>(row) * w.payload_bytes);
    if constexpr (kBulk) {
      bulk.Wait(slot);
      bulk.Store(slot, dst, nb);
      bulk.Commit();
    } else {
      for (int base = 0; base < nvec; base += 32 * kUnroll) {
        uint4 v[kUnroll];
        LoadChunk(sv, base, nvec, lane, v);
        StoreChunk(dst, base, nvec, lane, v);
      }
    }
    if (c.has_scales) {
      const float* ss = reinterpret_cast<const float*>(src + w.scales_off);
      for (int i = lane; i < H128; i += 32) io.recv_scales[static_cast<size_t>(row) * H128 + i] = ss[i];
    }
    if (lane < K) {
      io.recv_topk_idx[static_cast<size_t>(row) * K + lane] = meta[lane];
      io.recv_topk_w[static_cast<size_t>(row) * K + lane] = reinterpret_cast<const float*>(meta)[K + lane];
    }
    if (lane == 0) {
      io.src_rank[row] = s;
      io.src_token[row] = meta[3 * K];
      io.src_k[row] = -1;
    }
    return;
  }
  int lid = -1, orow = -1;
  if (lane < K) {
    lid = meta[lane];
    if (lid >= 0 && lid < El) orow = scratch[sc.src_off + lid * R + s] + meta[2 * K + lane];
  }
  const unsigned omask = __ballot_sync(kFullMask, orow >= 0);
  const int tok = meta[3 * K];
  if (orow >= 0) {
    io.recv_topk_idx[orow] = lid;
    io.recv_topk_w[orow] = reinterpret_cast<const float*>(meta)[K + lane];
    io.src_rank[orow] = s;
    io.src_token[orow] = tok;
    io.src_k[orow] = lane;
  }
  if constexpr (kBulk) {
    bulk.Wait(slot);
    for (unsigned m = omask; m; m &= m - 1) {
      const int o = __shfl_sync(kFullMask, orow, __ffs(m) - 1);
      bulk.Store(slot, recv_x + static_cast<size_t>(o) * w.payload_bytes, nb);
    }
    bulk.Commit();
  } else {
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 v[kUnroll];
      LoadChunk(sv, base, nvec, lane, v);
      for (unsigned m = omask; m; m &= m - 1) {
        const int o = __shfl_sync(kFullMask, orow, __ffs(m) - 1);
        StoreChunk(reinterpret_cast<uint4*>(recv_x + static_cast<size_t>(o) * w.payload_bytes), base, nvec, lane, v);
      }
    }
  }
  if (c.has_scales) {
    const float* ss = reinterpret_cast<const float*>(src + w.scales_off);
    for (unsigned m = omask; m; m &= m - 1) {
      const int o = __shfl_sync(kFullMask, orow, __ffs(m) - 1);
      float* srow = io.recv_scales + static_cast<size_t>(o) * H128;
      for (int i = lane; i < H128; i += 32) srow[i] = ss[i];
    }
  }
}

// Start loading row `pos` from source s (its count acquired: WaitRow) into
// a slot; kReadPending as BulkSlots::Begin (0 while the warp still holds an
// uncommitted row in the other slot).
template <int kReadPending>
__device__ __forceinline__ int RecvLoad(const DispatchCfg& c, const DispatchWindow& w, const EpPeers& p,
                                        int s, int pos, BulkSlots& bulk) {
  FenceBeforeBulkRead();
  return bulk.Load<kReadPending>(p.base[p.rank] + w.row(s, pos, c.T), static_cast<uint32_t>(w.payload_bytes));
}

// kBulk: rows move through shared memory by bulk copies (bulk_copy.cuh);
// `slot_bytes` per slot, kBulkSlots slots per warp in dynamic shared memory.
template <typename TIn, bool kCast, int kThreads, bool kBulk>
__global__ void __launch_bounds__(kThreads, 1) DispatchDataKernel(DispatchCfg c, DispatchWindow w,
                                                                   EpPeers p, PushIO io,
                                                                   int send_blocks, uint32_t slot_bytes) {
  __shared__ int s_prefix[kMaxRanks + 1];
  __shared__ int s_sends[kMaxRanks];  // rows this rank sends to rank j
  __shared__ uint64_t s_bar[kBulk ? kThreads / 32 * kBulkSlots : 1];
  extern __shared__ __align__(128) char s_rows[];
  const int R = p.nranks, r = p.rank;
  const DispatchScratch sc(R, c.E);
  const int* scratch = ScratchOf(p, w);
  const bool send_ok = scratch[DispatchScratch::kSendOk] != 0;  // grid-uniform
  if (threadIdx.x <= R) s_prefix[threadIdx.x] = scratch[sc.prefix + threadIdx.x];
  if (threadIdx.x < R) s_sends[threadIdx.x] = send_ok ? scratch[sc.tokens_per_rank + threadIdx.x] : 0;
  __syncthreads();
  char* const my = p.base[r];
  const bool ok = scratch[DispatchScratch::kOk] != 0;           // grid-uniform
  const int lane = LaneId();
  constexpr int kWarps = kThreads / 32;
  const int gwarp = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x >> 5);
  const int gwarps = static_cast<int>(gridDim.x) * kWarps;
  const RowWriter out{c, w, io, lane};
  const int chunk = ChunkRows(c.T);
  BulkSlots bulk = WarpBulkSlots<kBulk>(s_rows, s_bar, slot_bytes);

  // Padding and tail rows are not data rows of anyone: fill them first.
  if (ok) {
    if (!c.expert) {
      for (int row = s_prefix[R] + gwarp; row < c.C; row += gwarps) out.Zero(row);
    } else {
      for (int e = gwarp; e < c.El; e += gwarps) {
        const int end = scratch[sc.group_off + e + 1];
        for (int row = scratch[sc.group_off + e] + scratch[sc.group_size + e]; row < end; ++row) out.Zero(row);
      }
      for (int row = scratch[sc.group_off + c.El] + gwarp; row < c.C; row += gwarps) out.Zero(row);
    }
  }

  if (send_ok && static_cast<int>(blockIdx.x) < send_blocks) {
    const int* rie = reinterpret_cast<const int*>(p.base[r] + w.rie_off);
    // Indexing the by-value EpPeers with a runtime rank goes through local
    // memory; do it once per thread, then move pointers between lanes.
    char* const lane_base = p.base[lane < R ? lane : 0];  // null for a GIN peer
    const int jl = lane < R ? lane : 0;
    const PeerTransport tr{p, my, chunk, {w.stage_off, w.recv_off, w.row_bytes, c.T, c.gin_rows}};
    char* const lane_rows = tr.RowSlot(jl, lane_base, 0);  // my [0..T) rows for lane's peer
    const int lane_sends = s_sends[jl];
    uint32_t gin_channels = 0;
    // kBulk: a token's rows are counted once its bulk group has written
    // them, which is checked after the next token's stores are issued, so
    // two tokens' stores stay in flight.
    unsigned pend_remote = 0;
    int pend_pos = -1;
    const int stride = send_blocks * kWarps;
    const size_t in_row_bytes = static_cast<size_t>(c.H) * c.in_bytes;
    auto xrow = [&](int t) { return static_cast<const char*>(io.x) + t * in_row_bytes; };
    // The first token at or after t that has rows to send, with its
    // metadata and destinations; c.T when none is left. `m` holds t's
    // metadata on entry (loaded ahead); later candidates load here.
    auto next_token = [&](int t, TokenMeta& m, unsigned& dest) {
      for (bool first = true; t < c.T; t += stride, first = false) {
        if (!first) m = LoadTokenMeta(c, R, io, rie, t);
        dest = __ballot_sync(kFullMask, m.pos >= 0);
        if (!ok) dest &= ~(1u << r);  // peers still get their rows; our outputs get zeros
        if (dest != 0) return t;
      }
      return c.T;
    };
    auto load_ahead = [&](int t) { return t < c.T ? LoadTokenMeta(c, R, io, rie, t) : TokenMeta{}; };
    int slot = -1;
    unsigned dest = 0;
    TokenMeta m = load_ahead(gwarp);
    int t = next_token(gwarp, m, dest);
    if (kBulk && t < c.T) slot = bulk.Load<0>(xrow(t), static_cast<uint32_t>(in_row_bytes));
    TokenMeta m2 = load_ahead(t + stride);  // the next candidate's
    while (t < c.T) {
      int slot2 = -1;
      unsigned dest2 = 0;
      const int t2 = next_token(t + stride, m2, dest2);
      // kBulk: the next token's row loads while this one's is placed and
      // stored (two loads in flight: a warp's rows are latency-bound).
      if (kBulk && t2 < c.T) slot2 = bulk.Load<0>(xrow(t2), static_cast<uint32_t>(in_row_bytes));
      // (Register copies: no deeper look-ahead, it would spill at 64 registers.)
      const TokenMeta m3 = kBulk ? load_ahead(t2 + stride) : TokenMeta{};
      SendToken<TIn, kCast, kBulk>(c, w, p, io, scratch, t, m, dest, lane_rows, s_prefix[r], bulk, slot);
      const int pos = m.pos;
      const unsigned remote = dest & ~(1u << r);
      if constexpr (kBulk) {
        if (pend_remote != 0) {
          bulk.WaitAllButNewest();
          tr.RowsWritten(Op::kDispatch, pend_remote, lane_base, jl, pend_pos, lane_sends, gin_channels);
        }
        pend_remote = remote;
        pend_pos = pos;
      } else if (remote != 0) {
        tr.RowsWritten(Op::kDispatch, remote, lane_base, jl, pos, lane_sends, gin_channels);
      }
      t = t2;
      m = m2;
      m2 = kBulk ? m3 : load_ahead(t + stride);
      dest = dest2;
      slot = slot2;
    }
    if constexpr (kBulk) bulk.WaitAll();
    if (kBulk && pend_remote != 0)
      tr.RowsWritten(Op::kDispatch, pend_remote, lane_base, jl, pend_pos, lane_sends, gin_channels);
    tr.Flush(gin_channels);
  } else if (send_ok) {
    const int rwarp = gwarp - send_blocks * kWarps;
    const int nrw = gwarps - send_blocks * kWarps;
    int maxn = 0;
    for (int s = 0; s < R; ++s) if (s != r) maxn = max(maxn, s_prefix[s + 1] - s_prefix[s]);
    const unsigned long long t0 = globaltimer_ns();
    const PeerTransport tr{p, my, chunk, {w.stage_off, w.recv_off, w.row_bytes, c.T, c.gin_rows}};
    // Rows in order: positions rwarp, rwarp + nrw, ...; at each, the
    // sources d = 1 .. R-1 ranks back (the one that sends to us first,
    // first). next_row gives the next (s, pos) that exists.
    int ipos = rwarp, id = 1;
    auto next_row = [&](int& s, int& pos) {
      for (; ipos < maxn; ipos += nrw, id = 1) {
        for (; id < R; ++id) {
          const int src = (r - id + R) % R;
          if (ipos < s_prefix[src + 1] - s_prefix[src]) {
            s = src;
            pos = ipos;
            ++id;
            return true;
          }
        }
      }
      return false;
    };
    auto wait_row = [&](int s, int pos) {
      return tr.WaitRow(Op::kDispatch, s, pos, s_prefix[s + 1] - s_prefix[s], t0);
    };
    int s = 0, pos = 0, slot = -1;
    bool have = next_row(s, pos);
    bool alive = !have || wait_row(s, pos);
    if (kBulk && have && alive && ok) slot = RecvLoad<0>(c, w, p, s, pos, bulk);
    while (have && alive) {
      // kBulk: the next row loads while this one is placed, if it has
      // arrived; else this one is placed first (a finished row is not held
      // back waiting for a later one).
      int s2 = 0, pos2 = 0, slot2 = -1;
      const bool have2 = next_row(s2, pos2);
      const bool early = kBulk && have2 && ok && tr.RowArrived(Op::kDispatch, s2, pos2, s_prefix[s2 + 1] - s_prefix[s2]);
      bool alive2 = true;
      if (early) {
        alive2 = wait_row(s2, pos2);
        if (alive2) slot2 = RecvLoad<0>(c, w, p, s2, pos2, bulk);
      }
      if (ok) RecvRow<kBulk>(c, w, p, io, scratch, s_prefix, s, pos, bulk, slot);
      if (have2 && !early) {
        alive2 = wait_row(s2, pos2);
        if (kBulk && alive2 && ok) slot2 = RecvLoad<1>(c, w, p, s2, pos2, bulk);
      }
      s = s2;
      pos = pos2;
      slot = slot2;
      have = have2;
      alive = alive2;
    }
    if constexpr (kBulk) bulk.WaitAll();
  }

  if (!ok) {
    for (int row = gwarp; row < c.C; row += gwarps) out.Zero(row);
  }
}

}  // namespace

// ---------------------------------------------------------------- host

// Launch-tuning environment variables, read once per process (the
// launchers run on every call).
static int EnvInt(const char* name) {
  const char* env = std::getenv(name);
  return env ? std::atoi(env) : 0;
}

// fn(device) for the current device, asked once per device (0 in `cache`:
// not asked yet; fn returns > 0); `fallback` where the device is unknown.
template <typename F>
static int OncePerDevice(std::atomic<int> (&cache)[64], int fallback, F fn) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return fallback;
  if (dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v != 0) return v;
  }
  const int v = fn(dev);
  if (dev < 64) cache[dev].store(v, std::memory_order_relaxed);
  return v;
}

bool BulkCopiesEnabled() {
  static const bool on = [] {
    const char* e = std::getenv("JAX_EP_BULK");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  if (!on) return false;
  // The launch's device: sm_90 or newer with the shared memory the slots
  // and the kernels' static shared memory take (1: no, 2: yes).
  static std::atomic<int> known[64] = {};
  return OncePerDevice(known, 1, [](int dev) {
           int major = 0, optin = 0;
           const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                           cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
                           major >= 9 && static_cast<size_t>(optin) >= kBulkSmemBytes + 1024;
           return ok ? 2 : 1;
         }) == 2;
}

// The data kernels' SM budget beside compute (docs/design.md §6, DeepEP's
// default).
constexpr int kSmBudget = 24;

// SMs of the launch's device (the budget where it cannot be asked).
static int LaunchDeviceSms() {
  int dev = 0;
  const int n = cudaGetDevice(&dev) == cudaSuccess ? DeviceSms(dev) : 0;
  return n > 0 ? n : kSmBudget;
}

// JAX_EP_SETUP_STAMPS=1 (docs/design.md §7): the setup kernel's phase
// times, printed to stderr by a host function queued behind it on the
// stream (so no call waits for the host). Mapped pinned memory, one buffer
// per device: the kernel writes it and the host function reads it. Not in
// a stream capture (a replayed host node would reuse its report, and the
// first allocation may not happen there).
static unsigned long long* SetupStampsBuffer(cudaStream_t stream) {
  static const bool on = EnvInt("JAX_EP_SETUP_STAMPS") > 0;
  if (!on) return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return nullptr;
  }
  static std::mutex mu;
  static unsigned long long* bufs[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (bufs[dev] == nullptr) {
    void* ptr = nullptr;
    if (cudaHostAlloc(&ptr, sizeof(unsigned long long) * kStampSlots, cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    std::memset(ptr, 0, sizeof(unsigned long long) * kStampSlots);
    bufs[dev] = static_cast<unsigned long long*>(ptr);
  }
  return bufs[dev];
}

struct StampReport {
  const unsigned long long* stamps;
  int prep_blocks, rank_blocks, expert;
};

static void CUDART_CB PrintSetupStamps(void* arg) {
  const StampReport* r = static_cast<const StampReport*>(arg);
  const unsigned long long* t = r->stamps;
  const auto us = [&](unsigned long long x) { return (static_cast<double>(x) - static_cast<double>(t[0])) * 1e-3; };
  static const char* kNames[kStampPhases] = {"start", "zeroed", "barrier1", "config", "prep_wait",
                                             "counts", "barrier2", "read_counts", "end"};
  std::string line = r->expert ? "jax_ep setup stamps (expert layout), us:" : "jax_ep setup stamps (rank layout), us:";
  char buf[96];
  for (int i = 1; i < kStampPhases; ++i) {
    std::snprintf(buf, sizeof(buf), " %s %.2f", kNames[i], us(t[i]));
    line += buf;
  }
  // Prep blocks: the rank blocks, then the expert blocks (first start, last end).
  for (int part = 0; part < 2; ++part) {
    const int b0 = part == 0 ? 0 : r->rank_blocks, b1 = part == 0 ? r->rank_blocks : r->prep_blocks;
    if (b1 <= b0) continue;
    double first = 1e30, last = -1e30, longest = 0;
    for (int b = b0; b < b1 && kStampPhases + 2 * b + 1 < kStampSlots; ++b) {
      const double a = us(t[kStampPhases + 2 * b]), e = us(t[kStampPhases + 2 * b + 1]);
      first = std::min(first, a);
      last = std::max(last, e);
      longest = std::max(longest, e - a);
    }
    std::snprintf(buf, sizeof(buf), " | %s prep x%d: first start %.2f, last end %.2f, longest %.2f",
                  part == 0 ? "rank" : "expert", b1 - b0, first, last, longest);
    line += buf;
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  delete r;
}

// Experts per expert-layout prep block: the fewest that keep the blocks
// (beside the control block and the R rank blocks) within one wave of SMs.
static int PrepExpertsPerBlock(int E, int R, int sms) {
  const int free_sms = std::max(1, sms - 1 - R);
  return std::min(kPrepExperts, std::max(1, (E + free_sms - 1) / free_sms));
}

int ChooseNumBlocks(int requested, int work_items, int warps_per_block, int num_ranks, bool beside_compute) {
  static const int env_sms = EnvInt("JAX_EP_NUM_SMS");
  int cap = requested > 0 ? requested : env_sms;
  if (cap <= 0) {
    // Little's law: a link of B bytes/s with latency L needs B*L bytes in
    // flight. NVLink on H200 ~450 GB/s per direction, ~2 µs from load issue
    // to remote store completion -> ~0.9 MB. One CTA of 32 warps with
    // kUnroll 16-byte loads per lane keeps 64 KiB in flight -> ~14 CTAs for
    // the link. The same kernels also copy the local 1/R share of the rows
    // through HBM, so scale by R/(R-1); cap at 24 SMs (docs/design.md §6 budget,
    // DeepEP's default) so the op leaves the rest of the GPU to compute.
    // (This counts register copies; the bulk kernels' 8 or 16 warps give
    // fewer bytes per CTA by this count, so they always reach the cap,
    // although each of their warps keeps two whole rows in flight.)
    const double bytes_in_flight = 450e9 * 2e-6;
    const double per_cta = warps_per_block * 32.0 * kUnroll * 16.0;
    double ctas = std::ceil(bytes_in_flight / per_cta);
    if (num_ranks > 1) ctas = std::ceil(ctas * num_ranks / (num_ranks - 1.0));
    cap = static_cast<int>(std::min(ctas, static_cast<double>(kSmBudget)));
    // One rank: no link and no peer, so nothing to leave SMs for; the op is
    // a local copy (HBM to HBM) on the step's critical path, bound by the
    // SMs it gets (benchmarks/RESULTS.md, 2026-12-02: 24 CTAs 1.7 x slower
    // than 132 in dispatch): every SM, like XLA's own copies -- unless it
    // runs beside the compute it should overlap (a *_start), which keeps
    // the budget.
    if (num_ranks == 1 && !beside_compute) cap = LaunchDeviceSms();
  }
  const int needed = (work_items + warps_per_block - 1) / warps_per_block;
  return std::max(1, std::min(cap, needed));
}

void SplitDataBlocks(int requested, int recv_requested, int work_items, int warps_per_block,
                     int num_ranks, double recv_share, bool beside_compute, int* send_blocks,
                     int* recv_blocks) {
  const int total = ChooseNumBlocks(requested, work_items, warps_per_block, num_ranks, beside_compute);
  static const int env_recv = EnvInt("JAX_EP_RECV_SMS");
  int q = 0;
  if (num_ranks > 1) {
    // At least one of each, also when the work needs a single CTA: remote
    // rows are only ever consumed by receivers.
    q = recv_requested > 0 ? recv_requested
        : env_recv > 0     ? env_recv
                           : static_cast<int>(std::lround(total * recv_share));
    q = std::min(std::max(q, 1), std::max(total - 1, 1));
  }
  *recv_blocks = q;
  *send_blocks = std::max(1, total - q);
}

size_t DispatchWindowBytes(int R, int T, int H, int K, int E, EpDtype payload, bool fp8_scales) {
  return DispatchWindow(R, T, H, K, E, EpDtypeBytes(payload), fp8_scales).end;
}

size_t DispatchWindowNeed(const DispatchArgs& a, int R) {
  const bool fp8 = a.cast_fp8 || a.x_dtype == EpDtype::kFp8E4m3;
  return DispatchWindowBytes(R, a.num_tokens, a.hidden, a.topk, a.num_experts,
                             fp8 ? EpDtype::kFp8E4m3 : a.x_dtype, fp8);
}

std::string ValidateDispatch(const DispatchArgs& a, const EpPeers& p) {
  const int R = p.nranks;
  auto s = [](long long v) { return std::to_string(v); };
  if (R < 1 || R > kMaxRanks) return "number of ranks " + s(R) + " outside [1, " + s(kMaxRanks) + "]";
  if (a.num_tokens < 0) return "num_tokens must be >= 0";
  if (a.topk < 1 || a.topk > kMaxTopk) return "topk " + s(a.topk) + " outside [1, 32]";
  if (a.num_experts < 1 || a.num_experts % R) return "num_experts " + s(a.num_experts) + " must be a positive multiple of " + s(R);
  if (a.num_experts / R > kMaxLocalExperts) return "local experts " + s(a.num_experts / R) + " > 1024";
  if (a.capacity < 1) return "capacity must be >= 1";
  if (a.expert_alignment < 1) return "expert_alignment must be >= 1";
  if (a.hidden < 1) return "hidden must be >= 1";
  const bool fp8_in = a.x_dtype == EpDtype::kFp8E4m3;
  if (a.cast_fp8 && fp8_in) return "x is already FP8";
  if ((a.cast_fp8 || fp8_in) && a.hidden % 128) return "hidden " + s(a.hidden) + " must be a multiple of 128 for FP8";
  const int in_bytes = EpDtypeBytes(a.x_dtype);
  if ((static_cast<long long>(a.hidden) * in_bytes) % 16)
    return "row bytes (hidden * " + s(in_bytes) + " = " + s(static_cast<long long>(a.hidden) * in_bytes) + ") must be a multiple of 16";
  if (static_cast<long long>(a.num_tokens) * a.topk >= (1ll << 31) || static_cast<long long>(a.capacity) >= (1ll << 31))
    return "too many tokens";
  const size_t need = DispatchWindowNeed(a, R);
  if (need > p.window_bytes)
    return "the communicator's window (" + s(p.window_bytes) + " bytes) is too small for this dispatch: needs " +
           s(need) + " bytes (create the Communicator with num_bytes >= this)";
  return "";
}

namespace {

// The data kernel LaunchDispatch runs for `a` (every variant has one
// signature), its block size and dynamic shared memory. Rows that fit a
// slot move by bulk copies (bulk_copy.cuh); the cast needs them in
// registers. JAX_EP_BULK=0 keeps the register copy.
struct DispatchDataChoice {
  void (*fn)(DispatchCfg, DispatchWindow, EpPeers, PushIO, int, uint32_t);
  int threads;
  size_t smem;
  uint32_t slot_bytes;
};

DispatchDataChoice ChooseDispatchData(const DispatchArgs& a, const DispatchWindow& w) {
  const uint32_t slot_bytes = static_cast<uint32_t>(w.payload_bytes);  // a multiple of 16
  const int bulk_warps = BulkCopiesEnabled() && !a.cast_fp8 ? BulkWarpsFor(slot_bytes) : 0;
  if (bulk_warps > 0) {
    return {bulk_warps == kBulkMaxWarps ? DispatchDataKernel<uint8_t, false, kBulkMaxWarps * 32, true>
                                        : DispatchDataKernel<uint8_t, false, 8 * 32, true>,
            bulk_warps * 32, static_cast<size_t>(bulk_warps) * kBulkSlots * slot_bytes, slot_bytes};
  }
  if (!a.cast_fp8) return {DispatchDataKernel<uint8_t, false, kDataThreads, false>, kDataThreads, 0, 0};
  if (a.x_dtype == EpDtype::kBF16)
    return {DispatchDataKernel<__nv_bfloat16, true, kCastThreads, false>, kCastThreads, 0, 0};
  if (a.x_dtype == EpDtype::kF16) return {DispatchDataKernel<__half, true, kCastThreads, false>, kCastThreads, 0, 0};
  return {DispatchDataKernel<float, true, kCastThreads, false>, kCastThreads, 0, 0};
}

}  // namespace

// Every kernel LaunchDispatch can pick (ChooseDispatchData's variants).
cudaError_t LoadDispatchKernels() {
  return LoadEach(DispatchSetupKernel, DispatchDataKernel<uint8_t, false, kBulkMaxWarps * 32, true>,
                  DispatchDataKernel<uint8_t, false, 8 * 32, true>, DispatchDataKernel<uint8_t, false, kDataThreads, false>,
                  DispatchDataKernel<__nv_bfloat16, true, kCastThreads, false>,
                  DispatchDataKernel<__half, true, kCastThreads, false>,
                  DispatchDataKernel<float, true, kCastThreads, false>);
}

cudaError_t LaunchDispatch(const DispatchArgs& a, const EpPeers& p, cudaStream_t stream) {
  const int R = p.nranks;
  const bool fp8_in = a.x_dtype == EpDtype::kFp8E4m3;
  const bool fp8 = a.cast_fp8 || fp8_in;
  DispatchCfg c{};
  c.T = a.num_tokens;
  c.H = a.hidden;
  c.K = a.topk;
  c.E = a.num_experts;
  c.El = a.num_experts / R;
  c.C = a.capacity;
  c.align = a.expert_alignment;
  c.expert = a.layout == EpLayout::kExpert;
  c.in_bytes = EpDtypeBytes(a.x_dtype);
  c.has_scales = fp8;
  c.ue8m0 = a.ue8m0;
  const DispatchWindow w(R, c.T, c.H, c.K, c.E, fp8 ? 1 : c.in_bytes, fp8);
  c.gin_rows = p.gin_mask != 0 ? GinChunkRows(c.T) : 0;
  PushIO io{a.x, a.x_scales, a.topk_idx, a.topk_weights, a.pos_in_rank, a.recv_x, a.recv_scales,
            a.recv_topk_idx, a.recv_topk_weights, a.recv_src_rank, a.recv_src_token, a.recv_src_k,
            a.counts, a.recv_counts};
  // Allowed before the setup kernel starts waiting on the peers (the kernel
  // itself was loaded with the Communicator, kernel_load.h).
  const DispatchDataChoice k = ChooseDispatchData(a, w);
  if (k.smem > 0) {
    if (cudaError_t err = AllowBulkSmem(k.fn, k.smem); err != cudaSuccess) return err;
  }

  const int nslots = c.expert ? w.counts_stride : 2;
  // The prep blocks read topk twice (count, then place), through L1; after a
  // bulk data kernel the SMs sit in its all-shared-memory split, and the
  // setup took ~4 us longer there than after register copies (2026-12-02:
  // 17.6 against 13.6; asking for all-shared made it no better). A guess
  // to measure: ask for the largest L1.
  if (cudaFuncSetAttribute(DispatchSetupKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxL1) != cudaSuccess)
    (void)cudaGetLastError();  // a hint: the launch works without it
  // Beside compute (a *_start), the prep takes about as many SMs as the data
  // kernel's budget instead of all of them.
  c.prep_experts = PrepExpertsPerBlock(c.E, R, a.start ? kSmBudget + 1 + R : LaunchDeviceSms());
  const int expert_blocks = c.expert ? (c.E + c.prep_experts - 1) / c.prep_experts : 0;
  c.stamps = SetupStampsBuffer(stream);
  DispatchSetupKernel<<<1 + R + expert_blocks, kControlThreads, sizeof(int) * R * nslots, stream>>>(c, w, p, io);
  if (c.stamps != nullptr) {
    auto* report = new StampReport{c.stamps, R + expert_blocks, R, c.expert};
    if (cudaLaunchHostFunc(stream, PrintSetupStamps, report) != cudaSuccess) {
      (void)cudaGetLastError();  // debugging output only: the op goes on
      delete report;
    }
  }

  // One grid: S sending CTAs, Q receiving CTAs (none with one rank).
  int send_blocks = 0, recv_blocks = 0;
  // Receivers copy HBM to HBM what the link brings in: half of the CTAs
  // (measured: 12/12 of 24 beat 16/8 by 9 us at the Normal shape); a quarter
  // when the senders also quantise and the rows are half as long.
  SplitDataBlocks(a.num_sms, a.recv_sms, c.T, k.threads / 32, R, a.cast_fp8 ? 0.25 : 0.5, a.start,
                  &send_blocks, &recv_blocks);
  k.fn<<<send_blocks + recv_blocks, k.threads, k.smem, stream>>>(c, w, p, io, send_blocks, k.slot_bytes);
  return cudaGetLastError();
}

}  // namespace jax_ep
