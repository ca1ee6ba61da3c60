// Low-latency dispatch / combine kernels (low_latency.cuh has the protocol
// and the window layout; docs/low_latency.md the why).
//
// Both kernels run every CTA at once (grid <= SMs, one CTA per SM): CTAs
// that wait for peers never block CTAs that still send.
#include <algorithm>
#include <cstring>
#include <string>

#include "barrier.cuh"
#include "config_check.cuh"
#include "ep_copy.cuh"
#include "abort.h"
#include "fp8.cuh"
#include "kernel_load.h"
#include "low_latency.cuh"
#include "low_latency_peers.cuh"
#include "peer.cuh"

namespace jax_ep {
namespace {

constexpr int kLlThreads = 512;
constexpr int kLlWarps = kLlThreads / 32;

// This call's OpConfig record (config_check.cuh): what a sender's words and
// rows follow from. The combine has no FP8 (field 6 stays 0).
__device__ __forceinline__ OpConfig LlConfig(Op op, int T, const LlLayout& L, bool fp8, uint64_t seq) {
  const uint32_t v[] = {static_cast<uint32_t>(T),       static_cast<uint32_t>(L.H),
                        static_cast<uint32_t>(L.K),     static_cast<uint32_t>(L.E_l * L.R),
                        static_cast<uint32_t>(L.M),     static_cast<uint32_t>(L.base_off / kLlAlign),
                        static_cast<uint32_t>(fp8)};
  OpConfig c = MakeOpConfig(op, v);
  c.tag = static_cast<uint32_t>(seq);
  return c;
}

// One thread, after a receive found the sources in `mismatched` (a bit
// each) with another configuration: names the first (with both records),
// and makes every rank's next call reset the layout (kLlMismatchCounter).
template <LlPart kPart>
__device__ void ReportLlMismatch(const EpPeers& p, Op op, uint32_t mismatched, const OpConfig& mine,
                                 unsigned long long* ctr) {
  const int j = __ffs(mismatched) - 1;
  bool torn = false;
  ReportConfigMismatch(p, op, j, mine, ReadConfig(p, j, &torn));
  if constexpr (kPart == LlPart::kRecv) {
    ctr[kLlLayoutCounter] = 0;  // the send recorded it already; M = 0 never matches
  } else {
    ctr[kLlMismatchCounter] = 1;  // read by this kernel's Finish
  }
  __threadfence();
}

// Every CTA calls this once its sends are issued: makes them visible, then
// counts itself. CTA 0 then waits for all, so whatever it publishes next
// (the count / flag words, with release stores) is ordered after every
// CTA's rows. The wait assumes every CTA is resident (grid <= SMs); if some
// are kept off the GPU past the timeout it reports instead of hanging.
__device__ void AllSent(const EpPeers& p, Op op, unsigned long long* sent) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    atomicAdd(sent, 1ull);
    if (blockIdx.x == 0) {
      const unsigned long long t0 = globaltimer_ns();
      while (*reinterpret_cast<volatile unsigned long long*>(sent) < gridDim.x) {
        if (globaltimer_ns() - t0 > p.timeout_ns) {
          report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(p.rank));
          break;
        }
      }
      __threadfence_system();
    }
  }
  __syncthreads();
}

// The layout key a sending kernel compares with the device's record
// (low_latency.cuh, "Layout changes").
struct LlKey {
  unsigned long long v[5];
  __device__ explicit LlKey(const LlLayout& L)
      : v{static_cast<unsigned long long>(L.M), static_cast<unsigned long long>(L.H),
          static_cast<unsigned long long>(L.K), static_cast<unsigned long long>(L.E_l) * L.R,
          static_cast<unsigned long long>(L.base_off)} {}
  __device__ bool Recorded(const unsigned long long* ctr) const {
    const volatile unsigned long long* rec = ctr + kLlLayoutCounter;
    bool same = true;
    for (int i = 0; i < 5; ++i) same &= rec[i] == v[i];
    return same;
  }
  __device__ void Record(unsigned long long* ctr) const {
    for (int i = 0; i < 5; ++i) ctr[kLlLayoutCounter + i] = v[i];
  }
};

// Start of a sending kernel: reports a call of this op whose receive has not
// run (sends must alternate with receives), and on a layout change does the
// reset: CTA 0 clears, the others wait for its flag (Finish clears it).
__device__ void BeginSend(const EpPeers& p, Op op, const LlLayout& L, unsigned long long* ctr,
                          int seq_slot, int recv_slot) {
  const volatile unsigned long long* c = ctr;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const bool pending_here = c[recv_slot] != c[seq_slot];
    if (pending_here) report_error(p, op, Cause::kOutOfOrder);
  }
  if (LlKey(L).Recorded(ctr)) return;
  volatile unsigned long long* done = ctr + kLlResetCounter;
  if (blockIdx.x == 0) {
    __shared__ int s_ok;
    if (threadIdx.x == 0) {
      const bool pending = c[kLlDispatchRecvCounter] != c[kLlDispatchSeqCounter] ||
                           c[kLlCombineRecvCounter] != c[kLlCombineSeqCounter];
      if (pending) report_error(p, op, Cause::kOutOfOrder);
      s_ok = rank_barrier(p, op);
    }
    __syncthreads();
    char* mine = MyWindow(p);
    const size_t counts = static_cast<size_t>(L.E_l) * L.R;
    for (int b = 0; b < 2; ++b) {
      uint64_t* cw = reinterpret_cast<uint64_t*>(mine + L.DispCounts(b));
      for (size_t i = threadIdx.x; i < counts; i += blockDim.x) cw[i] = 0;
      uint64_t* f = reinterpret_cast<uint64_t*>(mine + L.CombFlags(b));
      for (int i = threadIdx.x; i < L.R; i += blockDim.x) f[i] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      if (s_ok) rank_barrier(p, op);
      *done = 1;
      __threadfence();
    }
    __syncthreads();
  } else {
    if (threadIdx.x == 0) {
      const unsigned long long t0 = globaltimer_ns();
      while (*done == 0) {
        if (globaltimer_ns() - t0 > 4 * p.timeout_ns) break;  // CTA 0 reports its own timeouts
      }
    }
    __syncthreads();
  }
}

// The last CTA to finish resets the scratch counters and advances the
// sequence number for the next call.
__device__ void Finish(unsigned long long* ctr, int seq_slot, int sent_slot, int done_slot,
                       unsigned long long seq, const LlLayout& L) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(ctr + done_slot, 1ull) == gridDim.x - 1) {
      ctr[sent_slot] = 0;
      ctr[done_slot] = 0;
      ctr[kLlResetCounter] = 0;
      ctr[seq_slot] = seq;
      if (ctr[kLlMismatchCounter] != 0) {
        ctr[kLlMismatchCounter] = 0;
        ctr[kLlLayoutCounter] = 0;  // M = 0 never matches: the next call resets
      } else {
        LlKey(L).Record(ctr);
      }
      __threadfence();
    }
  }
}

// The end of a receive: the next send of this op may reuse the buffers.
__device__ void Received(unsigned long long* ctr, int recv_slot, unsigned long long seq) {
  if (blockIdx.x == 0 && threadIdx.x == 0) ctr[recv_slot] = seq;
}

// This call's sequence number: the counter + 1 in a sending kernel (its
// last CTA stores it back; a send-only kernel also writes it into its
// token), the send's token in a receive-only kernel.
template <LlPart kPart>
__device__ __forceinline__ unsigned long long ReadSeq(const unsigned long long* ctr,
                                                      const int32_t* token_in) {
  if constexpr (kPart == LlPart::kRecv) {
    return static_cast<uint32_t>(*reinterpret_cast<const volatile int32_t*>(token_in));
  }
  return *reinterpret_cast<const volatile unsigned long long*>(ctr) + 1;
}

template <LlPart kPart>
__device__ __forceinline__ void WriteToken(int32_t* token_out, unsigned long long seq) {
  if constexpr (kPart == LlPart::kSend) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *token_out = static_cast<int32_t>(seq);
  }
}

// Decode has few rows (~128 tokens) for ~2000 warps: a row is cut into
// `per_row` column slices of `width` 16-byte vectors, one warp each, so
// every SM moves data instead of the first few (one warp per row left 8
// of 132 CTAs doing all the work: docs/low_latency.md, "Speed"). `width` is
// a multiple of 32 vectors, so a 128-channel FP8 block (16 vectors) never
// straddles two slices and a warp's lanes stay aligned with the blocks.
struct RowSlices {
  int per_row, width;
  __device__ RowSlices(int rows, int warps, int nvec) {
    if (nvec <= 0) {  // no columns (the validators allow H = 0): one empty slice
      per_row = 1;
      width = 32;
      return;
    }
    const int most = max(1, (nvec + 31) / 32);
    const int want = max(1, min(most, warps / max(rows, 1)));
    width = ((nvec + want - 1) / want + 31) / 32 * 32;
    per_row = max(1, (nvec + width - 1) / width);
  }
};

// ---------------------------------------------------------------- dispatch

template <LlPart kPart>
__global__ void __launch_bounds__(kLlThreads, 1)
    LlDispatchKernel(const __grid_constant__ LlDispatchArgs a, const __grid_constant__ EpPeers p,
                     const __grid_constant__ LlLayout L) {
  extern __shared__ int32_t smem[];        // LlSendSmemBytes
  int32_t* s_count = smem;                  // [E] rows of this rank per expert
  int32_t* s_slot = smem + a.num_experts;   // [T * K] each entry's row in its slot area
  int32_t* s_wcount = s_slot + a.num_tokens * a.topk;  // [kLlWarps][E] (step 1)
  const int T = a.num_tokens, K = a.topk, E = a.num_experts, R = p.nranks, M = a.max_tokens;
  const int E_l = E / R, TK = T * K;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = blockIdx.x * kLlWarps + warp;
  const int nw = gridDim.x * kLlWarps;
  const int H = a.hidden;
  const int nvec = H / 8;  // 16-byte vectors of bf16
  unsigned long long* ctr = a.counters;
  const unsigned long long seq = ReadSeq<kPart>(ctr + kLlDispatchSeqCounter, a.token_in);
  const int b = static_cast<int>(seq & 1ull);
  const OpConfig mine = LlConfig(Op::kLowLatencyDispatch, T, L, a.fp8, seq);
  if constexpr (kPart != LlPart::kRecv) {
    // Before the reset's barrier too: a peer that kept its layout waits for
    // words this rank writes elsewhere, and finds the difference here.
    if (blockIdx.x == 0 && threadIdx.x == 0) PublishConfig(p, mine, mine.tag);
    BeginSend(p, Op::kLowLatencyDispatch, L, ctr, kLlDispatchSeqCounter, kLlDispatchRecvCounter);
    WriteToken<kPart>(a.token_out, seq);
    for (int i = threadIdx.x; i < kLlWarps * E; i += blockDim.x) s_wcount[i] = 0;
    // The ids into shared memory by every thread at once, so the walks
    // below never wait on global memory.
    for (int q = threadIdx.x; q < TK; q += blockDim.x) s_slot[q] = __ldg(a.topk_idx + q);
    __syncthreads();

    // 1. Each entry's slot: its rank among this rank's entries for the same
    // expert in (t, k) order, in every CTA (cheaper than a grid-wide
    // exchange). Each warp walks its own contiguous run of entries 32 at a
    // time, counting per expert; a scan over the warps then gives each
    // run's start per expert. (One warp walking all T * K entries held every
    // warp ~5 µs at T * K = 1024, docs/low_latency.md.)
    {
      const int run = max(32, (TK + kLlWarps * 32 - 1) / (kLlWarps * 32) * 32);
      int32_t* wc = s_wcount + warp * E;
      bool bad = false;
      for (int base = warp * run; base < min(TK, (warp + 1) * run); base += 32) {
        const int q = base + lane;
        int32_t id = q < TK ? s_slot[q] : -1;
        if (id < -1 || id >= E) {
          bad = true;
          id = -1;
        }
        const unsigned same = __match_any_sync(kFullMask, id);
        const int before = __popc(same & ((1u << lane) - 1u));
        const int slot = id >= 0 ? wc[id] + before : -1;
        __syncwarp();
        if (id >= 0 && before == 0) wc[id] += __popc(same);
        __syncwarp();
        if (q < TK) s_slot[q] = slot;
      }
      if (__any_sync(kFullMask, bad) && lane == 0 && blockIdx.x == 0) {
        report_error(p, Op::kLowLatencyDispatch, Cause::kBadExpertId);
      }
      __syncthreads();
      for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int acc = 0;
        for (int w2 = 0; w2 < kLlWarps; ++w2) {
          const int n = s_wcount[w2 * E + e];
          s_wcount[w2 * E + e] = acc;
          acc += n;
        }
        s_count[e] = acc;
      }
      __syncthreads();
      for (int q = threadIdx.x; q < TK; q += blockDim.x) {
        const int slot = s_slot[q];
        if (slot >= 0) s_slot[q] = slot + s_wcount[(q / run) * E + __ldg(a.topk_idx + q)];
      }
    }
    __syncthreads();

    // 2. Rows to their owners: each column slice of a token's row read once
    // and stored into every destination slot (FP8: cast on the way).
    const RowSlices rs(T, nw, nvec);
    for (int task = gw; task < T * rs.per_row; task += nw) {
      const int t = task / rs.per_row, part = task - t * rs.per_row;
      const int v0 = part * rs.width, v1 = min(nvec, v0 + rs.width);
      char* lane_row = nullptr;
      bool ok = false, overflow = false;
      if (lane < K) {
        const int q = t * K + lane;
        const int32_t id = __ldg(a.topk_idx + q);
        const int slot = s_slot[q];
        if (id >= 0 && id < E && slot >= 0) {
          if (slot < M) {
            const int d = id / E_l, l = id - d * E_l;
            lane_row = LlDispRowFor(p, L, b, d, l, slot);
            if (part == 0) *LlDispMetaFor(p, L, b, d, l, slot) = q;
            ok = true;
          } else {
            overflow = part == 0;
          }
        }
      }
      if (__any_sync(kFullMask, overflow) && lane == 0) {
        report_error(p, Op::kLowLatencyDispatch, Cause::kCapacityOverflow);
      }
      const unsigned dst_mask = __ballot_sync(kFullMask, ok);
      const uint4* xv = reinterpret_cast<const uint4*>(static_cast<const char*>(a.x) +
                                                       static_cast<size_t>(t) * H * 2);
      for (int base = v0; base < v1; base += 32 * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int idx = base + u * 32 + lane;
          v[u] = idx < v1 ? LdNcNa(xv + idx) : make_uint4(0, 0, 0, 0);
        }
        if (!a.fp8) {
          for (unsigned m = dst_mask; m; m &= m - 1)
            StoreChunk(reinterpret_cast<uint4*>(ShflPtr(lane_row, __ffs(m) - 1)), base, v1, lane, v);
        } else {
          // 8 channels per lane, 16 lanes per 128-channel block (H % 128 == 0).
          uint2 qv[kUnroll];
          float s[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) qv[u] = CastVec16Fp8<__nv_bfloat16>(v[u], a.ue8m0, s[u]);
          for (unsigned m = dst_mask; m; m &= m - 1) {
            char* row = ShflPtr(lane_row, __ffs(m) - 1);
            float* srow = reinterpret_cast<float*>(row + H);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int idx = base + u * 32 + lane;
              if (idx < v1) {
                reinterpret_cast<uint2*>(row)[idx] = qv[u];
                if (lane % 16 == 0) srow[idx / 16] = s[u];
              }
            }
          }
        }
      }
    }

    // 3. Counts, after every CTA's rows: (seq << 32 | rows) per (expert, this
    // rank) into the expert owner's window.
    AllSent(p, Op::kLowLatencyDispatch, ctr + kLlDispatchSentCounter);
    if (blockIdx.x == 0) LlPostDispatchCounts(p, L, b, seq, mine, s_count);
  }
  if constexpr (kPart == LlPart::kSend) {
    Finish(ctr, kLlDispatchSeqCounter, kLlDispatchSentCounter, kLlDispatchDoneCounter, seq, L);
    return;
  }

  // 4. Receive: one CTA per local expert at a time. Wait for every source's
  // count, then pack its rows from row 0 in (source rank, token, k) order.
  // A source with another configuration (bit s): this receive reads no
  // rows at all, as a normal op does (config_check.cuh).
  __shared__ int32_t s_off[kMaxRanks + 1];
  __shared__ uint32_t s_mismatch;
  if (threadIdx.x == 0) s_mismatch = 0;
  __syncthreads();
  const int m_all = R * M;
  for (int l = blockIdx.x; l < E_l; l += gridDim.x) {
    if (threadIdx.x < R) {
      const uint64_t* word = reinterpret_cast<const uint64_t*>(MyWindow(p) + L.DispCounts(b)) +
                             static_cast<size_t>(l) * R + threadIdx.x;
      int64_t n = WaitTagged(p, Op::kLowLatencyDispatch, word, seq, threadIdx.x, mine);
      if (n == kWaitMismatch) atomicOr(&s_mismatch, 1u << threadIdx.x);
      if (n > M) {  // never written so: a corrupted word; read no more than the area holds
        report_error(p, Op::kLowLatencyDispatch, Cause::kBadIndex);
        n = M;
      }
      s_off[threadIdx.x + 1] = n < 0 ? 0 : static_cast<int32_t>(n);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (s_mismatch != 0)
        for (int s = 0; s < R; ++s) s_off[s + 1] = 0;
      s_off[0] = 0;
      for (int s = 0; s < R; ++s) s_off[s + 1] += s_off[s];
      a.recv_count[l] = s_off[R];
    }
    __syncthreads();
    const int total = s_off[R];
    // The handle, every row of it (small): the source entry, -1 past the count.
    for (int i = threadIdx.x; i < m_all; i += blockDim.x) {
      int32_t entry = -1;
      if (i < total) {
        int s = 0;
        while (i >= s_off[s + 1]) ++s;
        const size_t cell = (static_cast<size_t>(l) * R + s) * M + (i - s_off[s]);
        const int32_t q = LdCgI32(reinterpret_cast<const int32_t*>(MyWindow(p) + L.DispMeta(b)) + cell);
        entry = s * TK + q;
      }
      a.src_entry[static_cast<size_t>(l) * m_all + i] = entry;
    }
    // The rows: column slices of them over the CTA's warps (an expert
    // receives a few rows in decode), kUnroll loads in flight per lane.
    const int rvec = a.fp8 ? H / 16 : nvec;  // 16-byte vectors per received row
    const RowSlices rr(total, kLlWarps, rvec);
    for (int task = warp; task < total * rr.per_row; task += kLlWarps) {
      const int i = task / rr.per_row, part = task - i * rr.per_row;
      const int v0 = part * rr.width, v1 = min(rvec, v0 + rr.width);
      int s = 0;
      while (i >= s_off[s + 1]) ++s;
      const size_t cell = (static_cast<size_t>(l) * R + s) * M + (i - s_off[s]);
      const char* src = MyWindow(p) + L.DispRows(b) + cell * L.row_bytes;
      const size_t out_row = static_cast<size_t>(l) * m_all + i;
      const uint4* sv = reinterpret_cast<const uint4*>(src);
      uint4* dv = reinterpret_cast<uint4*>(static_cast<char*>(a.recv_x) + out_row * rvec * 16);
      for (int base = v0; base < v1; base += 32 * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int idx = base + u * 32 + lane;
          if (idx < v1) v[u] = LdCg(sv + idx);
        }
        StoreChunk(dv, base, v1, lane, v);
      }
      if (a.fp8 && part == 0) {
        const float* ss = reinterpret_cast<const float*>(src + H);
        float* ds = a.recv_scales + out_row * (H / 128);
        for (int j = lane; j < H / 128; j += 32) ds[j] = __ldcg(ss + j);
      }
    }
    __syncthreads();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && s_mismatch != 0) {
    ReportLlMismatch<kPart>(p, Op::kLowLatencyDispatch, s_mismatch, mine, ctr);
  }
  Received(ctr, kLlDispatchRecvCounter, seq);
  if constexpr (kPart == LlPart::kFused) {
    Finish(ctr, kLlDispatchSeqCounter, kLlDispatchSentCounter, kLlDispatchDoneCounter, seq, L);
  }
}

// ---------------------------------------------------------------- combine

template <LlPart kPart>
__global__ void __launch_bounds__(kLlThreads, 1)
    LlCombineKernel(const __grid_constant__ LlCombineArgs a, const __grid_constant__ EpPeers p,
                    const __grid_constant__ LlLayout L) {
  const int T = a.num_tokens, K = a.topk, E = a.num_experts, R = p.nranks, M = a.max_tokens;
  const int E_l = E / R, TK = T * K, m_all = R * M, H = a.hidden, nvec = H / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = blockIdx.x * kLlWarps + warp;
  const int nw = gridDim.x * kLlWarps;
  unsigned long long* ctr = a.counters;
  const unsigned long long seq = ReadSeq<kPart>(ctr + kLlCombineSeqCounter, a.token_in);
  const int b = static_cast<int>(seq & 1ull);
  const OpConfig mine = LlConfig(Op::kLowLatencyCombine, T, L, false, seq);
  if constexpr (kPart != LlPart::kRecv) {
    if (blockIdx.x == 0 && threadIdx.x == 0) PublishConfig(p, mine, mine.tag);
    BeginSend(p, Op::kLowLatencyCombine, L, ctr, kLlCombineSeqCounter, kLlCombineRecvCounter);
    WriteToken<kPart>(a.token_out, seq);

    // 1. Every valid expert-side row back to its token's (t, k) slot in the
    // source rank's window. Tasks (l, i) are dealt to warps with l fastest, so
    // the few rows of each expert (decode: ~8) spread over the grid.
    bool bad = false;
    for (int task = gw; task < E_l * m_all; task += nw) {
      const int l = task % E_l, i = task / E_l;
      if (i >= __ldg(a.recv_count + l)) continue;
      const int32_t entry = __ldg(a.src_entry + static_cast<size_t>(l) * m_all + i);
      if (entry < 0 || entry >= R * TK) {
        bad = true;
        continue;
      }
      const int s = entry / TK, q = entry - s * TK;
      char* const slot = LlCombRowFor(p, L, b, s, q);
      if (kPart == LlPart::kFused && s == p.rank) {
        // This rank's own token: its reduce below reads the row straight
        // from y (this kernel's input), so only the row's place goes into
        // the slot, tagged with the call (read in step 3).
        if (lane == 0) *reinterpret_cast<uint64_t*>(slot) = MakeTagged(seq, static_cast<uint32_t>(l * m_all + i));
        continue;
      }
      uint4* dst = reinterpret_cast<uint4*>(slot);
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(a.y) +
                                                        (static_cast<size_t>(l) * m_all + i) * H * 2);
      for (int base = 0; base < nvec; base += 32 * kUnroll) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int idx = base + u * 32 + lane;
          v[u] = idx < nvec ? LdNcNa(src + idx) : make_uint4(0, 0, 0, 0);
        }
        StoreChunk(dst, base, nvec, lane, v);
      }
      LlCombRowWritten(p, L, b, s, q);
    }
    if (__any_sync(kFullMask, bad) && lane == 0) report_error(p, Op::kLowLatencyCombine, Cause::kBadIndex);

    // 2. One flag per source rank, after every CTA's rows.
    AllSent(p, Op::kLowLatencyCombine, ctr + kLlCombineSentCounter);
    if (blockIdx.x == 0 && threadIdx.x < R) {
      LlPostCombineFlag(p, L, b, threadIdx.x, MakeTagged(seq, LlWordValue(mine, 1u)));
    }
    FlushPeersWarp(p, 1u << kGinLlCombineChannel);  // the row staging is rewritten by the next call
  }
  if constexpr (kPart == LlPart::kSend) {
    Finish(ctr, kLlCombineSeqCounter, kLlCombineSentCounter, kLlCombineDoneCounter, seq, L);
    return;
  }

  // 3. Reduce: wait for every expert owner, then each token's rows in
  // ascending (expert, k) order, f32 products and sums rounded as written.
  // An owner that timed out or has another configuration (reported) leaves
  // the slots unknown: every token is zeros then.
  __shared__ uint32_t s_mismatch;
  __shared__ int s_failed;
  if (threadIdx.x == 0) s_mismatch = 0, s_failed = 0;
  __syncthreads();
  if (threadIdx.x < R) {
    const uint64_t* word = reinterpret_cast<const uint64_t*>(MyWindow(p) + L.CombFlags(b)) + threadIdx.x;
    const int64_t n = WaitTagged(p, Op::kLowLatencyCombine, word, seq, threadIdx.x, mine);
    if (n == kWaitMismatch) atomicOr(&s_mismatch, 1u << threadIdx.x);
    if (n < 0) s_failed = 1;
  }
  __syncthreads();
  const bool failed = s_failed != 0;
  if (blockIdx.x == 0 && threadIdx.x == 0 && s_mismatch != 0) {
    ReportLlMismatch<kPart>(p, Op::kLowLatencyCombine, s_mismatch, mine, ctr);
  }
  // Per warp: the token's valid rows in ascending (expert, k) order, with
  // their weights (shared memory, so the channel loop below needs no
  // shuffles and may run a different trip count per lane). A row is its
  // window slot, or (fused kernel, an expert of this rank) its row of y.
  __shared__ const char* s_row[kLlWarps][32];
  __shared__ float s_w[kLlWarps][32];
  const char* slots = MyWindow(p) + L.CombRows(b);
  bool bad_local = false;
  const RowSlices rs(T, nw, nvec);
  for (int task = gw; task < T * rs.per_row; task += nw) {
    const int t = task / rs.per_row, part = task - t * rs.per_row;
    const int v0 = part * rs.width, v1 = min(nvec, v0 + rs.width);
    const int32_t id = lane < K ? __ldg(a.topk_idx + t * K + lane) : -1;
    const bool valid = !failed && lane < K && id >= 0 && id < E;
    const int key = valid ? id : E + 1 + lane;  // invalid: after every valid one, in k order
    // Only lanes < K can sort before a valid one (the others' keys are
    // larger), and an invalid lane's position is not used.
    int pos = 0;
    for (int j = 0; j < K; ++j) {
      const int kj = __shfl_sync(kFullMask, key, j);
      pos += (kj < key) || (kj == key && j < lane);
    }
    const int n_valid = __popc(__ballot_sync(kFullMask, valid));
    if (valid) {
      const char* row = slots + static_cast<size_t>(t * K + lane) * L.y_row_bytes;
      if (kPart == LlPart::kFused && id / E_l == p.rank) {
        // The send above left (seq, the row of y) here; another tag means
        // the handle had no row for this entry: it counts as zeros.
        const uint64_t w = LdU64Volatile(reinterpret_cast<const uint64_t*>(row));
        const uint32_t yrow = static_cast<uint32_t>(w);
        const bool ok = TagMatches(w, seq) && yrow < static_cast<uint32_t>(E_l * m_all);
        bad_local |= !ok;
        row = ok ? static_cast<const char*>(a.y) + static_cast<size_t>(yrow) * H * 2 : nullptr;
      }
      s_row[warp][pos] = row;
      s_w[warp][pos] = __ldg(a.topk_weights + t * K + lane);
    }
    __syncwarp();
    uint4* out = reinterpret_cast<uint4*>(static_cast<char*>(a.out) + static_cast<size_t>(t) * H * 2);
    for (int v = v0 + lane; v < v1; v += 32) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = n_valid > 0 ? -0.0f : 0.0f;
      // kBatch rows' loads in flight before their sums, added in the same
      // ascending order as one at a time.
      constexpr int kBatch = 8;
      for (int r0 = 0; r0 < n_valid; r0 += kBatch) {
        uint4 y[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (r0 + j < n_valid) {
            const char* row = s_row[warp][r0 + j];
            y[j] = row != nullptr ? LdCg(reinterpret_cast<const uint4*>(row) + v) : make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (r0 + j < n_valid) {
            const float wk = s_w[warp][r0 + j];
            float f[8];
            Vec16<__nv_bfloat16>::ToFloat(y[j], f);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, f[i]));
          }
        }
      }
      StNa(out + v, Vec16<__nv_bfloat16>::FromFloat(acc));
    }
    __syncwarp();
  }
  if (__any_sync(kFullMask, bad_local) && lane == 0) report_error(p, Op::kLowLatencyCombine, Cause::kBadIndex);
  Received(ctr, kLlCombineRecvCounter, seq);
  if constexpr (kPart == LlPart::kFused) {
    Finish(ctr, kLlCombineSeqCounter, kLlCombineSentCounter, kLlCombineDoneCounter, seq, L);
  }
}

// abort.h's stand-in for a refused sending call. One thread.
__global__ void LlRefusalKernel(const __grid_constant__ EpPeers p, bool combine, unsigned long long* ctr) {
  if (threadIdx.x != 0) return;
  const int seq_slot = combine ? kLlCombineSeqCounter : kLlDispatchSeqCounter;
  const int recv_slot = combine ? kLlCombineRecvCounter : kLlDispatchRecvCounter;
  const unsigned long long seq = ctr[seq_slot] + 1;
  ctr[seq_slot] = seq;
  ctr[recv_slot] = seq;
  const Op op = combine ? Op::kLowLatencyCombine : Op::kLowLatencyDispatch;
  PublishConfig(p, RefusedConfig(op), static_cast<uint32_t>(seq));
  LlTellGinPeersRefused(p, op, seq);
}

// A sending dispatch kernel's dynamic shared memory: per-expert counts,
// each entry's slot, and each warp's per-expert counts.
size_t LlSendSmemBytes(const LlDispatchArgs& a) {
  return sizeof(int32_t) * ((1 + static_cast<size_t>(kLlWarps)) * a.num_experts +
                            static_cast<size_t>(a.num_tokens) * a.topk);
}

// CTAs that keep a warp on every RowSlices slice of `rows` rows of H bf16.
int RowWarps(int rows, int H) {
  const long long warps = static_cast<long long>(rows) * std::max(1, (H / 8 + 31) / 32);
  return static_cast<int>(std::min<long long>((warps + kLlWarps - 1) / kLlWarps, 1 << 20));
}

int Blocks(int requested, int device_sms, int work) {
  int n = requested > 0 ? requested : device_sms;
  n = std::min(n, device_sms);  // every CTA resident: waiting CTAs must not block senders
  return std::max(1, std::min(n, std::max(work, 1)));
}

}  // namespace

size_t LlWindowBytes(int R, int M, int H, int K, int E, size_t reserved_bytes, bool gin) {
  const size_t low = std::max(reserved_bytes, kWindowHeaderBytes);
  return LlLayout(R, M, H, K, E / std::max(R, 1), low, gin).End();
}

std::string ValidateLlDispatch(const LlDispatchArgs& a, const EpPeers& p) {
  if (a.topk < 1 || a.topk > 32) return "topk must be in [1, 32]";
  if (a.num_experts < p.nranks || a.num_experts % p.nranks) return "num_experts must be a multiple of the ranks";
  if (a.max_tokens < 1 || a.max_tokens > kLlMaxTokens || a.num_tokens < 0 || a.num_tokens > a.max_tokens)
    return "need 0 <= tokens <= max_tokens <= " + std::to_string(kLlMaxTokens);
  if (a.hidden < 8 || (a.fp8 ? a.hidden % 128 : a.hidden % 8))
    return a.fp8 ? "hidden must be a positive multiple of 128 for FP8"
                 : "hidden must be a positive multiple of 8";
  if (LlSendSmemBytes(a) > 200 * 1024)
    return "17 * num_experts + tokens * topk too large for one CTA's shared memory";
  const size_t need = LlWindowBytes(p.nranks, a.max_tokens, a.hidden, a.topk, a.num_experts,
                                    a.reserved_bytes, AnyGinPeer(p));
  if (need > p.window_bytes)
    return "the symmetric window is too small for the low-latency ops: it needs " +
           std::to_string(need) + " bytes, has " + std::to_string(p.window_bytes) +
           " (Communicator.create(num_bytes=get_buffer_size_hint(..., low_latency=True" +
           std::string(AnyGinPeer(p) ? ", gin=True" : "") + ")))";
  return "";
}

std::string ValidateLlCombine(const LlCombineArgs& a, const EpPeers& p) {
  if (a.topk < 1 || a.topk > 32) return "topk must be in [1, 32]";
  if (a.num_experts < p.nranks || a.num_experts % p.nranks) return "num_experts must be a multiple of the ranks";
  if (a.max_tokens < 1 || a.max_tokens > kLlMaxTokens || a.num_tokens < 0 || a.num_tokens > a.max_tokens)
    return "need 0 <= tokens <= max_tokens <= " + std::to_string(kLlMaxTokens);
  if (a.hidden < 8 || a.hidden % 8) return "hidden must be a positive multiple of 8";
  const size_t need = LlWindowBytes(p.nranks, a.max_tokens, a.hidden, a.topk, a.num_experts,
                                    a.reserved_bytes, AnyGinPeer(p));
  if (need > p.window_bytes)
    return "the symmetric window is too small for the low-latency ops: it needs " +
           std::to_string(need) + " bytes, has " + std::to_string(p.window_bytes);
  return "";
}

// Every kernel the two launchers below can pick.
cudaError_t LoadLowLatencyKernels() {
  return LoadEach(LlRefusalKernel, LlDispatchKernel<LlPart::kFused>, LlDispatchKernel<LlPart::kSend>, LlDispatchKernel<LlPart::kRecv>,
                  LlCombineKernel<LlPart::kFused>, LlCombineKernel<LlPart::kSend>, LlCombineKernel<LlPart::kRecv>);
}

cudaError_t LaunchLlRefusal(const EpPeers& p, bool combine, unsigned long long* counters,
                            cudaStream_t stream) {
  if (p.nranks <= 1 || counters == nullptr) return cudaSuccess;
  LlRefusalKernel<<<1, 32, 0, stream>>>(p, combine, counters);
  return cudaGetLastError();
}

cudaError_t LaunchLlDispatch(const LlDispatchArgs& a, const EpPeers& p, int device_sms,
                             cudaStream_t stream, LlPart part) {
  const int R = p.nranks;
  const LlLayout L(R, a.max_tokens, a.hidden, a.topk, a.num_experts / R,
                   std::max(a.reserved_bytes, kWindowHeaderBytes), AnyGinPeer(p));
  const size_t smem = part == LlPart::kRecv ? 0 : LlSendSmemBytes(a);
  auto kernel = part == LlPart::kFused  ? LlDispatchKernel<LlPart::kFused>
                : part == LlPart::kSend ? LlDispatchKernel<LlPart::kSend>
                                        : LlDispatchKernel<LlPart::kRecv>;
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const int work = std::max(RowWarps(a.num_tokens, a.hidden), a.num_experts / R);
  kernel<<<Blocks(a.num_blocks, device_sms, work), kLlThreads, smem, stream>>>(a, p, L);
  return cudaGetLastError();
}

cudaError_t LaunchLlCombine(const LlCombineArgs& a, const EpPeers& p, int device_sms,
                            cudaStream_t stream, LlPart part) {
  const int R = p.nranks;
  const LlLayout L(R, a.max_tokens, a.hidden, a.topk, a.num_experts / R,
                   std::max(a.reserved_bytes, kWindowHeaderBytes), AnyGinPeer(p));
  const int work = std::max(a.num_experts / R, RowWarps(a.num_tokens, a.hidden));
  auto kernel = part == LlPart::kFused  ? LlCombineKernel<LlPart::kFused>
                : part == LlPart::kSend ? LlCombineKernel<LlPart::kSend>
                                        : LlCombineKernel<LlPart::kRecv>;
  kernel<<<Blocks(a.num_blocks, device_sms, work), kLlThreads, 0, stream>>>(a, p, L);
  return cudaGetLastError();
}

}  // namespace jax_ep
