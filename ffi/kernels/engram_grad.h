// The Engram table gradient's ordered per-row sum (engram_grad.cu).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace jax_ep {

// g [v_l, D] f32 = 0, then for each run of equal `rows[i]` in [0, v_l)
// (sorted, equal rows adjacent, in the order to add them) the sum of the
// d [n, D] f32 rows order[i], ... of that run, added one after the other
// from +0.0. num_sms > 0: at most that many CTAs (SMs); 0: the kernel's own.
cudaError_t LaunchOrderedRowSum(const int32_t* rows, const int32_t* order, const float* d, int64_t n,
                                int D, int32_t v_l, float* g, int num_sms, cudaStream_t stream);

}  // namespace jax_ep
