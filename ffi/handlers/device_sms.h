// The SM count of a device, queried once per ordinal: handlers and
// launchers size their grids with it on every call.
#pragma once

#include <atomic>

#include <cuda_runtime.h>

namespace jax_ep {

// 0 where the device cannot be asked.
inline int DeviceSms(int ordinal) {
  static std::atomic<int> cache[64] = {};
  if (ordinal < 0 || ordinal >= 64) return 0;
  int n = cache[ordinal].load(std::memory_order_relaxed);
  if (n != 0) return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, ordinal) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();  // the callers fall back; the launch must not report it
    return 0;
  }
  cache[ordinal].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace jax_ep
