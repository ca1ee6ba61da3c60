// The SM count of a device, queried once per ordinal: handlers size their
// grids with it on every call.
#pragma once

#include <array>

#include <cuda_runtime.h>

namespace jax_ep {

inline int DeviceSms(int ordinal) {
  static std::array<int, 64> cache{};
  if (ordinal < 0 || ordinal >= static_cast<int>(cache.size())) return 0;
  if (cache[ordinal] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, ordinal) == cudaSuccess) {
      cache[ordinal] = n;
    }
  }
  return cache[ordinal];
}

}  // namespace jax_ep
