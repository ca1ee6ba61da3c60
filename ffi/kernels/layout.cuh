// get_dispatch_layout on the device: per-rank and per-expert token counts,
// the token→rank membership matrix, and each token's position among this
// rank's tokens bound for a rank (the row order of the rank-layout dispatch).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common.cuh"

namespace jax_ep {

// Ranks the layout kernel can handle (one bit per rank in a 32-bit mask).
constexpr int kLayoutMaxRanks = 32;

struct LayoutArgs {
  const int32_t* topk_idx;        // [T, K]
  int num_tokens;                 // T (may be 0)
  int topk;                       // K
  int num_experts;                // E, E % R == 0
  int num_ranks;                  // R <= kLayoutMaxRanks
  int32_t* num_tokens_per_rank;   // [R]
  int32_t* num_tokens_per_expert; // [E]
  bool* is_token_in_rank;         // [T, R]
  int32_t* pos_in_rank;           // [T, R], -1 where the token does not go
};

// Shared memory the launch needs (per-expert histogram + scan scratch); the
// caller checks it against the device limit.
size_t DispatchLayoutSmemBytes(int num_experts);

// Enqueues the layout on `stream`. An expert id outside [-1, E) is reported
// through `peers.status` (Op::kLayout, Cause::kBadExpertId) and contributes
// nothing; the token's other ids still count.
cudaError_t LaunchDispatchLayout(const LayoutArgs& args, const EpPeers& peers,
                                 cudaStream_t stream);

}  // namespace jax_ep
