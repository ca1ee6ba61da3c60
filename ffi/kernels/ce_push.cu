// Host side of the copy-engine path: see ce_push.h.
#include "ce_push.h"

#include <cuda.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "window_layout.h"

namespace jax_ep {
namespace {

using WaitValue32Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// The runtime has no stream wait-on-memory call; take the driver's without
// linking libcuda (the runtime hands out its entry points).
WaitValue32Fn WaitValue32() {
  static WaitValue32Fn fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &f, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<WaitValue32Fn>(f);
    }
  });
  return fn;
}

int EnvCopies() {
  const char* v = std::getenv("JAX_EP_CE_COPIES");
  const int n = v ? std::atoi(v) : 0;
  return n > 0 ? (n < kMaxCeChunks ? n : kMaxCeChunks) : 8;
}

}  // namespace

cudaError_t CreateCeLane(CeLane& lane) {
  cudaError_t err = cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&lane.fork, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&lane.join, cudaEventDisableTiming);
  return err;
}

void DestroyCeLane(CeLane& lane) {
  if (lane.join) cudaEventDestroy(lane.join);
  if (lane.fork) cudaEventDestroy(lane.fork);
  if (lane.stream) cudaStreamDestroy(lane.stream);
  lane = CeLane{};
}

// Both variables are read at every launch (a getenv is ~100 ns), so one
// process can compare the paths.
bool UseCopyEngine(int num_ranks, uint32_t gin_mask) {
  // auto (the default) | sm | ce; only "ce" picks the copy engine, which measured
  // slower than SM stores at the Normal shape (ce_push.h).
  const char* v = std::getenv("JAX_EP_REMOTE");
  const bool ce = v != nullptr && std::strcmp(v, "ce") == 0;
  return ce && num_ranks >= 2 && gin_mask == 0 && WaitValue32() != nullptr;
}

int CeCopies() { return EnvCopies(); }

cudaError_t CeFork(CeLane& lane, cudaStream_t s) { return cudaEventRecord(lane.fork, s); }

cudaError_t EnqueueCeCopies(CeLane& lane, const EpPeers& p, const CeCopy& c, cudaStream_t s) {
  const WaitValue32Fn wait = WaitValue32();
  if (wait == nullptr) return cudaErrorNotSupported;
  cudaError_t err = cudaStreamWaitEvent(lane.stream, lane.fork, 0);
  const int R = p.nranks, me = p.rank;
  char* const mine = p.base[me];
  // The epoch is a little-endian u64: its first 4 bytes are the low word.
  const void* epoch_lo = static_cast<const void*>(p.epoch);
  const int chunks = NumChunks(c.T, c.chunk_rows);
  for (int ch = 0; ch < chunks && err == cudaSuccess; ++ch) {
    const int row0 = ch * c.chunk_rows;
    const int rows = c.T - row0 < c.chunk_rows ? c.T - row0 : c.chunk_rows;
    const size_t bytes = static_cast<size_t>(rows) * c.row_bytes;
    for (int d = 1; d < R && err == cudaSuccess; ++d) {
      const int j = (me + d) % R;
      const CUresult cu = wait(reinterpret_cast<CUstream>(lane.stream),
                               reinterpret_cast<CUdeviceptr>(CeReady(mine, j, ch)), c.seq,
                               CU_STREAM_WAIT_VALUE_EQ);
      if (cu != CUDA_SUCCESS) return cudaErrorUnknown;
      const char* src = mine + c.stage_off + (static_cast<size_t>(j) * c.T + row0) * c.row_bytes;
      char* dst = p.base[j] + c.recv_off + (static_cast<size_t>(me) * c.T + row0) * c.row_bytes;
      err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, lane.stream);
      // Same stream: the flag copy starts only after the rows' copy is done.
      if (err == cudaSuccess)
        err = cudaMemcpyAsync(CeArrived(p.base[j], me, ch), epoch_lo, sizeof(uint32_t),
                              cudaMemcpyDeviceToDevice, lane.stream);
    }
  }
  if (err == cudaSuccess) err = cudaEventRecord(lane.join, lane.stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(s, lane.join, 0);
  return err;
}

}  // namespace jax_ep
