// Configurations that differ across ranks (docs/errors.md, its table). With one
// process per GPU every process compiles its own program, so one rank can
// call dispatch with another hidden size, dtype, token count or expert
// count than its peers; the window offsets they compute then disagree and
// rows would land in the wrong places. Each rank publishes what it called
// with in its own window header before the op's first barrier; after the
// barrier it compares with every LSA peer's record, before any row moves.
// On a difference it reports Cause::kConfigMismatch (detail: the peer) and
// leaves both records next to the status word (kStatusReportOffset), where
// the host reads them to name the values (comm.cc ConfigMismatchDetail).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "ep_copy.cuh"

namespace jax_ep {

// One rank's call: `tag` = the epoch of the op's first barrier (low 32
// bits), `op`, then the fields the peers must share.
struct OpConfig {
  uint32_t tag = 0, op = 0;
  uint32_t v[kOpConfigFields] = {};
};
static_assert(sizeof(OpConfig) == kOpConfigBytes, "OpConfig is the header slot's size");

__device__ __forceinline__ OpConfig* ConfigSlot(const EpPeers& p, int rank) {
  return reinterpret_cast<OpConfig*>(p.base[rank] + kOpConfigOffset);
}

// Thread 0, before the op's first barrier (whose release makes it visible).
// The tag goes last: a reader that sees the same tag before and after the
// fields saw one record (PeersShareConfig).
__device__ inline void PublishConfig(const EpPeers& p, OpConfig c) {
  c.tag = static_cast<uint32_t>(*p.epoch + 1);
  volatile uint32_t* dst = reinterpret_cast<volatile uint32_t*>(ConfigSlot(p, p.rank));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&c);
  for (int i = 1; i < static_cast<int>(sizeof(OpConfig) / 4); ++i) dst[i] = src[i];
  __threadfence();
  dst[0] = src[0];
}

// Thread 0, after the first barrier passed: false (reported) when an LSA
// peer called this op with other values, or is not in this op at all. A
// record already tagged for a later op (the peer ran ahead) proves nothing
// and is skipped.
__device__ inline bool PeersShareConfig(const EpPeers& p, Op op) {
  const OpConfig* mine = ConfigSlot(p, p.rank);
  const uint32_t tag = mine->tag;
  for (int j = 0; j < p.nranks; ++j) {
    if (j == p.rank || ((p.gin_mask >> j) & 1u)) continue;
    OpConfig theirs;
    const volatile uint32_t* src = reinterpret_cast<const volatile uint32_t*>(ConfigSlot(p, j));
    uint32_t* dst = reinterpret_cast<uint32_t*>(&theirs);
    for (int i = 0; i < static_cast<int>(sizeof(OpConfig) / 4); ++i) dst[i] = src[i];
    __threadfence();
    if (src[0] != theirs.tag) continue;  // rewritten while read: the peer ran ahead
    if (static_cast<int32_t>(theirs.tag - tag) > 0) continue;
    bool same = theirs.tag == tag && theirs.op == mine->op;
    for (int i = 0; i < kOpConfigFields; ++i) same &= theirs.v[i] == mine->v[i];
    if (same) continue;
    // The first error wins the status word; only its records are kept.
    if (!has_error(p)) {
      volatile uint32_t* report = reinterpret_cast<volatile uint32_t*>(
          reinterpret_cast<char*>(p.status) + kStatusReportOffset);
      const uint32_t* a = reinterpret_cast<const uint32_t*>(mine);
      const uint32_t* b = reinterpret_cast<const uint32_t*>(&theirs);
      for (int i = 0; i < static_cast<int>(sizeof(OpConfig) / 4); ++i) {
        report[i] = a[i];
        report[sizeof(OpConfig) / 4 + i] = b[i];
      }
      __threadfence_system();  // the records before the status word that points at them
    }
    report_error(p, op, Cause::kConfigMismatch, static_cast<uint32_t>(j));
    return false;
  }
  return true;
}

}  // namespace jax_ep
