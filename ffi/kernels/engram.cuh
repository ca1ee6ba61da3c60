// Engram: publish a rank's table shard into its symmetric window
// (engram_layout.h), then fetch rows [T, e] from every rank's window: plain
// NVLink loads from LSA owners (engram.cu), a request / serve exchange with
// GIN owners (engram_gin.cu). Semantics: jax_ep/reference.py
// engram_fetch_start / engram_fetch_wait (pure data movement, so bitwise
// equal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "common.cuh"
#include "engram_layout.h"

namespace jax_ep {

// Table placements with a version word of their own per device
// (engram_versions.h). The words: u64 [1 + kEngramSlots] in the device's
// counters (comm.h): [0] the last version drawn, [1 + s] the version of the
// live publication in slot s (0: none).
constexpr int kEngramSlots = 256;

// Device counter (comm.h) of the GIN exchange: fetches on this device that
// went through it, so every signal of it has a known expected count.
constexpr int kEngramGinSeqCounter = 60;

struct EngramSlotMask {
  uint64_t bits[kEngramSlots / 64] = {};
  void Set(int s) { bits[s / 64] |= uint64_t{1} << (s % 64); }
  bool Any() const {
    for (uint64_t b : bits)
      if (b) return true;
    return false;
  }
};

struct EngramPublishArgs {
  const void* table = nullptr;  // [rows_per_rank, D] local shard, row_bytes each
  size_t table_bytes = 0;
  size_t table_off = 0;         // EngramWindow::table_off
  int64_t rows_per_rank = 0;    // what every rank must publish alike (config_check.cuh)
  size_t row_bytes = 0;
  int32_t* token = nullptr;     // [1]: the new version when the publish completed, 0 otherwise
  unsigned long long* versions = nullptr;  // the version words (above)
  int slot = 0;                 // EngramVersions::Publish of this area
  EngramSlotMask clear;         // the areas this copy overwrites, its own included
};

struct EngramFetchArgs {
  const int32_t* indices = nullptr;  // [n] global row ids in [-1, V)
  int64_t num_rows = 0;              // n = T * e
  int64_t rows_per_rank = 0;         // V / R
  size_t row_bytes = 0;              // multiple of 16
  size_t table_off = 0;
  void* out = nullptr;               // [n, row_bytes]
  int num_sms = 0;                   // CTAs; 0 = the model's choice
  // The publish token this fetch reads and its area's version word
  // (null: never published there); null token: no check (publish + fetch
  // in one call).
  const int32_t* token = nullptr;
  const unsigned long long* version = nullptr;
};

// What a fetch needs besides EngramFetchArgs where a peer is on GIN (kept
// apart so that the LSA kernel's parameters stay as they were).
struct EngramGinFetchArgs {
  unsigned long long* counters = nullptr;  // the device counters (kEngramGinSeqCounter)
  EngramGinArea area;                      // the exchange's scratch
};

// barrier (nobody still reads the old table; the overwritten areas' words
// cleared) -> copy -> barrier (every shard in place) -> a new version in the
// slot's word and the token. A barrier timeout goes to the status word; the
// token and the word then stay 0.
cudaError_t LaunchEngramPublish(const EngramPublishArgs& a, const EpPeers& p, cudaStream_t stream);
constexpr int kEngramPublishBarriers = 2;  // what a refusing rank stands in for (abort.h)

// No barrier: the publish that produced the token already ordered everything.
// An index outside [-1, V) gives a zero row and Op::kEngramFetch /
// Cause::kBadIndex in the status word; a token other than `version` gives
// zero rows and Cause::kStalePublication.
// `gin`: filled in whenever a peer is on GIN (then the GIN form runs).
cudaError_t LaunchEngramFetch(const EngramFetchArgs& a, const EpPeers& p, cudaStream_t stream,
                              const EngramGinFetchArgs& gin = {});

// The GIN form of LaunchEngramFetch (engram_gin.cu), which calls it when a
// peer is on GIN: a request kernel, an exchange kernel (serve every GIN
// peer, then wait for their answers) and a gather.
cudaError_t LaunchEngramGinFetch(const EngramFetchArgs& a, const EngramGinFetchArgs& g,
                                 const EpPeers& p, cudaStream_t stream);

// Clears the version words of the slots in `m` (their tables are about to
// be overwritten by another op); nothing is launched when `m` is empty.
cudaError_t LaunchEngramClear(const EngramSlotMask& m, unsigned long long* versions,
                              cudaStream_t stream);

}  // namespace jax_ep
