// Engram on LSA: publish a rank's table shard into its symmetric window
// (engram_layout.h), then fetch rows [T, e] from every rank's window with
// plain NVLink loads. Semantics: jax_ep/reference.py engram_fetch_start /
// engram_fetch_wait (pure data movement, so bitwise equal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "common.cuh"

namespace jax_ep {

struct EngramPublishArgs {
  const void* table = nullptr;  // [rows_per_rank, D] local shard, row_bytes each
  size_t table_bytes = 0;
  size_t table_off = 0;         // EngramWindow::table_off
  int32_t* token = nullptr;     // [1]: `version` when the publish completed, 0 otherwise
  int32_t version = 1;          // EngramVersions::Publish of this area
};

struct EngramFetchArgs {
  const int32_t* indices = nullptr;  // [n] global row ids in [-1, V)
  int64_t num_rows = 0;              // n = T * e
  int64_t rows_per_rank = 0;         // V / R
  size_t row_bytes = 0;              // multiple of 16
  size_t table_off = 0;
  void* out = nullptr;               // [n, row_bytes]
  int num_sms = 0;                   // CTAs; 0 = the model's choice
  // The publish token this fetch reads and the version current at launch
  // (EngramVersions::Current); null token: no check (publish + fetch in one
  // call).
  const int32_t* token = nullptr;
  int32_t version = 0;
};

// barrier (nobody still reads the old table) -> copy -> barrier (every shard
// in place) -> token. A barrier timeout goes to the status word and skips the
// copy.
cudaError_t LaunchEngramPublish(const EngramPublishArgs& a, const EpPeers& p, cudaStream_t stream);

// No barrier: the publish that produced the token already ordered everything.
// An index outside [-1, V) gives a zero row and Op::kEngramFetch /
// Cause::kBadIndex in the status word; a token other than `version` gives
// zero rows and Cause::kStalePublication.
cudaError_t LaunchEngramFetch(const EngramFetchArgs& a, const EpPeers& p, cudaStream_t stream);

}  // namespace jax_ep
