// How many CTAs the communicating ops launch, and with which copy engine
// inside the SM (register or bulk copies): the launch policy every launcher
// and handler shares (docs/design.md §6's SM budget).
#pragma once

#include <atomic>

#include <cuda_runtime.h>

namespace jax_ep {

// The SM count of a device, queried once per ordinal: handlers and
// launchers size their grids with it on every call.
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

// The data kernels' SM budget beside compute (docs/design.md §6, DeepEP's
// default).
constexpr int kSmBudget = 24;

// SMs of the launch's device (the budget where it cannot be asked).
int LaunchDeviceSms();

// Whether the normal dispatch / combine may move rows by bulk (TMA) copies
// (kernels/bulk_copy.cuh) on the launch's device; a build with
// JAX_EP_BULK_COPIES=OFF keeps the register copies (for comparison).
bool BulkCopiesEnabled();

// CTAs for the data-moving kernels: at most `requested` (the op's num_sms)
// when > 0, else the bandwidth model's count (launch_policy.cu).
int ChooseNumBlocks(int requested, int work_items, int warps_per_block, int num_ranks, bool beside_compute);

// Splits the data kernel's CTAs (ChooseNumBlocks) into senders and
// receivers (dispatch) / reducers (combine): `recv_requested` of them
// (the op's recv_sms argument) if > 0, else `recv_share` of them. `beside_compute`: the op runs on
// the side stream next to compute it is meant to overlap (a *_start).
void SplitDataBlocks(int requested, int recv_requested, int work_items, int warps_per_block,
                     int num_ranks, double recv_share, bool beside_compute, int* send_blocks,
                     int* recv_blocks);

}  // namespace jax_ep
