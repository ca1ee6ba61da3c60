// Configurations that differ across ranks (docs/errors.md, its table). With one
// process per GPU every process compiles its own program, so one rank can
// call an op with another hidden size, dtype, token count or expert count
// than its peers; the window offsets they compute then disagree and rows
// would land in the wrong places. Each rank publishes what it called with
// (an OpConfig record) in its own window header. Ops with a barrier before
// any row moves (dispatch, the Engram publish) compare every LSA peer's
// record after it. Combine and the low-latency ops carry a 16-bit digest
// of the record in words every peer reads anyway (combine's ok words, the
// low-latency count and flag words): no barrier added, but a low-latency
// sender's rows have moved by the time its receiver sees the digest.
// On a difference the op reports Cause::kConfigMismatch (detail: the peer)
// and leaves both records next to the status word (kStatusReportOffset),
// where the host reads them to name the values (runtime/status.cc ConfigMismatchDetail).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "ep_copy.cuh"
#include "peer.cuh"

namespace jax_ep {

// One rank's call: `tag` = which call of the op (the epoch of its first
// barrier, or a low-latency sequence number; low 32 bits), `op`, then the
// fields the peers must share (unused ones 0; runtime/status.cc names them per op).
struct OpConfig {
  uint32_t tag = 0, op = 0;
  uint32_t v[kOpConfigFields] = {};
};
static_assert(sizeof(OpConfig) == kOpConfigBytes, "OpConfig is the header slot's size");

template <int N>
__device__ __forceinline__ OpConfig MakeOpConfig(Op op, const uint32_t (&fields)[N]) {
  static_assert(N <= kOpConfigFields, "more fields than the record holds");
  OpConfig c;
  c.op = static_cast<uint32_t>(op);
  for (int i = 0; i < N; ++i) c.v[i] = fields[i];
  return c;
}

__device__ __forceinline__ bool SameFields(const OpConfig& a, const OpConfig& b) {
  bool same = true;
  for (int i = 0; i < kOpConfigFields; ++i) same &= a.v[i] == b.v[i];
  return same;
}

// A record whose fields are all this: the rank refused the call tagged
// (abort.h, the low-latency ops).
constexpr uint32_t kRefusedField = 0xffffffffu;

__device__ __forceinline__ OpConfig RefusedConfig(Op op) {
  OpConfig c;
  c.op = static_cast<uint32_t>(op);
  for (int i = 0; i < kOpConfigFields; ++i) c.v[i] = kRefusedField;
  return c;
}

__device__ __forceinline__ bool IsRefused(const OpConfig& c) {
  bool all = true;
  for (int i = 0; i < kOpConfigFields; ++i) all &= c.v[i] == kRefusedField;
  return all;
}

// 16 bits of the record's op and fields (FNV-1a), never 0. Ops that cannot
// afford the barrier the record comparison needs carry it in words the
// peers read anyway (combine's ok words, the low-latency count and flag
// words); two configurations collide with probability 2^-16.
__device__ __forceinline__ uint32_t ConfigDigest(const OpConfig& c) {
  uint32_t h = 2166136261u;
  auto mix = [&h](uint32_t x) {
    for (int b = 0; b < 4; ++b) h = (h ^ ((x >> (8 * b)) & 0xffu)) * 16777619u;
  };
  mix(c.op);
  for (int i = 0; i < kOpConfigFields; ++i) mix(c.v[i]);
  const uint32_t d = (h ^ (h >> 16)) & 0xffffu;
  return d == 0 ? 1u : d;
}

// Dispatch's and combine's "format" field: payload bytes per element, FP8
// (payload + scales), expert layout.
__device__ __forceinline__ uint32_t FormatWord(uint32_t elem_bytes, bool fp8, bool expert) {
  return elem_bytes | (static_cast<uint32_t>(fp8) << 8) | (static_cast<uint32_t>(expert) << 16);
}

__device__ __forceinline__ OpConfig* ConfigSlot(const EpPeers& p, int rank) {
  return reinterpret_cast<OpConfig*>(PeerWindow(p, rank) + kOpConfigOffset);
}

// Thread 0, before the op's first barrier (whose release makes it visible)
// or before the words that carry its digest. The tag goes last: a reader
// that sees the same tag before and after the fields saw one record.
__device__ inline void PublishConfig(const EpPeers& p, OpConfig c, uint32_t tag) {
  c.tag = tag;
  volatile uint32_t* dst = reinterpret_cast<volatile uint32_t*>(ConfigSlot(p, p.rank));
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&c);
  for (int i = 1; i < static_cast<int>(sizeof(OpConfig) / 4); ++i) dst[i] = src[i];
  __threadfence_system();
  dst[0] = src[0];
}

// Rank j's record as it stands; `*torn` when it was rewritten while read
// (the peer ran ahead). A GIN peer's record is not mapped: all zeros.
__device__ inline OpConfig ReadConfig(const EpPeers& p, int j, bool* torn) {
  OpConfig theirs;
  *torn = false;
  if (PeerWindow(p, j) == nullptr) return theirs;
  const volatile uint32_t* src = reinterpret_cast<const volatile uint32_t*>(ConfigSlot(p, j));
  uint32_t* dst = reinterpret_cast<uint32_t*>(&theirs);
  for (int i = 0; i < static_cast<int>(sizeof(OpConfig) / 4); ++i) dst[i] = src[i];
  __threadfence();
  *torn = src[0] != theirs.tag;
  return theirs;
}

// Reports Cause::kConfigMismatch against peer j, leaving both records next
// to the status word for the host's message. The first error wins the
// status word; only its records are kept.
__device__ inline void ReportConfigMismatch(const EpPeers& p, Op op, int j, const OpConfig& mine,
                                            const OpConfig& theirs) {
  if (!has_error(p)) {
    volatile uint32_t* report = reinterpret_cast<volatile uint32_t*>(
        reinterpret_cast<char*>(p.status) + kStatusReportOffset);
    const uint32_t* a = reinterpret_cast<const uint32_t*>(&mine);
    const uint32_t* b = reinterpret_cast<const uint32_t*>(&theirs);
    for (int i = 0; i < static_cast<int>(sizeof(OpConfig) / 4); ++i) {
      report[i] = a[i];
      report[sizeof(OpConfig) / 4 + i] = b[i];
    }
    __threadfence_system();  // the records before the status word that points at them
  }
  report_error(p, op, Cause::kConfigMismatch, static_cast<uint32_t>(j));
}

// Thread 0, after the first barrier passed: false (reported) when an LSA
// peer called this op with other values, or is not in this op at all. A
// record already tagged for a later op (the peer ran ahead) proves nothing
// and is skipped.
__device__ inline bool PeersShareConfig(const EpPeers& p, Op op) {
  const OpConfig* mine = ConfigSlot(p, p.rank);
  const uint32_t tag = mine->tag;
  for (int j = 0; j < p.nranks; ++j) {
    if (j == p.rank || ReachedByGin(p, j)) continue;
    bool torn = false;
    const OpConfig theirs = ReadConfig(p, j, &torn);
    if (torn || static_cast<int32_t>(theirs.tag - tag) > 0) continue;
    if (theirs.tag == tag && theirs.op == mine->op && SameFields(theirs, *mine)) continue;
    ReportConfigMismatch(p, op, j, *mine, theirs);
    return false;
  }
  return true;
}

}  // namespace jax_ep
