// The communicator's own stream per device: `dispatch_start` /
// `combine_start` enqueue their kernels there so that XLA's stream can
// compute meanwhile, and `*_done` makes XLA's stream wait for them
// (docs/design.md "Overlap").
//
// Order of one pair, s = XLA's stream, q = this lane's stream:
//   start: record `fork` on s; q waits for it (every input is ready); the
//          op's kernels go on q; record `join` on q.
//   done:  s waits for `join`. The start's outputs are the done's operands
//          and aliased results, so nothing on s reads them before that.
// One pair at a time per device: the kernels of a pending start own the
// window's dispatch/combine area, so any other window op on the device is
// refused until the done (a clear error instead of two ops in one area).
// XLA runs one device's thunks from one thread, so `pending` needs no lock.
#pragma once

#include <cuda_runtime.h>

namespace jax_ep {

struct SideLane {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  const char* pending = nullptr;  // the op of the start without a done yet
};

inline cudaError_t CreateSideLane(SideLane& l) {
  cudaError_t err = cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&l.join, cudaEventDisableTiming);
  return err;
}

inline void DestroySideLane(SideLane& l) {
  if (l.join != nullptr) cudaEventDestroy(l.join);
  if (l.fork != nullptr) cudaEventDestroy(l.fork);
  if (l.stream != nullptr) cudaStreamDestroy(l.stream);
  l = SideLane{};
}

// The stream a start enqueues on, after everything already on `xla`.
inline cudaError_t SideBegin(SideLane& l, cudaStream_t xla, cudaStream_t* side) {
  cudaError_t err = cudaEventRecord(l.fork, xla);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(l.stream, l.fork, 0);
  *side = l.stream;
  return err;
}

// After the start's launches: its end is what the done waits for.
inline cudaError_t SideEnd(SideLane& l, const char* op) {
  cudaError_t err = cudaEventRecord(l.join, l.stream);
  if (err == cudaSuccess) l.pending = op;
  return err;
}

inline cudaError_t SideJoin(SideLane& l, cudaStream_t xla) {
  cudaError_t err = cudaStreamWaitEvent(xla, l.join, 0);
  l.pending = nullptr;
  return err;
}

}  // namespace jax_ep
