// Loading every kernel of the communicating ops up front, once per device.
//
// CUDA loads a kernel lazily, at its first launch, and that load may wait
// for the kernels already running on the device. A kernel of ours that
// waits on a peer then holds up the launching host thread until the peer
// arrives; when the same thread is the one that would launch that peer
// (virtual ranks, ffi/testing/loopback.cc; one host thread driving several
// GPUs), it deadlocks until the timeout (2026-12-03: 9 timeouts). So the
// Communicator (ffi/runtime/comm.cc) and the loopback harness load all of them on
// each device they set up, before any op can wait (docs/design.md §8).
#pragma once

#include <cuda_runtime.h>

namespace jax_ep {

// Loads each kernel on the current device; the first error, if any.
template <typename... Kernels>
inline cudaError_t LoadEach(Kernels... kernels) {
  cudaError_t first = cudaSuccess;
  cudaFuncAttributes attr;
  ((first = first != cudaSuccess ? first : cudaFuncGetAttributes(&attr, kernels)), ...);
  return first;
}

// One per kernel file, next to the code that picks among its variants:
// every variant a launcher can pick must be listed there
// (tests/test_kernel_load.py checks the names and written-out instances).
cudaError_t LoadLayoutKernels();       // layout.cu
cudaError_t LoadDispatchSetupKernels();  // dispatch_setup.cu
cudaError_t LoadDispatchKernels();     // dispatch.cu
cudaError_t LoadCombineKernels();      // combine.cu
cudaError_t LoadLowLatencyKernels();   // low_latency.cu
cudaError_t LoadEngramKernels();       // engram.cu
cudaError_t LoadEngramGinKernels();    // engram_gin.cu
cudaError_t LoadAbortKernels();        // abort.cu

inline cudaError_t LoadCommKernels() {
  for (auto load : {LoadLayoutKernels, LoadDispatchSetupKernels, LoadDispatchKernels, LoadCombineKernels, LoadLowLatencyKernels,
                    LoadEngramKernels, LoadEngramGinKernels, LoadAbortKernels}) {
    if (cudaError_t err = load(); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_ep
