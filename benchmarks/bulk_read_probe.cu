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
// pieces channel by channel as bf16 in f32, as the reducer does; 2: the
// same sums with eight rows' loads from shared memory issued first; 3, 4:
// the sums of 1, 2 alone, no loads; session 13's figures used one vector
// per lane, row by row), "gbps", "gbps_per_sm"}: median of 7.
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

// a[e] += 0.5 * bf16 element e of v (eight per uint4), each step rounded
// on its own, as the combine reducer sums (no FMA).
__device__ __forceinline__ void AddBf16x8(float (&a)[8], const uint4& v) {
  const uint32_t x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a[2 * k] = __fadd_rn(a[2 * k], __fmul_rn(0.5f, __uint_as_float(x[k] << 16)));
    a[2 * k + 1] = __fadd_rn(a[2 * k + 1], __fmul_rn(0.5f, __uint_as_float(x[k] & 0xffff0000u)));
  }
}

// Each lane sums vectors of every piece, in piece order, into 8 f32
// accumulators per vector (bf16 channels), as combine's reducer does: kU
// vectors per lane at a time, the vectors of kR rows loaded from shared
// memory before any is added. The reducer is <1, kSmemUnroll = 4>.
template <int kR, int kU>
__device__ __forceinline__ float SumLoadsFirst(const char* slot, uint32_t piece, int rows, int lane) {
  float acc = 0.f;
  const int nv = static_cast<int>(piece / 16);
  for (int base = 0; base < nv; base += 32 * kU) {
    float a[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) a[u][k] = -0.f;
    for (int r0 = 0; r0 < rows; r0 += kR) {
      uint4 q[kR][kU];
#pragma unroll
      for (int r = 0; r < kR; ++r)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int v = base + u * 32 + lane;
          q[r][u] = (r0 + r < rows && v < nv)
                        ? reinterpret_cast<const uint4*>(slot + static_cast<size_t>(r0 + r) * piece)[v]
                        : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int r = 0; r < kR; ++r)
#pragma unroll
        for (int u = 0; u < kU; ++u) AddBf16x8(a[u], q[r][u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc = __fadd_rn(acc, a[u][k]);
  }
  return acc;
}

// consume: 0 wait only; 1 the reducer's sum; 2 eight rows' loads first; 3, 4: the sums
// of 1 and 2 on whatever the slots hold, with no loads at all (the sum's
// own rate).
template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1)
    Probe(const char* src, uint32_t nrows, uint32_t piece, int rows, uint32_t tasks, int consume, float* sink) {
  __shared__ uint64_t bars[kWarps * jax_ep::kBulkSlots];
  extern __shared__ __align__(128) char smem[];
  const uint32_t slot_bytes = piece * static_cast<uint32_t>(rows);
  BulkSlots bulk = jax_ep::WarpBulkSlots<true>(smem, bars, slot_bytes);
  const uint32_t w = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  const int lane = threadIdx.x & 31;
  const bool loads = consume < 3;
  float acc = 0.f;
  if (w >= tasks) return;
  int cur = loads ? Issue(bulk, src, nrows, piece, rows, w) : 0;
  for (uint32_t i = w; i < tasks; i += nw) {
    int next = 1 - cur;
    if (loads) {
      next = i + nw < tasks ? Issue(bulk, src, nrows, piece, rows, i + nw) : -1;
      bulk.Wait(cur);
    }
    const char* slot = bulk.Slot(cur < 0 ? 0 : cur);
    if (consume == 1 || consume == 3) acc = __fadd_rn(acc, SumLoadsFirst<1, 4>(slot, piece, rows, lane));
    if (consume == 2 || consume == 4) acc = __fadd_rn(acc, SumLoadsFirst<8, 2>(slot, piece, rows, lane));
    __syncwarp();
    cur = next;
  }
  if (acc == 1.2345f) sink[0] = acc;  // keeps the sums
}

// The ring alternative: a CTA-wide ring of slots filled by one producer
// warp (its lane 0 issues every load) and summed by groups of kGroup
// consumer warps, a group per slot. A slot is then held only while its
// group sums it (kGroup warps sharing the work), so the rest of the ring
// stays in flight; with per-warp slots, each warp's slot is held for the
// whole of its slow one-warp sum.
__device__ __forceinline__ void MbarInit(uint64_t* b, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(jax_ep::SmemAddr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(jax_ep::SmemAddr(b)), "r"(parity)
                 : "memory");
}

constexpr int kRingMax = 32;

template <int kWarps, int kGroup>
__global__ void __launch_bounds__((kWarps + 1) * 32, 1)
    ProbeRing(const char* src, uint32_t nrows, uint32_t piece, int rows, uint32_t tasks, int nslots, float* sink) {
  __shared__ uint64_t full[kRingMax], empty[kRingMax];
  extern __shared__ __align__(128) char smem[];
  constexpr int kGroups = kWarps / kGroup;
  const uint32_t slot_bytes = piece * static_cast<uint32_t>(rows);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < nslots; ++s) {
      MbarInit(full + s, 1);
      MbarInit(empty + s, kGroup);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // This CTA's tasks: blockIdx.x + j * gridDim.x, slot j % nslots.
  const uint32_t mine = tasks > blockIdx.x ? (tasks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const uint32_t per_row = kRowBytes / piece;
  if (warp == kWarps) {
    if (lane != 0) return;
    for (uint32_t j = 0; j < mine; ++j) {
      const int s = static_cast<int>(j % nslots);
      if (j >= static_cast<uint32_t>(nslots)) MbarWait(empty + s, ((j / nslots) - 1) & 1u);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(jax_ep::SmemAddr(full + s)),
                   "r"(slot_bytes) : "memory");
      const uint32_t i = blockIdx.x + j * gridDim.x;
      const uint32_t off = (i % per_row) * piece;
      for (int r = 0; r < rows; ++r) {
        const uint32_t row = Mix(i * 8u + static_cast<uint32_t>(r)) % nrows;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(jax_ep::SmemAddr(smem + static_cast<size_t>(s) * slot_bytes + r * piece)),
                     "l"(src + static_cast<size_t>(row) * kRowBytes + off), "r"(piece),
                     "r"(jax_ep::SmemAddr(full + s)) : "memory");
      }
    }
    return;
  }
  const int group = warp / kGroup, gt = (warp % kGroup) * 32 + lane;  // thread in group
  const int nv = static_cast<int>(piece / 16);
  float acc = 0.f;
  for (uint32_t j = group; j < mine; j += kGroups) {
    const int s = static_cast<int>(j % nslots);
    MbarWait(full + s, (j / nslots) & 1u);
    const char* slot = smem + static_cast<size_t>(s) * slot_bytes;
    for (int v = gt; v < nv; v += kGroup * 32) {
      float a[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] = -0.f;
      for (int r = 0; r < rows; ++r) {
        AddBf16x8(a, reinterpret_cast<const uint4*>(slot + static_cast<size_t>(r) * piece)[v]);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) acc = __fadd_rn(acc, a[k]);
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(jax_ep::SmemAddr(empty + s)) : "memory");
  }
  if (acc == 1.2345f) sink[0] = acc;
}

// Median milliseconds of seven timed launches after one warm-up.
template <typename Launch>
float MedianMs(Launch launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 8; ++rep) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    CK(cudaGetLastError());
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    if (rep > 0) ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <int kWarps, int kGroup>
float TimeRing(const char* src, uint32_t nrows, int ctas, uint32_t piece, int rows, float* sink) {
  const size_t slot = static_cast<size_t>(piece) * rows;
  // A multiple of the groups: slot s is then always summed by group
  // s % groups, in order, so a group never waits on a slot's next use
  // while another group still holds its current one.
  constexpr int kGroups = kWarps / kGroup;
  const int nslots = static_cast<int>(std::min<size_t>(kRingMax, jax_ep::kBulkSmemBytes / slot)) / kGroups * kGroups;
  if (nslots < 2 * kGroups) return 0.f;
  const size_t smem = nslots * slot;
  CK(cudaFuncSetAttribute(ProbeRing<kWarps, kGroup>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          static_cast<int>(smem)));
  const uint32_t tasks = static_cast<uint32_t>((1u << 30) / slot);
  const float ms = MedianMs([&] { ProbeRing<kWarps, kGroup><<<ctas, (kWarps + 1) * 32, smem>>>(src, nrows, piece, rows, tasks, nslots, sink); });
  return static_cast<float>(static_cast<double>(tasks) * slot / (ms * 1e-3) / 1e9);
}

// Mode 5, a ring per warp of piece-sized slots released one piece at a
// time: a lane copies its vectors of a piece into registers, the slot is
// reloaded at once (the piece kRing ahead), and only then are they summed
// into the lane's accumulators (kept across the task's rows, so a piece is
// read once). Nearly the whole ring stays in flight while the warp sums,
// where with two task-sized slots the one being summed is not.
constexpr int kRing = 32;

template <int kWarps, int kU>
__global__ void __launch_bounds__(kWarps * 32, 1)
    ProbeSub(const char* src, uint32_t nrows, uint32_t piece, int rows, uint32_t tasks, int nsub, float* sink) {
  __shared__ uint64_t bars[kWarps * kRing];
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint64_t* bar = bars + warp * kRing;
  char* ring = smem + static_cast<size_t>(warp) * nsub * piece;
  if (lane == 0) {
    for (int s = 0; s < nsub; ++s) MbarInit(bar + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const uint32_t w = blockIdx.x * kWarps + warp, nw = gridDim.x * kWarps;
  if (w >= tasks) return;
  const uint32_t mine = (tasks - w + nw - 1) / nw;
  const uint32_t total = mine * static_cast<uint32_t>(rows);  // pieces this warp loads
  const uint32_t per_row = kRowBytes / piece;
  // Piece q: row q % rows of task w + (q / rows) * nw.
  auto issue = [&](uint32_t q) {
    if (lane != 0 || q >= total) return;
    const int s = static_cast<int>(q % nsub);
    const uint32_t i = w + (q / rows) * nw, r = q % rows;
    const uint32_t row = Mix(i * 8u + r) % nrows;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(jax_ep::SmemAddr(bar + s)),
                 "r"(piece) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(jax_ep::SmemAddr(ring + static_cast<size_t>(s) * piece)),
                 "l"(src + static_cast<size_t>(row) * kRowBytes + (i % per_row) * piece), "r"(piece),
                 "r"(jax_ep::SmemAddr(bar + s)) : "memory");
  };
  for (int q = 0; q < nsub; ++q) issue(q);
  const int nv = static_cast<int>(piece / 16);
  float acc = 0.f;
  uint32_t q = 0;
  for (uint32_t t = 0; t < mine; ++t) {
    float a[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) a[u][k] = -0.f;
    for (int r = 0; r < rows; ++r, ++q) {
      const int s = static_cast<int>(q % nsub);
      MbarWait(bar + s, (q / nsub) & 1u);
      const uint4* v4 = reinterpret_cast<const uint4*>(ring + static_cast<size_t>(s) * piece);
      uint4 x[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) x[u] = u * 32 + lane < nv ? v4[u * 32 + lane] : make_uint4(0, 0, 0, 0);
      __syncwarp();
      issue(q + nsub);
#pragma unroll
      for (int u = 0; u < kU; ++u) AddBf16x8(a[u], x[u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc = __fadd_rn(acc, a[u][k]);
  }
  if (acc == 1.2345f) sink[0] = acc;
}

template <int kWarps, int kU>
float TimeSub(const char* src, uint32_t nrows, int ctas, uint32_t piece, int rows, float* sink) {
  if (piece > kU * 32 * 16) return 0.f;
  const size_t room = jax_ep::kBulkSmemBytes - sizeof(uint64_t) * kWarps * kRing;  // less the mbarriers
  const int nsub = static_cast<int>(std::min<size_t>(kRing, room / (kWarps * piece)));
  const size_t smem = static_cast<size_t>(kWarps) * nsub * piece;
  CK(cudaFuncSetAttribute(ProbeSub<kWarps, kU>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const uint32_t tasks = static_cast<uint32_t>((1u << 30) / (static_cast<uint64_t>(piece) * rows));
  const float ms = MedianMs([&] { ProbeSub<kWarps, kU><<<ctas, kWarps * 32, smem>>>(src, nrows, piece, rows, tasks, nsub, sink); });
  return static_cast<float>(static_cast<double>(tasks) * piece * rows / (ms * 1e-3) / 1e9);
}

template <int kWarps>
float TimeOne(const char* src, uint32_t nrows, int ctas, uint32_t piece, int rows, int consume, float* sink) {
  const size_t smem = static_cast<size_t>(kWarps) * jax_ep::kBulkSlots * piece * rows;
  CK(cudaFuncSetAttribute(Probe<kWarps>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  // ~1 GB of loads per launch.
  const uint32_t tasks = static_cast<uint32_t>((1u << 30) / (static_cast<uint64_t>(piece) * rows));
  const float ms = MedianMs([&] { Probe<kWarps><<<ctas, kWarps * 32, smem>>>(src, nrows, piece, rows, tasks, consume, sink); });
  const double bytes = static_cast<double>(tasks) * piece * rows;
  return static_cast<float>(bytes / (ms * 1e-3) / 1e9);
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
  const Shape shapes[] = {{14336, 1}, {7168, 2}, {1792, 8}, {896, 8}, {3584, 8}};
  for (int ctas : {24, sms}) {
    for (int warps : {4, 8, 16}) {
      for (const Shape& s : shapes) {
        const size_t smem = static_cast<size_t>(warps) * jax_ep::kBulkSlots * s.piece * s.rows;
        if (smem > jax_ep::kBulkSmemBytes) continue;
        for (int consume : {0, 1, 2, 3, 4}) {
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
  // Mode 5: per-warp rings of pieces.
  const Shape subs[] = {{1792, 8}, {3584, 8}, {896, 8}, {1792, 2}, {3584, 2}, {1792, 1}, {3584, 1}};
  for (int ctas : {24, sms}) {
    for (const Shape& s : subs) {
      const struct { int warps, u; float (*f)(const char*, uint32_t, int, uint32_t, int, float*); } rs[] = {
          {4, 8, TimeSub<4, 8>}, {8, 4, TimeSub<8, 4>}, {8, 8, TimeSub<8, 8>}, {16, 4, TimeSub<16, 4>}};
      for (const auto& r : rs) {
        const float g = r.f(src, nrows, ctas, s.piece, s.rows, sink);
        if (g == 0.f) continue;
        std::printf("{\"sub\": 1, \"ctas\": %d, \"warps\": %d, \"u\": %d, \"piece\": %u, \"rows\": %d, "
                    "\"consume\": 5, \"gbps\": %.1f, \"gbps_per_sm\": %.1f}\n",
                    ctas, r.warps, r.u, s.piece, s.rows, g, g / ctas);
        std::fflush(stdout);
      }
    }
  }
  // The ring: 8 or 16 consumer warps in groups of 1, 2 or 4, plus the
  // producer warp ("warps" counts the consumers; "group" the warps per slot).
  for (int ctas : {24, sms}) {
    for (const Shape& s : shapes) {
      const struct { int warps, group; float (*f)(const char*, uint32_t, int, uint32_t, int, float*); } rs[] = {
          {8, 1, TimeRing<8, 1>}, {8, 2, TimeRing<8, 2>}, {8, 4, TimeRing<8, 4>},
          {16, 2, TimeRing<16, 2>}, {16, 4, TimeRing<16, 4>}};
      for (const auto& r : rs) {
        const float g = r.f(src, nrows, ctas, s.piece, s.rows, sink);
        std::printf("{\"ring\": 1, \"ctas\": %d, \"warps\": %d, \"group\": %d, \"piece\": %u, \"rows\": %d, "
                    "\"consume\": 1, \"gbps\": %.1f, \"gbps_per_sm\": %.1f}\n",
                    ctas, r.warps, r.group, s.piece, s.rows, g, g / ctas);
        std::fflush(stdout);
      }
    }
  }
  CK(cudaFree(src));
  CK(cudaFree(sink));
  return 0;
}
