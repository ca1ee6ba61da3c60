// The Engram table gradient's local sum (docs/design.md §2, "Engram"): the
// row cotangents every rank sent this owner, visited through `order` (a
// stable sort by row in Python) in (local row, source rank, token, slot)
// order, so d itself is read once and never copied; summed per row
// in that order in float32 from +0.0, as jax_ep.reference.engram_table_grad
// adds them on CPU. XLA's scatter-add on the GPU uses atomics, whose order
// (and so the rounding) changes from run to run; this sum does not.
#include "engram_grad.h"

#include <algorithm>

namespace jax_ep {
namespace {

constexpr int kGradThreads = 256;

// One warp per (run of equal rows, block of 32 columns), a lane per column:
// each element's sum still goes through the run in order, and a hot row's
// long run is shared by D / 32 warps.
__global__ void __launch_bounds__(kGradThreads)
    OrderedRowSumKernel(const int32_t* __restrict__ rows, const int32_t* __restrict__ order,
                        const float* __restrict__ d, int64_t n, int D, int32_t v_l,
                        float* __restrict__ g) {
  const int lane = threadIdx.x % 32;
  const int blocks = (D + 31) / 32;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * (kGradThreads / 32);
  for (int64_t task = static_cast<int64_t>(blockIdx.x) * (kGradThreads / 32) + threadIdx.x / 32;
       task < n * blocks; task += nw) {
    const int64_t i = task / blocks;
    const int c = static_cast<int>(task - i * blocks) * 32 + lane;
    const int32_t r = rows[i];
    if (r < 0 || r >= v_l) continue;      // not this owner's row (sorted past the end)
    if (i > 0 && rows[i - 1] == r) continue;  // not the first entry of its run
    if (c >= D) continue;
    float acc = 0.0f;
    for (int64_t j = i; j < n && rows[j] == r; ++j)
      acc = __fadd_rn(acc, d[static_cast<int64_t>(order[j]) * D + c]);
    g[static_cast<int64_t>(r) * D + c] = acc;
  }
}

}  // namespace

cudaError_t LaunchOrderedRowSum(const int32_t* rows, const int32_t* order, const float* d, int64_t n,
                                int D, int32_t v_l, float* g, int num_sms, cudaStream_t stream) {
  if (cudaError_t err = cudaMemsetAsync(g, 0, sizeof(float) * static_cast<size_t>(v_l) * D, stream);
      err != cudaSuccess) {
    return err;
  }
  if (n == 0 || D == 0) return cudaSuccess;
  // A warp per (entry, column block) at most (most entries start no run).
  const int64_t tasks = n * ((D + 31) / 32);
  const int64_t cap = num_sms > 0 ? num_sms : 4096;  // the warps stride over the tasks
  const int blocks = static_cast<int>(
      std::min<int64_t>((tasks + kGradThreads / 32 - 1) / (kGradThreads / 32), cap));
  OrderedRowSumKernel<<<blocks, kGradThreads, 0, stream>>>(rows, order, d, n, D, v_l, g);
  return cudaGetLastError();
}

}  // namespace jax_ep
