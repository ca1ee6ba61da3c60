// See abort.h.
#include "abort.h"

#include "barrier.cuh"
#include "kernel_load.h"

namespace jax_ep {
namespace {

__global__ void RefusedBarriersKernel(const __grid_constant__ EpPeers p, int barriers) {
  if (threadIdx.x != 0) return;
  const uint64_t first = *p.epoch + 1;
  const uint64_t last = *p.epoch + static_cast<uint64_t>(barriers);
  *p.epoch = last;
  __threadfence_system();
  refuse_barriers(p, first, last);
}

}  // namespace

cudaError_t LoadAbortKernels() { return LoadEach(RefusedBarriersKernel); }

cudaError_t LaunchRefusedBarriers(const EpPeers& p, int barriers, cudaStream_t stream) {
  if (barriers <= 0 || p.nranks <= 1) return cudaSuccess;
  RefusedBarriersKernel<<<1, 32, 0, stream>>>(p, barriers);
  return cudaGetLastError();
}

}  // namespace jax_ep
