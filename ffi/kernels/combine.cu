// Normal (high-throughput) combine over LSA: the expert side pushes every row
// (and its weight) back into the source rank's window, at a slot the source
// can find without any index exchange: rank layout [my rank][pos_in_rank],
// expert layout [token][k]. After a barrier, each source sums its slots in the
// fixed order of DESIGN §2 (ascending destination rank, then local expert,
// then k) in f32 with __fmul_rn / __fadd_rn (never contracted to FMA), which
// is exactly jax_ep.reference.combine.
//
// Why not pre-reduce on the expert side: the sequential f32 sum of a token
// crosses ranks (rank 1's rows are added onto rank 0's partial sum), so a
// partial sum per rank would round differently from the reference.
#include <algorithm>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ep_copy.cuh"
#include "vec16.cuh"
#include "ep_kernels.h"
#include "window_layout.h"

namespace jax_ep {
namespace {

constexpr int kPushThreads = 1024;
constexpr int kReduceThreads = 512;  // 32 f32 accumulators per lane need > 64 registers

struct CombineCfg {
  int T, H, K, E, C;
  int expert;
  int has_w;
};

struct CombineIO {
  const void* y;
  const float* weights;
  const int32_t* topk;
  const int32_t* pos_in_rank;
  const int32_t* src_rank;
  const int32_t* src_token;
  const int32_t* src_k;
  const int32_t* recv_counts;
  void* out;
};

__global__ void CombineStartBarrierKernel(EpPeers p) {
  if (threadIdx.x == 0) rank_barrier(p, Op::kCombine);
}

// One warp per received row: y[c] (+ weight) into the source's window slot.
__global__ void __launch_bounds__(kPushThreads, 1) CombinePushKernel(CombineCfg c, CombineWindow w,
                                                                      EpPeers p, CombineIO io) {
  __shared__ int s_prefix[kMaxRanks + 1];
  __shared__ int s_skip;
  const int R = p.nranks, r = p.rank;
  if (threadIdx.x == 0) {
    s_skip = has_error(p);
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      s_prefix[s] = acc;
      acc += io.recv_counts[s];
    }
    s_prefix[R] = acc;
  }
  __syncthreads();
  if (s_skip) return;  // failed rank: store nothing into peers' windows
  const int lane = LaneId();
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int nwarps = static_cast<int>((gridDim.x * blockDim.x) >> 5);
  char* const lane_base = p.base[lane < R ? lane : 0];
  const int nvec = static_cast<int>(w.payload_bytes / 16);
  for (int row = warp; row < c.C; row += nwarps) {
    const int s = io.src_rank[row];
    if (s < 0) continue;
    size_t slot = 0;
    bool bad = s >= R;
    if (!c.expert) {
      const int pos = bad ? -1 : row - s_prefix[s];
      bad = bad || pos < 0 || row >= s_prefix[s + 1] || pos >= c.T;
      slot = static_cast<size_t>(r) * c.T + pos;
    } else {
      const int t = io.src_token[row], k = io.src_k[row];
      bad = bad || t < 0 || t >= c.T || k < 0 || k >= c.K;
      slot = static_cast<size_t>(t) * c.K + k;
    }
    if (bad) {  // the handle does not describe a dispatch of this communicator
      if (lane == 0) report_error(p, Op::kCombine, Cause::kBadIndex);
      continue;
    }
    char* dst_row = ShflPtr(lane_base, s) + w.recv_off + slot * w.row_bytes;
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(io.y) + static_cast<size_t>(row) * w.payload_bytes);
    uint4* dst = reinterpret_cast<uint4*>(dst_row);
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * 32 + lane;
        if (idx < nvec) v[u] = LdNcNa(src + idx);
      }
      StoreChunk(dst, base, nvec, lane, v);
    }
    if (lane == 0) *reinterpret_cast<float*>(dst_row + w.weight_off) = c.has_w ? io.weights[row] : 1.f;
  }
  // As in DispatchPushKernel: the ok kernel's release does not cover this
  // grid's weak NVLink stores, so each thread waits until its stores are
  // performed system-wide before it exits.
  __threadfence_system();
}

__global__ void CombineOkBarrierKernel(CombineWindow w, EpPeers p) {
  if (threadIdx.x == 0) PublishOkAndBarrier(p, w.ok_off, !has_error(p), Op::kCombine);
}

// One warp per source token: list its slots in the reference order (lane i
// holds the i-th slot), then sum them chunk by chunk.
template <typename TY, bool kHasW>
__global__ void __launch_bounds__(kReduceThreads, 1) CombineReduceKernel(CombineCfg c, CombineWindow w,
                                                                          EpPeers p, CombineIO io) {
  __shared__ int s_ok;
  const int R = p.nranks;
  char* const my = p.base[p.rank];
  if (threadIdx.x == 0) {
    int ok = !has_error(p);
    const int bad = FirstPeerNotOk(p, w.ok_off);
    if (ok && bad >= 0) {
      ok = 0;
      report_error(p, Op::kCombine, Cause::kPeerTimeout, 0x80u | static_cast<uint32_t>(bad));
    }
    s_ok = ok;
  }
  __syncthreads();
  constexpr int V = Vec16<TY>::N;
  const int lane = LaneId();
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int nwarps = static_cast<int>((gridDim.x * blockDim.x) >> 5);
  const int nvec = static_cast<int>(w.payload_bytes / 16);
  const bool ok = s_ok != 0;
  for (int t = warp; t < c.T; t += nwarps) {
    int n = 0;
    size_t my_slot = 0;  // lane i: the i-th slot of token t
    if (ok) {
      if (!c.expert) {
        const int pos = lane < R ? io.pos_in_rank[static_cast<size_t>(t) * R + lane] : -1;
        const unsigned mask = __ballot_sync(kFullMask, pos >= 0);
        n = __popc(mask);
        if (pos >= 0) my_slot = static_cast<size_t>(lane) * c.T + pos;
        // Gather: list lane i takes the slot of the i-th set bit.
        size_t gathered = 0;
        for (int i = 0; i < n; ++i) {
          const size_t v = __shfl_sync(kFullMask, my_slot, NthSetBit(mask, i));
          if (lane == i) gathered = v;
        }
        my_slot = gathered;
      } else {
        const int id = lane < c.K ? io.topk[static_cast<size_t>(t) * c.K + lane] : -1;
        const bool valid = id >= 0 && id < c.E;
        const unsigned vmask = __ballot_sync(kFullMask, valid);
        n = __popc(vmask);
        // Order by (expert id, k): expert id ascending = rank then local expert.
        const long long key = valid ? static_cast<long long>(id) * kMaxTopk + lane : -1;
        int rank_in_order = 0;
        for (int l = 0; l < c.K; ++l) {
          const long long kl = __shfl_sync(kFullMask, key, l);
          rank_in_order += (kl >= 0 && kl < key) ? 1 : 0;
        }
        size_t gathered = 0;
        for (int i = 0; i < n; ++i) {
          const unsigned who = __ballot_sync(kFullMask, valid && rank_in_order == i);
          if (lane == i) gathered = static_cast<size_t>(t) * c.K + (__ffs(who) - 1);
        }
        my_slot = gathered;
      }
    }
    uint4* out = reinterpret_cast<uint4*>(static_cast<char*>(io.out) + static_cast<size_t>(t) * w.payload_bytes);
    // -0.0 is the exact additive identity (the reference starts there, since
    // XLA folds 0 + p into p); a token with no rows gets +0.0.
    const float init = n > 0 ? -0.f : 0.f;
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      float acc[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] = init;
      for (int i = 0; i < n; ++i) {
        const char* row = my + w.recv_off + __shfl_sync(kFullMask, my_slot, i) * w.row_bytes;
        const uint4* src = reinterpret_cast<const uint4*>(row);
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int idx = base + u * 32 + lane;
          v[u] = idx < nvec ? LdV4(src + idx) : make_uint4(0, 0, 0, 0);
        }
        float wt = 1.f;
        if constexpr (kHasW) wt = *reinterpret_cast<const float*>(row + w.weight_off);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float f[V];
          Vec16<TY>::ToFloat(v[u], f);
#pragma unroll
          for (int e = 0; e < V; ++e) {
            if constexpr (kHasW) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(wt, f[e]));
            else acc[u][e] = __fadd_rn(acc[u][e], f[e]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * 32 + lane;
        if (idx < nvec) StNa(out + idx, Vec16<TY>::FromFloat(acc[u]));
      }
    }
  }
}

template <typename TY>
void LaunchReduce(int blocks, cudaStream_t stream, const CombineCfg& c, const CombineWindow& w,
                  const EpPeers& p, const CombineIO& io) {
  if (c.has_w) CombineReduceKernel<TY, true><<<blocks, kReduceThreads, 0, stream>>>(c, w, p, io);
  else CombineReduceKernel<TY, false><<<blocks, kReduceThreads, 0, stream>>>(c, w, p, io);
}

}  // namespace

size_t CombineWindowBytes(int R, int T, int H, int K, EpDtype y, EpLayout layout) {
  return CombineWindow(R, T, H, K, EpDtypeBytes(y), layout == EpLayout::kExpert).end;
}

std::string ValidateCombine(const CombineArgs& a, const EpPeers& p) {
  const int R = p.nranks;
  auto s = [](long long v) { return std::to_string(v); };
  if (R < 1 || R > kMaxRanks) return "number of ranks " + s(R) + " outside [1, " + s(kMaxRanks) + "]";
  if (a.y_dtype == EpDtype::kFp8E4m3) return "y must be bf16, f16 or f32";
  if (a.num_tokens < 0) return "num_tokens must be >= 0";
  if (a.topk < 1 || a.topk > kMaxTopk) return "topk " + s(a.topk) + " outside [1, 32]";
  if (a.num_experts < 1 || a.num_experts % R) return "num_experts " + s(a.num_experts) + " must be a positive multiple of " + s(R);
  if (a.capacity < 1) return "capacity must be >= 1";
  const long long row = static_cast<long long>(a.hidden) * EpDtypeBytes(a.y_dtype);
  if (a.hidden < 1 || row % 16) return "row bytes (hidden * dtype bytes = " + s(row) + ") must be a positive multiple of 16";
  const size_t need = CombineWindowBytes(R, a.num_tokens, a.hidden, a.topk, a.y_dtype, a.layout);
  if (need > p.window_bytes)
    return "the communicator's window (" + s(p.window_bytes) + " bytes) is too small for this combine: needs " +
           s(need) + " bytes (create the Communicator with num_bytes >= this)";
  return "";
}

cudaError_t LaunchCombine(const CombineArgs& a, const EpPeers& p, cudaStream_t stream) {
  const int R = p.nranks;
  CombineCfg c{};
  c.T = a.num_tokens;
  c.H = a.hidden;
  c.K = a.topk;
  c.E = a.num_experts;
  c.C = a.capacity;
  c.expert = a.layout == EpLayout::kExpert;
  c.has_w = a.weights != nullptr;
  const CombineWindow w(R, c.T, c.H, c.K, EpDtypeBytes(a.y_dtype), c.expert);
  CombineIO io{a.y, a.weights, a.topk_idx, a.pos_in_rank, a.recv_src_rank, a.recv_src_token,
               a.recv_src_k, a.recv_counts, a.out};

  CombineStartBarrierKernel<<<1, 32, 0, stream>>>(p);
  const int push_blocks = ChooseNumBlocks(a.num_sms, c.C, kPushThreads / 32, R);
  const int skip = DiagSkipMask();
  if (!(skip & 4)) CombinePushKernel<<<push_blocks, kPushThreads, 0, stream>>>(c, w, p, io);
  CombineOkBarrierKernel<<<1, 32, 0, stream>>>(w, p);
  const int reduce_blocks = LocalPhaseBlocks(ChooseNumBlocks(a.num_sms, c.T, kReduceThreads / 32, R));
  if (skip & 8) return cudaGetLastError();
  switch (a.y_dtype) {
    case EpDtype::kBF16: LaunchReduce<__nv_bfloat16>(reduce_blocks, stream, c, w, p, io); break;
    case EpDtype::kF16: LaunchReduce<__half>(reduce_blocks, stream, c, w, p, io); break;
    default: LaunchReduce<float>(reduce_blocks, stream, c, w, p, io); break;
  }
  return cudaGetLastError();
}

}  // namespace jax_ep
