// nanobind functions only tests and benchmarks call, built with
// JAX_EP_TESTING=ON (CMakeLists.txt) so that a plain install ships the ops
// alone: the virtual-rank harness (loopback.cc), a baseline device copy and
// the device's free memory.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

namespace nb = nanobind;

void RegisterLoopbackBindings(nb::module_& m);  // testing/loopback.cc

void RegisterTestingBindings(nb::module_& m) {
  m.def(
      "time_d2d_memcpy",
      [](int device_ordinal, size_t bytes, int iters) {
        // The baseline engram_publish is held to: a device-to-device
        // cudaMemcpyAsync of the same bytes, median of `iters` (CUDA events).
        int prev = 0;
        cudaGetDevice(&prev);
        auto check = [&](cudaError_t e) {
          if (e != cudaSuccess) {
            cudaSetDevice(prev);
            throw std::runtime_error(cudaGetErrorString(e));
          }
        };
        check(cudaSetDevice(device_ordinal));
        void *src = nullptr, *dst = nullptr;
        check(cudaMalloc(&src, bytes));
        check(cudaMalloc(&dst, bytes));
        cudaEvent_t e0, e1;
        check(cudaEventCreate(&e0));
        check(cudaEventCreate(&e1));
        std::vector<float> ms;
        for (int i = 0; i < iters + 2; ++i) {
          check(cudaEventRecord(e0));
          check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice));
          check(cudaEventRecord(e1));
          check(cudaEventSynchronize(e1));
          float t = 0;
          check(cudaEventElapsedTime(&t, e0, e1));
          if (i >= 2) ms.push_back(t);  // two warm-up copies
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaFree(src);
        cudaFree(dst);
        cudaSetDevice(prev);
        std::sort(ms.begin(), ms.end());
        return ms.empty() ? 0.0 : 1e3 * ms[ms.size() / 2];
      },
      nb::arg("device_ordinal"), nb::arg("bytes"), nb::arg("iters") = 20,
      "Median microseconds of one device-to-device cudaMemcpyAsync of `bytes`.");

  m.def(
      "mem_get_info",
      [](int device_ordinal) {
        int prev = 0;
        cudaGetDevice(&prev);
        size_t free_b = 0, total_b = 0;
        cudaError_t err = cudaSetDevice(device_ordinal);
        if (err == cudaSuccess) err = cudaMemGetInfo(&free_b, &total_b);
        cudaSetDevice(prev);
        if (err != cudaSuccess) throw std::runtime_error(cudaGetErrorString(err));
        return std::make_pair(free_b, total_b);
      },
      nb::arg("device_ordinal"), "(free, total) bytes from cudaMemGetInfo.");

  RegisterLoopbackBindings(m);
}
