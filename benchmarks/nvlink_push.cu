// How fast can SMs drive NVLink from one GPU to another, compared with the
// copy engine? A standalone probe (no NCCL, plain peer access) that times
// pushes (local load, remote store) and pulls (remote load, local store) over
// a grid of CTA counts, unrolls and store kinds, and bulk (TMA) pushes with
// a deep shared-memory ring, one direction and both at once.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/nvlink_push.cu -o /tmp/nvlink_push
//   /tmp/nvlink_push [MiB] [rows] > push.jsonl   ("rows": the RowPush block only)
//
// Each line: {"mode":..., "dir":"uni"|"bi", "ctas":..., "threads":...,
// "unroll":..., "gbps": median over reps (bytes / time, one direction)}.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "cuda_check.h"

enum StoreKind { kPlain = 0, kNoAlloc = 1, kWriteThrough = 2, kRelaxedSys = 3 };

template <int U, int KIND>
__global__ void Push(const uint4* __restrict__ src, uint4* dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t base = static_cast<size_t>(blockIdx.x) * blockDim.x * U + threadIdx.x; base < n;
       base += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + static_cast<size_t>(u) * blockDim.x;
      if (i < n)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(src + i));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + static_cast<size_t>(u) * blockDim.x;
      if (i >= n) continue;
      if (KIND == kPlain)
        asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(dst + i), "r"(v[u].x),
                     "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
      else if (KIND == kNoAlloc)
        asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(dst + i),
                     "r"(v[u].x), "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
      else if (KIND == kWriteThrough)
        asm volatile("st.global.wt.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(dst + i), "r"(v[u].x),
                     "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
      else
        asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(dst + i),
                     "r"(v[u].x), "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
    }
  }
}

// Bulk push: each CTA owns a ring of `stages` shared buffers of `piece`
// bytes; one thread loads a piece by TMA (global -> shared, mbarrier), then
// stores it by TMA (shared -> peer global), keeping up to `stages` stores in
// flight before it reuses a buffer.
__global__ void BulkPush(const char* __restrict__ src, char* dst, size_t bytes, int piece,
                         int stages) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bar[16];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) {
    const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[s]));
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(b));
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  uint32_t phase = 0;
  const size_t pieces = (bytes + piece - 1) / piece;
  int k = 0;
  for (size_t i = blockIdx.x; i < pieces; i += gridDim.x, ++k) {
    const int s = k % stages;
    if (k >= stages) {
      // Buffer s is free once at most stages-1 stores are still reading.
      switch (stages) {
        case 2: asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory"); break;
        case 4: asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory"); break;
        case 6: asm volatile("cp.async.bulk.wait_group.read 5;" ::: "memory"); break;
        default: asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); break;
      }
    }
    const size_t off = i * piece;
    const uint32_t n = static_cast<uint32_t>(bytes - off < static_cast<size_t>(piece) ? bytes - off : piece);
    const uint32_t sb = static_cast<uint32_t>(__cvta_generic_to_shared(smem + static_cast<size_t>(s) * piece));
    const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[s]));
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(n) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sb),
        "l"(src + off), "r"(n), "r"(b)
        : "memory");
    const uint32_t ph = (phase >> s) & 1u;
    asm volatile(
        "{\n .reg .pred p;\n W%=: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W%=;\n}" ::"r"(b),
        "r"(ph)
        : "memory");
    phase ^= 1u << s;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off), "r"(sb),
                 "r"(n)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The dispatch data kernel's shape, piece by piece: a warp per row of
// `nvec` 16-byte vectors, rows strided over the sending warps, each row
// stored to the peer (and, kLocal, to a local output row too), then (kFence)
// a system fence and a counter add per row. CTAs past `send_ctas` stand in
// for the receivers: they copy a local buffer of the same size meanwhile.
template <bool kLocal, bool kFence>
__global__ void __launch_bounds__(1024, 1) RowPush(const uint4* __restrict__ x, uint4* remote,
                                                   uint4* local, uint32_t* counters, int rows,
                                                   int nvec, int send_ctas, const uint4* __restrict__ cin,
                                                   uint4* cout) {
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x / 32;
  if (static_cast<int>(blockIdx.x) >= send_ctas) {
    const size_t n = static_cast<size_t>(rows) * nvec;
    const size_t stride = static_cast<size_t>(gridDim.x - send_ctas) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x - send_ctas) * blockDim.x + threadIdx.x; i < n; i += stride)
      cout[i] = cin[i];
    return;
  }
  const int gw = blockIdx.x * warps + (threadIdx.x >> 5);
  const int nw = send_ctas * warps;
  for (int t = gw; t < rows; t += nw) {
    const uint4* src = x + static_cast<size_t>(t) * nvec;
    uint4* dst = remote + static_cast<size_t>(t) * nvec;
    uint4* out = local + static_cast<size_t>(t) * nvec;
    for (int base = 0; base < nvec; base += 128) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * 32 + lane;
        if (i < nvec)
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + i));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * 32 + lane;
        if (i >= nvec) continue;
        asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(dst + i), "r"(v[u].x),
                     "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
        if (kLocal)
          asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(out + i), "r"(v[u].x),
                       "r"(v[u].y), "r"(v[u].z), "r"(v[u].w) : "memory");
      }
    }
    if (kFence) {
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        asm volatile("red.relaxed.sys.global.add.u32 [%0], 1;" ::"l"(counters + t / 32) : "memory");
      }
    }
  }
}

struct Pair {
  int dev[2] = {0, 1};
  char* buf[2][2];  // [device][0 = src, 1 = dst]
  cudaStream_t st[2];
  cudaEvent_t e0[2], e1[2];
};

template <typename Launch>
double TimeIt(Pair& P, bool bi, size_t bytes, int reps, Launch launch) {
  std::vector<double> gbps;
  for (int r = 0; r < reps + 2; ++r) {
    const int nd = bi ? 2 : 1;
    for (int d = 0; d < nd; ++d) {
      CK(cudaSetDevice(P.dev[d]));
      CK(cudaEventRecord(P.e0[d], P.st[d]));
      launch(d, P.buf[d][0], P.buf[1 - d][1], P.st[d]);
      CK(cudaEventRecord(P.e1[d], P.st[d]));
    }
    float worst = 0.f;
    for (int d = 0; d < nd; ++d) {
      CK(cudaSetDevice(P.dev[d]));
      CK(cudaEventSynchronize(P.e1[d]));
      float ms;
      CK(cudaEventElapsedTime(&ms, P.e0[d], P.e1[d]));
      worst = std::max(worst, ms);
    }
    if (r >= 2) gbps.push_back(bytes / (worst * 1e-3) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::atoi(argv[1]) : 256;
  const size_t bytes = mib << 20;
  const int reps = 9;
  const bool rows_only = argc > 2 && std::string(argv[2]) == "rows";  // the RowPush block alone
  Pair P;
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(P.dev[d]));
    CK(cudaDeviceEnablePeerAccess(P.dev[1 - d], 0));
    CK(cudaMalloc(&P.buf[d][0], bytes));
    CK(cudaMalloc(&P.buf[d][1], bytes));
    CK(cudaMemset(P.buf[d][0], 1 + d, bytes));
    CK(cudaStreamCreateWithFlags(&P.st[d], cudaStreamNonBlocking));
    CK(cudaEventCreate(&P.e0[d]));
    CK(cudaEventCreate(&P.e1[d]));
    CK(cudaFuncSetAttribute(BulkPush, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  }
  auto emit = [&](const char* mode, bool bi, int ctas, int threads, int unroll, double g) {
    std::printf("{\"mode\":\"%s\",\"dir\":\"%s\",\"ctas\":%d,\"threads\":%d,\"unroll\":%d,\"mib\":%zu,\"gbps\":%.1f}\n",
                mode, bi ? "bi" : "uni", ctas, threads, unroll, mib, g);
    std::fflush(stdout);
  };
  for (bool bi : {false, true}) {
    emit("copy_engine", bi, 0, 0, 0, TimeIt(P, bi, bytes, reps, [&](int d, char* s, char* t, cudaStream_t st) {
           CK(cudaMemcpyAsync(t, s, bytes, cudaMemcpyDefault, st));
         }));
    const size_t n = bytes / 16;
    {
      // Rows of the Normal shape: 4096 x 7168 bf16 (58.7 MB).
      const int rows = 4096, nvec = 7168 * 2 / 16;
      const size_t rb = static_cast<size_t>(rows) * nvec * 16;
      auto rowpush = [&](auto kernel, const char* name, int send, int recv) {
        emit(name, bi, send, 1024, recv, TimeIt(P, bi, rb, reps, [&](int d, char* s, char* t, cudaStream_t st) {
               // Local output, counters and the copier's buffers live in this GPU's dst/src halves.
               char* mine = P.buf[d][1];
               kernel<<<send + recv, 1024, 0, st>>>(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(t),
                                                   reinterpret_cast<uint4*>(mine + rb),
                                                   reinterpret_cast<uint32_t*>(mine + 2 * rb), rows, nvec, send,
                                                   reinterpret_cast<const uint4*>(s + rb),
                                                   reinterpret_cast<uint4*>(mine + 3 * rb));
             }));
      };
      rowpush(RowPush<false, false>, "rows", 12, 0);
      rowpush(RowPush<true, false>, "rows_local", 12, 0);
      rowpush(RowPush<false, true>, "rows_fence", 12, 0);
      rowpush(RowPush<true, true>, "rows_local_fence", 12, 0);
      rowpush(RowPush<true, true>, "rows_local_fence_copier", 12, 12);
      rowpush(RowPush<false, false>, "rows_copier", 12, 12);
      rowpush(RowPush<true, true>, "rows_local_fence", 24, 0);
      rowpush(RowPush<false, false>, "rows", 24, 0);
    }
    if (rows_only) continue;
    auto push = [&](auto kernel, const char* name, int ctas, int threads, int unroll) {
      emit(name, bi, ctas, threads, unroll, TimeIt(P, bi, bytes, reps, [&](int d, char* s, char* t, cudaStream_t st) {
             kernel<<<ctas, threads, 0, st>>>(reinterpret_cast<const uint4*>(s), reinterpret_cast<uint4*>(t), n);
           }));
    };
    for (int ctas : {8, 16, 24, 32, 48, 66, 132}) {
      for (int threads : {512, 1024}) {
        push(Push<4, kNoAlloc>, "push_na", ctas, threads, 4);
        push(Push<8, kNoAlloc>, "push_na", ctas, threads, 8);
      }
    }
    for (int ctas : {24, 132}) {
      push(Push<16, kNoAlloc>, "push_na", ctas, 512, 16);
      push(Push<4, kPlain>, "push_plain", ctas, 1024, 4);
      push(Push<4, kWriteThrough>, "push_wt", ctas, 1024, 4);
      push(Push<4, kRelaxedSys>, "push_relaxed_sys", ctas, 1024, 4);
      // Pull: the peer's memory is the source, this GPU's the destination.
      emit("pull_na", bi, ctas, 1024, 4, TimeIt(P, bi, bytes, reps, [&](int d, char* s, char* t, cudaStream_t st) {
             // s is local src, t is the peer's dst; pull the peer's src into local dst.
             Push<4, kNoAlloc><<<ctas, 1024, 0, st>>>(reinterpret_cast<const uint4*>(P.buf[1 - d][0]),
                                                      reinterpret_cast<uint4*>(P.buf[d][1]), n);
           }));
    }
    for (int ctas : {16, 24, 32, 66, 132}) {
      for (int piece : {8192, 16384, 32768}) {
        for (int stages : {2, 4, 6}) {
          if (static_cast<size_t>(piece) * stages > 192 * 1024) continue;
          char name[64];
          std::snprintf(name, sizeof(name), "bulk_%dk", piece / 1024);
          emit(name, bi, ctas, 32, stages, TimeIt(P, bi, bytes, reps, [&](int d, char* s, char* t, cudaStream_t st) {
                 BulkPush<<<ctas, 32, static_cast<size_t>(piece) * stages, st>>>(s, t, bytes, piece, stages);
               }));
        }
      }
    }
  }
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(P.dev[d]));
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
  }
  return 0;
}
