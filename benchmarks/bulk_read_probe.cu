// How many bytes per SM do bulk (TMA) loads from HBM deliver, with the
// slots of kernels/bulk_copy.cuh used as combine's reducers use them (each
// warp loads the next slot while it waits on and reads the current one)?
// Session 13's ncu of the expert-layout reducer: 24 CTAs x 8 warps, slots of
// 8 pieces of 1792 B, ~40 GB/s per SM, HBM at a fifth of its bandwidth, and
// 16 warps with half-size slots slower. This probe separates the load path
// from the reducer's own work: same slots, the same or no reading of them.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I ffi/kernels benchmarks/bulk_read_probe.cu -o /tmp/bulk_read_probe
//   /tmp/bulk_read_probe [GiB] > bulk_read.jsonl
//
// Each line: {"ctas", "warps", "piece", "rows" (pieces per slot, each from
// another random row), "consume" (0: wait only; 1: the warp sums the
// pieces channel by channel as bf16 in f32, as the reducer does), "gbps",
// "gbps_per_sm"}: median of 7.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#include "bulk_copy.cuh"

#include "cuda_check.h"

using jax_ep::BulkSlots;

constexpr uint32_t kRowBytes = 14336;  // H = 7168 bf16

__device__ __forceinline__ uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// Task i: `rows` pieces of `piece` bytes, piece (i % per_row) of random rows.
__device__ __forceinline__ int Issue(BulkSlots& bulk, const char* src, uint32_t nrows, uint32_t piece,
                                     int rows, uint32_t i) {
  const int s = bulk.Begin(piece * static_cast<uint32_t>(rows));
  const uint32_t per_row = kRowBytes / piece;
  const uint32_t off = (i % per_row) * piece;
  for (int r = 0; r < rows; ++r) {
    const uint32_t row = Mix(i * 8u + static_cast<uint32_t>(r)) % nrows;
    bulk.LoadPart(s, static_cast<uint32_t>(r) * piece, src + static_cast<size_t>(row) * kRowBytes + off, piece);
  }
  return s;
}

template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
    Probe(const char* src, uint32_t nrows, uint32_t piece, int rows, uint32_t tasks, int consume, float* sink) {
  __shared__ uint64_t bars[kWarps * jax_ep::kBulkSlots];
  extern __shared__ __align__(128) char smem[];
  const uint32_t slot_bytes = piece * static_cast<uint32_t>(rows);
  BulkSlots bulk = jax_ep::WarpBulkSlots<true>(smem, bars, slot_bytes);
  const uint32_t w = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  if (w >= tasks) return;
  int cur = Issue(bulk, src, nrows, piece, rows, w);
  for (uint32_t i = w; i < tasks; i += nw) {
    const int next = i + nw < tasks ? Issue(bulk, src, nrows, piece, rows, i + nw) : -1;
    bulk.Wait(cur);
    if (consume) {
      // As combine's reducer: each lane sums vector v of every piece, in
      // piece order, into 8 independent f32 accumulators (bf16 channels).
      const char* slot = bulk.Slot(cur);
      const uint32_t nv = piece / 16;
      for (uint32_t v = lane; v < nv; v += 32) {
        float a[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] = -0.f;
        for (int r = 0; r < rows; ++r) {
          const uint4 q = reinterpret_cast<const uint4*>(slot + static_cast<size_t>(r) * piece)[v];
          const uint32_t x[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            a[2 * k] = __fadd_rn(a[2 * k], __fmul_rn(0.5f, __uint_as_float(x[k] << 16)));
            a[2 * k + 1] = __fadd_rn(a[2 * k + 1], __fmul_rn(0.5f, __uint_as_float(x[k] & 0xffff0000u)));
          }
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) acc = __fadd_rn(acc, a[k]);
      }
    }
    __syncwarp();
    cur = next;
  }
  if (acc == 1.2345f) sink[0] = acc;  // keeps the sums
}

template <int kWarps>
float TimeOne(const char* src, uint32_t nrows, int ctas, uint32_t piece, int rows, int consume, float* sink) {
  const size_t smem = static_cast<size_t>(kWarps) * jax_ep::kBulkSlots * piece * rows;
  CK(cudaFuncSetAttribute(Probe<kWarps>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // ~1 GB of loads per launch.
  const uint32_t tasks = static_cast<uint32_t>((1u << 30) / (static_cast<uint64_t>(piece) * rows));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 8; ++rep) {
    CK(cudaEventRecord(a));
    Probe<kWarps><<<ctas, kWarps * 32, smem>>>(src, nrows, piece, rows, tasks, consume, sink);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    if (rep > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double bytes = static_cast<double>(tasks) * piece * rows;
  return static_cast<float>(bytes / (ms[ms.size() / 2] * 1e-3) / 1e9);
}

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 2.0;
  const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / kRowBytes * kRowBytes;
  const uint32_t nrows = static_cast<uint32_t>(bytes / kRowBytes);
  char* src = nullptr;
  float* sink = nullptr;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&sink, sizeof(float)));
  CK(cudaMemset(src, 0x3c, bytes));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Shape { uint32_t piece; int rows; };
  // {3584, 8}: the expert-layout reducer's rows in 4 pieces each; only 4
  // warps' slots fit.
  const Shape shapes[] = {{14336, 1}, {7168, 1}, {1792, 8}, {896, 8}, {3584, 2}, {3584, 8}};
  for (int ctas : {24, 48, sms}) {
    for (int warps : {4, 8, 16}) {
      for (const Shape& s : shapes) {
        const size_t smem = static_cast<size_t>(warps) * jax_ep::kBulkSlots * s.piece * s.rows;
        if (smem > jax_ep::kBulkSmemBytes) continue;
        for (int consume : {0, 1}) {
          const float g = warps == 4   ? TimeOne<4>(src, nrows, ctas, s.piece, s.rows, consume, sink)
                          : warps == 8 ? TimeOne<8>(src, nrows, ctas, s.piece, s.rows, consume, sink)
                                       : TimeOne<16>(src, nrows, ctas, s.piece, s.rows, consume, sink);
          std::printf("{\"ctas\": %d, \"warps\": %d, \"piece\": %u, \"rows\": %d, \"consume\": %d, "
                      "\"gbps\": %.1f, \"gbps_per_sm\": %.1f}\n",
                      ctas, warps, s.piece, s.rows, consume, g, g / ctas);
          std::fflush(stdout);
        }
      }
    }
  }
  CK(cudaFree(src));
  CK(cudaFree(sink));
  return 0;
}
