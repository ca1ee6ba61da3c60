// One CTA walks the tokens in chunks of blockDim.x, carrying per-rank running
// counts, so positions come out in ascending token order with no second
// kernel and no scratch buffer. Layout is a few microseconds at EP token
// counts (T <= 16K), far below the dispatch it prepares; the per-expert
// histogram lives in shared memory so global memory sees E writes, not T*K
// atomics.
#include "layout.cuh"

#include "kernel_load.h"

namespace jax_ep {
namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

__global__ void __launch_bounds__(kLayoutThreads, 1)
    DispatchLayoutKernel(LayoutArgs a, EpPeers peers) {
  extern __shared__ int32_t expert_count[];              // [E]
  __shared__ int32_t warp_base[kLayoutWarps][kLayoutMaxRanks];
  __shared__ int32_t carry[kLayoutMaxRanks];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int R = a.num_ranks;
  const int K = a.topk;
  const int E = a.num_experts;
  const int experts_per_rank = E / R;

  for (int e = tid; e < E; e += blockDim.x) expert_count[e] = 0;
  if (tid < R) carry[tid] = 0;
  __syncthreads();

  bool bad_id = false;
  for (int base = 0; base < a.num_tokens; base += blockDim.x) {
    const int t = base + tid;
    uint32_t mask = 0;
    if (t < a.num_tokens) {
      const int32_t* row = a.topk_idx + static_cast<size_t>(t) * K;
      for (int k = 0; k < K; ++k) {
        const int32_t e = __ldg(row + k);
        if (e == -1) continue;
        if (e < -1 || e >= E) {
          bad_id = true;
          continue;
        }
        atomicAdd(&expert_count[e], 1);
        mask |= 1u << (e / experts_per_rank);
      }
    }

    // Pass 1: how many of this warp's tokens go to each rank.
    for (int j = 0; j < R; ++j) {
      const uint32_t ballot = __ballot_sync(0xffffffffu, (mask >> j) & 1u);
      if (lane == 0) warp_base[warp][j] = __popc(ballot);
    }
    __syncthreads();
    // Exclusive scan over warps, offset by the tokens of earlier chunks.
    if (tid < R) {
      int running = carry[tid];
      for (int w = 0; w < kLayoutWarps; ++w) {
        const int c = warp_base[w][tid];
        warp_base[w][tid] = running;
        running += c;
      }
      carry[tid] = running;
    }
    __syncthreads();
    // Pass 2: the ballots again, now turned into positions.
    const uint32_t below = lanemask_lt();
    for (int j = 0; j < R; ++j) {
      const bool goes = (mask >> j) & 1u;
      const uint32_t ballot = __ballot_sync(0xffffffffu, goes);
      if (t < a.num_tokens) {
        const size_t o = static_cast<size_t>(t) * R + j;
        a.is_token_in_rank[o] = goes;
        a.pos_in_rank[o] = goes ? warp_base[warp][j] + __popc(ballot & below) : -1;
      }
    }
    // warp_base is rewritten by the next chunk.
    __syncthreads();
  }

  if (tid < R) a.num_tokens_per_rank[tid] = carry[tid];
  for (int e = tid; e < E; e += blockDim.x) a.num_tokens_per_expert[e] = expert_count[e];
  if (__syncthreads_or(bad_id) && tid == 0) report_error(peers, Op::kLayout, Cause::kBadExpertId);
}

}  // namespace

cudaError_t LoadLayoutKernels() { return LoadEach(DispatchLayoutKernel); }

size_t DispatchLayoutSmemBytes(int num_experts) {
  return static_cast<size_t>(num_experts) * sizeof(int32_t);
}

cudaError_t LaunchDispatchLayout(const LayoutArgs& args, const EpPeers& peers,
                                 cudaStream_t stream) {
  const size_t smem = DispatchLayoutSmemBytes(args.num_experts);
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(
        DispatchLayoutKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  DispatchLayoutKernel<<<1, kLayoutThreads, smem, stream>>>(args, peers);
  return cudaGetLastError();
}

}  // namespace jax_ep
