// The host half of the setup stamps (setup_stamps.h).
#include "setup_stamps.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

// Build option JAX_EP_SETUP_STAMPS (CMakeLists.txt), off by default.
#ifndef JAX_EP_SETUP_STAMPS
#define JAX_EP_SETUP_STAMPS 0
#endif

namespace jax_ep {

// A build with JAX_EP_SETUP_STAMPS=ON (docs/design.md §7): the setup kernel's phase
// times, printed to stderr by a host function queued behind it on the
// stream (so no call waits for the host). Mapped pinned memory, one buffer
// per device: the kernel writes it and the host function reads it. Not in
// a stream capture (a replayed host node would reuse its report, and the
// first allocation may not happen there).
unsigned long long* SetupStampsBuffer(cudaStream_t stream) {
  if (!JAX_EP_SETUP_STAMPS) return nullptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return nullptr;
  }
  static std::mutex mu;
  static unsigned long long* bufs[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (bufs[dev] == nullptr) {
    void* ptr = nullptr;
    if (cudaHostAlloc(&ptr, sizeof(unsigned long long) * kStampSlots, cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    std::memset(ptr, 0, sizeof(unsigned long long) * kStampSlots);
    bufs[dev] = static_cast<unsigned long long*>(ptr);
  }
  return bufs[dev];
}

struct StampReport {
  const unsigned long long* stamps;
  int prep_blocks, rank_blocks, expert;
};

static void CUDART_CB PrintSetupStamps(void* arg) {
  const StampReport* r = static_cast<const StampReport*>(arg);
  const unsigned long long* t = r->stamps;
  const auto us = [&](unsigned long long x) { return (static_cast<double>(x) - static_cast<double>(t[0])) * 1e-3; };
  static const char* kNames[kStampPhases] = {"start", "zeroed", "barrier1", "config", "prep_wait",
                                             "counts", "barrier2", "read_counts", "end"};
  std::string line = r->expert ? "jax_ep setup stamps (expert layout), us:" : "jax_ep setup stamps (rank layout), us:";
  char buf[96];
  for (int i = 1; i < kStampPhases; ++i) {
    std::snprintf(buf, sizeof(buf), " %s %.2f", kNames[i], us(t[i]));
    line += buf;
  }
  // Prep blocks: the rank blocks, then the expert blocks (first start, last end).
  for (int part = 0; part < 2; ++part) {
    const int b0 = part == 0 ? 0 : r->rank_blocks, b1 = part == 0 ? r->rank_blocks : r->prep_blocks;
    if (b1 <= b0) continue;
    double first = 1e30, last = -1e30, longest = 0;
    for (int b = b0; b < b1 && kStampPhases + 2 * b + 1 < kStampSlots; ++b) {
      const double a = us(t[kStampPhases + 2 * b]), e = us(t[kStampPhases + 2 * b + 1]);
      first = std::min(first, a);
      last = std::max(last, e);
      longest = std::max(longest, e - a);
    }
    std::snprintf(buf, sizeof(buf), " | %s prep x%d: first start %.2f, last end %.2f, longest %.2f",
                  part == 0 ? "rank" : "expert", b1 - b0, first, last, longest);
    line += buf;
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  delete r;
}

void ReportSetupStamps(cudaStream_t stream, const unsigned long long* stamps, int prep_blocks, int rank_blocks,
                       bool expert) {
  auto* report = new StampReport{stamps, prep_blocks, rank_blocks, expert};
  if (cudaLaunchHostFunc(stream, PrintSetupStamps, report) != cudaSuccess) {
    (void)cudaGetLastError();  // debugging output only: the op goes on
    delete report;
  }
}

}  // namespace jax_ep
