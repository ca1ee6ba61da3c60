// probe_all_to_all: the smallest op that exercises the whole communicator
// (LSA peer stores into symmetric windows + ncclDevComm LSA barriers).
#pragma once

#include <cstddef>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "kernels/common.cuh"

namespace jax_ep {

struct ProbeArgs {
  const char* x;     // [R, row_bytes]: row j goes to rank j
  char* out;         // [R, row_bytes]: row s came from rank s
  size_t row_bytes;
};

// Window bytes the probe needs (header + one 16-byte aligned slot per rank).
size_t ProbeWindowBytes(size_t row_bytes, int nranks);

// Number of CTAs the probe launches; identical on every rank for the same
// shape, as each CTA pairs with the same-index CTA (barrier index) on peers.
int ProbeNumBlocks(size_t row_bytes);

cudaError_t LaunchProbeAllToAll(const ProbeArgs& args, const ncclDevComm& devcomm,
                                const EpPeers& peers, cudaStream_t stream);

}  // namespace jax_ep
