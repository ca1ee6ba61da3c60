// Debugging aid, built with JAX_EP_SETUP_STAMPS=ON only (CMakeLists.txt):
// where dispatch's setup kernel spends its time (benchmarks/setup_stamps.py
// reads the report). The kernel notes the global timer into a mapped host
// buffer; a host function queued behind it prints them to stderr, so no
// call waits for the host.
#pragma once

#include <cuda_runtime.h>

namespace jax_ep {

// The slots: the control block's thread 0 notes the global timer after each phase
// (slots [0, kStampPhases)), each prep block its start and end
// (kStampPhases + 2 b, + 1). Off (null), a stamp is one untaken branch.
enum SetupStamp : int {
  kStampStart, kStampZeroed, kStampBarrier1, kStampConfig, kStampPrepWait, kStampCounts,
  kStampBarrier2, kStampReadCounts, kStampEnd, kStampPhases
};
constexpr int kStampSlots = 1024;

// The buffer the setup kernel stamps into, or null when the stamps are not
// built or the stream is being captured.
unsigned long long* SetupStampsBuffer(cudaStream_t stream);
// Queues the report of one setup launch behind it on `stream`.
void ReportSetupStamps(cudaStream_t stream, const unsigned long long* stamps, int prep_blocks, int rank_blocks,
                       bool expert);

}  // namespace jax_ep
