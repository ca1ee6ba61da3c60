// Device-side rules an Engram fetch applies to each row index, shared by the
// LSA fetch (engram.cu) and the GIN path (engram_gin.cu) so both read the
// same rows.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "engram.cuh"

namespace jax_ep {

// The rank owning row `id` of a table of `rpr` rows per rank, by comparisons
// (nranks <= kMaxRanks) rather than a division.
__device__ __forceinline__ uint32_t EngramOwnerOf(uint32_t id, uint32_t rpr, int nranks) {
  uint32_t owner = 0;
#pragma unroll
  for (int r = 1; r < kMaxRanks; ++r) owner += (r < nranks && id >= r * rpr) ? 1u : 0u;
  return owner;
}

// Whether the fetch reads nothing (every index as -1): its token is not the
// area's live version. Version 0 means no live publication there, whatever
// the token says (a failed publish also leaves 0 in its token). The version
// word was written by an earlier kernel of this stream: a plain load, not
// the read-only path.
__device__ __forceinline__ bool EngramStale(const EngramFetchArgs& a) {
  if (a.token == nullptr) return false;
  const unsigned long long v = a.version == nullptr ? 0ull : *a.version;
  return v == 0 || static_cast<unsigned long long>(static_cast<uint32_t>(__ldg(a.token))) != v;
}

}  // namespace jax_ep
