// The launch policy (launch_policy.h): host code only.
#include "launch_policy.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#include "bulk_copy.cuh"
#include "ep_copy.cuh"

// Build option JAX_EP_BULK_COPIES (CMakeLists.txt): OFF keeps the normal
// kernels on register copies everywhere, to compare the two.
#ifndef JAX_EP_BULK_COPIES
#define JAX_EP_BULK_COPIES 1
#endif

namespace jax_ep {

// fn(device) for the current device, asked once per device (0 in `cache`:
// not asked yet; fn returns > 0); `fallback` where the device is unknown.
template <typename F>
static int OncePerDevice(std::atomic<int> (&cache)[64], int fallback, F fn) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return fallback;
  if (dev < 64) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v != 0) return v;
  }
  const int v = fn(dev);
  if (dev < 64) cache[dev].store(v, std::memory_order_relaxed);
  return v;
}

bool BulkCopiesEnabled() {
  if (!JAX_EP_BULK_COPIES) return false;
  // The launch's device: sm_90 or newer with the shared memory the slots
  // and the kernels' static shared memory take (1: no, 2: yes).
  static std::atomic<int> known[64] = {};
  return OncePerDevice(known, 1, [](int dev) {
           int major = 0, optin = 0;
           const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                           cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess &&
                           major >= 9 && static_cast<size_t>(optin) >= kBulkSmemBytes + 1024;
           return ok ? 2 : 1;
         }) == 2;
}

int LaunchDeviceSms() {
  int dev = 0;
  const int n = cudaGetDevice(&dev) == cudaSuccess ? DeviceSms(dev) : 0;
  return n > 0 ? n : kSmBudget;
}

int ChooseNumBlocks(int requested, int work_items, int warps_per_block, int num_ranks, bool beside_compute) {
  int cap = requested;
  if (cap <= 0) {
    // Little's law: a link of B bytes/s with latency L needs B*L bytes in
    // flight. NVLink on H200 ~450 GB/s per direction, ~2 µs from load issue
    // to remote store completion -> ~0.9 MB. One CTA of 32 warps with
    // kUnroll 16-byte loads per lane keeps 64 KiB in flight -> ~14 CTAs for
    // the link. The same kernels also copy the local 1/R share of the rows
    // through HBM, so scale by R/(R-1); cap at 24 SMs (docs/design.md §6 budget,
    // DeepEP's default) so the op leaves the rest of the GPU to compute.
    // (This counts register copies; the bulk kernels' 8 or 16 warps give
    // fewer bytes per CTA by this count, so they always reach the cap,
    // although each of their warps keeps two whole rows in flight.)
    const double bytes_in_flight = 450e9 * 2e-6;
    const double per_cta = warps_per_block * 32.0 * kUnroll * 16.0;
    double ctas = std::ceil(bytes_in_flight / per_cta);
    if (num_ranks > 1) ctas = std::ceil(ctas * num_ranks / (num_ranks - 1.0));
    cap = static_cast<int>(std::min(ctas, static_cast<double>(kSmBudget)));
    // One rank: no link and no peer, so nothing to leave SMs for; the op is
    // a local copy (HBM to HBM) on the step's critical path, bound by the
    // SMs it gets (benchmarks/RESULTS.md, 2026-12-02: 24 CTAs 1.7 x slower
    // than 132 in dispatch): every SM, like XLA's own copies -- unless it
    // runs beside the compute it should overlap (a *_start), which keeps
    // the budget.
    if (num_ranks == 1 && !beside_compute) cap = LaunchDeviceSms();
  }
  const int needed = (work_items + warps_per_block - 1) / warps_per_block;
  return std::max(1, std::min(cap, needed));
}

void SplitDataBlocks(int requested, int recv_requested, int work_items, int warps_per_block,
                     int num_ranks, double recv_share, bool beside_compute, int* send_blocks,
                     int* recv_blocks) {
  const int total = ChooseNumBlocks(requested, work_items, warps_per_block, num_ranks, beside_compute);
  int q = 0;
  if (num_ranks > 1) {
    // At least one of each, also when the work needs a single CTA: remote
    // rows are only ever consumed by receivers.
    q = recv_requested > 0 ? recv_requested : static_cast<int>(std::lround(total * recv_share));
    q = std::min(std::max(q, 1), std::max(total - 1, 1));
  }
  *recv_blocks = q;
  *send_blocks = std::max(1, total - q);
}

}  // namespace jax_ep
