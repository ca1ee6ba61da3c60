// Engram publish / fetch over LSA (see engram.cuh, engram_layout.h); a
// fetch with a GIN peer goes to engram_gin.cu.
//
// Fetch is a gather: the output [n, row_bytes] is viewed as n * row_bytes/16
// 16-byte items; item q belongs to row q / vpr, chunk q % vpr. Consecutive
// threads take consecutive items, so the stores are coalesced and the 16 (bf16,
// D = 128) or 8 (FP8) threads of one row read its whole 256 / 128 bytes from
// the owner's window in one transaction. Each thread keeps kUnroll loads in
// flight before it stores (benchmarks/RESULTS.md: bytes in flight, not SM count, set the
// NVLink rate).
#include "config_check.cuh"
#include "engram.cuh"
#include "engram_rows.cuh"
#include "ep_copy.cuh"
#include "kernel_load.h"
#include "peer.cuh"

#include <algorithm>

namespace jax_ep {
namespace {

constexpr int kFetchThreads = 1024;
constexpr int kFetchMaxBlocks = 64;
// Loads in flight per thread: 4 when the whole gather fits one pass of the
// grid at 4 (a decode-size fetch: more CTAs, one load each), else 8 (a large
// fetch: each CTA is latency-bound, so deeper is faster; measured at EP1,
// benchmarks/RESULTS.md, 2026-12-02).
constexpr int kFetchUnrollSmall = 4;
constexpr int kFetchUnrollLarge = 8;

// After the copy: the barrier (every shard in place), then a new version,
// drawn on the device so that a replayed command buffer draws a new one
// too, into the slot's word and the token. An error already in the status
// word (e.g. the first barrier of this publish timed out) means the copy
// may not be complete everywhere: it still takes part in the barrier so the
// peers are not left waiting, but leaves the token and the word at 0.
__device__ void FinishPublish(const EpPeers& p, const EngramPublishArgs& a) {
  const bool ok = rank_barrier(p, Op::kEngramFetch);
  uint32_t v = 0;
  if (ok && !has_error(p)) {
    // 31 bits, never 0: the token is an s32 and 0 means "no publication".
    const unsigned long long n = a.versions[0] + 1;
    a.versions[0] = n;
    v = static_cast<uint32_t>((n - 1) % 0x7fffffffull) + 1;
  }
  a.versions[1 + a.slot] = v;
  if (a.token != nullptr) *a.token = static_cast<int32_t>(v);
}

// The version words of the slots in `m` to 0 (no live publication there).
// All threads of the block.
__device__ void ClearSlots(const EngramSlotMask& m, unsigned long long* versions) {
  for (int s = threadIdx.x; s < kEngramSlots; s += blockDim.x) {
    if ((m.bits[s / 64] >> (s % 64)) & 1u) versions[1 + s] = 0;
  }
}

// Before the copy (!after_copy): the areas it overwrites, its own
// included, have no live publication from now on, and no peer still reads
// them (barrier); every rank places the same table (config_check.cuh: a
// difference is reported, and FinishPublish then leaves no version, so
// fetches read zeros). After the copy: FinishPublish.
__global__ void EngramBarrierKernel(const __grid_constant__ EpPeers p,
                                    const __grid_constant__ EngramPublishArgs a, bool after_copy) {
  if (after_copy) {
    if (threadIdx.x == 0) FinishPublish(p, a);
    return;
  }
  ClearSlots(a.clear, a.versions);
  __syncthreads();  // the clears before thread 0's fence in the barrier
  if (threadIdx.x == 0) {
    const uint32_t v[] = {static_cast<uint32_t>(a.rows_per_rank), static_cast<uint32_t>(a.row_bytes),
                          static_cast<uint32_t>(a.table_off / 16)};
    PublishConfig(p, MakeOpConfig(Op::kEngramFetch, v), static_cast<uint32_t>(*p.epoch + 1));
    if (rank_barrier(p, Op::kEngramFetch)) PeersShareConfig(p, Op::kEngramFetch);
  }
}

__global__ void EngramClearKernel(const __grid_constant__ EngramSlotMask m,
                                  unsigned long long* versions) {
  ClearSlots(m, versions);
}

template <bool kVec, int kFetchUnroll>
// __grid_constant__: `p` is read in place (report_error takes it by
// reference), not copied to a per-thread stack frame.
__global__ void __launch_bounds__(kFetchThreads)
    EngramFetchKernel(const __grid_constant__ EngramFetchArgs a, const __grid_constant__ EpPeers p) {
  // Peer window bases in shared memory, so the per-item owner lookup is a
  // shared load rather than a divergent constant-bank read.
  __shared__ const char* s_window[kMaxRanks];
  if (threadIdx.x < kMaxRanks) s_window[threadIdx.x] = PeerWindow(p, threadIdx.x);
  __syncthreads();
  // The handler guarantees num_rows * row_bytes < 2^31: 32-bit item math.
  const uint32_t vpr = static_cast<uint32_t>(a.row_bytes / 16);   // 16-byte chunks per row
  const uint32_t total = static_cast<uint32_t>(a.num_rows * (kVec ? vpr : a.row_bytes));
  const uint64_t V = static_cast<uint64_t>(a.rows_per_rank) * p.nranks;
  const uint32_t stride = gridDim.x * blockDim.x;
  // A stale publication reads nothing: every index counts as -1 (zeros).
  const bool stale = EngramStale(a);
  bool bad = false;
  // V = rows_per_rank * R <= 2^31 (the handler checks): 32-bit row math.
  const uint32_t rpr = static_cast<uint32_t>(a.rows_per_rank);
  const uint32_t V32 = static_cast<uint32_t>(V);
  if (kVec) {
    uint4* out = static_cast<uint4*>(a.out);
    for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < total;
         base += stride * kFetchUnroll) {
      // Every index load of the pass first, then every row load: a pass
      // waits for one round trip of each rather than kFetchUnroll of them
      // in a row (each row load depends on its index). Past the end a
      // thread reads row 0's index (num_rows >= 1) and ignores it.
      int32_t idx[kFetchUnroll];
      uint32_t row[kFetchUnroll];
#pragma unroll
      for (int u = 0; u < kFetchUnroll; ++u) {
        const uint32_t q = base + u * stride;
        row[u] = q < total ? q / vpr : 0u;
        idx[u] = __ldg(a.indices + row[u]);
      }
      uint4 v[kFetchUnroll];
#pragma unroll
      for (int u = 0; u < kFetchUnroll; ++u) {
        const uint32_t q = base + u * stride;
        v[u] = make_uint4(0, 0, 0, 0);
        // A stale publication reads nothing (the version check's loads
        // overlap the index loads above).
        const int32_t id = stale || q >= total ? -1 : idx[u];
        if (id >= 0 && static_cast<uint32_t>(id) < V32) {
          const uint32_t owner = EngramOwnerOf(static_cast<uint32_t>(id), rpr, p.nranks);
          const uint32_t local = static_cast<uint32_t>(id) - owner * rpr;
          const uint32_t chunk = q - row[u] * vpr;
          const uint4* src = reinterpret_cast<const uint4*>(s_window[owner] + a.table_off +
                                                           static_cast<size_t>(local) * a.row_bytes) + chunk;
          v[u] = LdNcNa(src);
        } else if (id != -1) {
          bad = true;
        }
      }
#pragma unroll
      for (int u = 0; u < kFetchUnroll; ++u) {
        const uint32_t q = base + u * stride;
        if (q < total) StNa(out + q, v[u]);
      }
    }
  } else {
    // Byte path for an unaligned output (XLA normally aligns buffers, so
    // this is a fallback, not a fast path).
    char* out = static_cast<char*>(a.out);
    for (uint32_t q = blockIdx.x * blockDim.x + threadIdx.x; q < total; q += stride) {
      const uint32_t row = q / static_cast<uint32_t>(a.row_bytes);
      const uint32_t byte = q - row * static_cast<uint32_t>(a.row_bytes);
      const int32_t idx = stale ? -1 : __ldg(a.indices + row);
      char b = 0;
      if (idx >= 0 && static_cast<uint64_t>(idx) < V) {
        const int owner = static_cast<int>(static_cast<uint64_t>(idx) / a.rows_per_rank);
        const uint64_t local = static_cast<uint64_t>(idx) - static_cast<uint64_t>(owner) * a.rows_per_rank;
        b = s_window[owner][a.table_off + local * a.row_bytes + byte];
      } else if (idx != -1) {
        bad = true;
      }
      out[q] = b;
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) report_error(p, Op::kEngramFetch, Cause::kBadIndex);
  // Reported last, so that no branch on `stale` holds the loads above
  // behind the version check's two loads.
  if (stale && blockIdx.x == 0 && threadIdx.x == 0) {
    report_error(p, Op::kEngramFetch, Cause::kStalePublication);
  }
}

}  // namespace

// Every kernel of the launchers below (the fused publish + fetch handler
// launches a fetch behind the publish's waiting barriers).
cudaError_t LoadEngramKernels() {
  return LoadEach(EngramBarrierKernel, EngramClearKernel, EngramFetchKernel<true, kFetchUnrollLarge>,
                  EngramFetchKernel<true, kFetchUnrollSmall>, EngramFetchKernel<false, 1>);
}

cudaError_t LaunchEngramPublish(const EngramPublishArgs& a, const EpPeers& p, cudaStream_t stream) {
  EngramBarrierKernel<<<1, 32, 0, stream>>>(p, a, false);
  if (a.table_bytes > 0) {
    // The local copy by the copy engine: the same path as the
    // cudaMemcpyAsync the publish is measured against, and no SMs taken.
    // A 264-CTA SM copy with the second barrier in its last CTA took 76 µs
    // of GPU time per 134 MB against the copy engine's 71 (1 x H200,
    // benchmarks/RESULTS.md, 2026-12-01). After a failed first barrier the
    // copy still runs; the token reports it.
    cudaError_t err = cudaMemcpyAsync(MyWindow(p) + a.table_off, a.table, a.table_bytes,
                                      cudaMemcpyDeviceToDevice, stream);
    if (err != cudaSuccess) return err;
  }
  EngramBarrierKernel<<<1, 32, 0, stream>>>(p, a, true);
  return cudaGetLastError();
}

cudaError_t LaunchEngramClear(const EngramSlotMask& m, unsigned long long* versions,
                              cudaStream_t stream) {
  if (!m.Any()) return cudaSuccess;
  EngramClearKernel<<<1, kEngramSlots, 0, stream>>>(m, versions);
  return cudaGetLastError();
}

cudaError_t LaunchEngramFetch(const EngramFetchArgs& a, const EpPeers& p, cudaStream_t stream,
                              const EngramGinFetchArgs& gin) {
  if (a.num_rows == 0 || a.row_bytes == 0) return cudaSuccess;
  // A GIN owner's window is not mapped here: its rows come by request and answer.
  if (AnyGinPeer(p)) return LaunchEngramGinFetch(a, gin, p, stream);
  const bool vec = a.row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(a.out) % 16) == 0 &&
                   a.table_off % 16 == 0;
  const uint64_t items = static_cast<uint64_t>(a.num_rows) * (vec ? a.row_bytes / 16 : a.row_bytes);
  const int cap = a.num_sms > 0 ? a.num_sms : kFetchMaxBlocks;
  const bool large = vec && items > static_cast<uint64_t>(cap) * kFetchThreads * kFetchUnrollSmall;
  const uint64_t per_block =
      static_cast<uint64_t>(kFetchThreads) * (!vec ? 1 : large ? kFetchUnrollLarge : kFetchUnrollSmall);
  const int blocks = static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(static_cast<uint64_t>(cap), (items + per_block - 1) / per_block)));
  if (large) {
    EngramFetchKernel<true, kFetchUnrollLarge><<<blocks, kFetchThreads, 0, stream>>>(a, p);
  } else if (vec) {
    EngramFetchKernel<true, kFetchUnrollSmall><<<blocks, kFetchThreads, 0, stream>>>(a, p);
  } else {
    EngramFetchKernel<false, 1><<<blocks, kFetchThreads, 0, stream>>>(a, p);
  }
  return cudaGetLastError();
}

}  // namespace jax_ep
