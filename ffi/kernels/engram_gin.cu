// Engram fetch where some owner is reached by GIN (engram.cuh): its window
// is not mapped here, so its rows cannot be loaded. Instead, per fetch:
//
//   request   this rank sorts its row ids by owner and puts each GIN owner
//             the local ids it wants (request channel), with a control word
//             (sequence, count, n) that the put's signal vouches for;
//   exchange  for each GIN peer: wait for its request, copy the rows it asked
//             for out of this rank's shard into a stage and put them back
//             (response channel); then wait for every peer's answer;
//   gather    rows [T, e] from the answers (GIN owners) and by plain loads
//             (LSA owners, this rank included), as engram.cu does.
//
// Every fetch sends exactly one request and one answer to each GIN peer,
// also when it fails (a stale publication asks for nothing, a refused or
// timed-out request is answered with a failure flag), so that the signal
// counts always equal the device's fetch sequence (kEngramGinSeqCounter).
// A rank that refuses the call stands in for it (LaunchEngramGinRefusal).
// Scratch and words: engram_layout.h EngramGinArea, kEngramGinWordsOffset.
#include "abort.h"
#include "config_check.cuh"
#include "engram.cuh"
#include "engram_rows.cuh"
#include "ep_copy.cuh"
#include "kernel_load.h"
#include "peer.cuh"

#include <algorithm>

namespace jax_ep {
namespace {

constexpr int kRequestThreads = 1024;
constexpr int kExchangeThreads = 512;
constexpr int kGatherThreads = 1024;
constexpr int kGatherMaxBlocks = 64;
constexpr int kGatherUnroll = 4;
constexpr Op kOp = Op::kEngramFetch;

// Flags in the value half of a control word's first u64; the count below.
constexpr uint32_t kRefusedFlag = 1u << 31;  // the sender refused the call (abort.h)
constexpr uint32_t kFailedFlag = 1u << 30;   // the owner could not serve (its error says why)
constexpr uint32_t kCountMask = kFailedFlag - 1;

__device__ __forceinline__ uint64_t* Word(const EpPeers& p, EngramGinWord kind, int rank) {
  return reinterpret_cast<uint64_t*>(MyWindow(p) + EngramGinWordOff(kind, rank));
}

// What both sides of an exchange must agree on besides the sequence: the
// rows per fetch (the scratch's slot sizes) and the row bytes.
__device__ __forceinline__ uint64_t Shape(const EngramFetchArgs& a) {
  return (static_cast<uint64_t>(a.row_bytes) << 32) | static_cast<uint64_t>(a.num_rows);
}

// Puts `bytes` (may be 0) of this rank's window at `src` to peer j's `dst`
// without a signal, then this rank's staged control word `out`[j] to j's
// `in`[my rank] with a signal on `channel`: both go through the channel's
// context, so the signal vouches for the bytes too. One thread, after the
// bytes are written and synchronised with.
__device__ inline void SendWithWord(const EpPeers& p, Op op, int j, size_t dst, size_t src,
                                    size_t bytes, EngramGinWord out, EngramGinWord in, uint64_t w0,
                                    uint64_t w1, int channel) {
  uint64_t* word = Word(p, out, j);
  StU64Volatile(word, w0);
  StU64Volatile(word + 1, w1);
  __threadfence();
  if (bytes > 0) PutBytes(p, op, j, dst, src, bytes, channel, false);
  PutBytes(p, op, j, EngramGinWordOff(in, p.rank), EngramGinWordOff(out, j), kEngramGinWordBytes, channel,
           true);
}

__device__ inline void ReportShapeMismatch(const EpPeers& p, const EngramFetchArgs& a, int j,
                                           uint64_t seq, uint64_t their_w0, uint64_t their_shape) {
  const uint32_t mine_v[] = {static_cast<uint32_t>(a.rows_per_rank), static_cast<uint32_t>(a.row_bytes),
                             static_cast<uint32_t>(a.table_off / 16), static_cast<uint32_t>(a.num_rows)};
  const uint32_t their_v[] = {static_cast<uint32_t>(a.rows_per_rank), static_cast<uint32_t>(their_shape >> 32),
                              static_cast<uint32_t>(a.table_off / 16), static_cast<uint32_t>(their_shape)};
  OpConfig mine = MakeOpConfig(kOp, mine_v), theirs = MakeOpConfig(kOp, their_v);
  mine.tag = static_cast<uint32_t>(seq);
  theirs.tag = static_cast<uint32_t>(their_w0 >> 32);
  ReportConfigMismatch(p, kOp, j, mine, theirs);
}

// One CTA: the requests, sorted by owner with shared counters (the order
// inside an owner's list does not matter: `pos` says where each row comes
// back), then one put per GIN owner.
__global__ void __launch_bounds__(kRequestThreads)
    EngramGinRequestKernel(const __grid_constant__ EngramFetchArgs a,
                           const __grid_constant__ EngramGinFetchArgs g, const __grid_constant__ EpPeers p) {
  __shared__ uint32_t s_count[kMaxRanks];
  __shared__ bool s_gin[kMaxRanks];
  if (threadIdx.x < kMaxRanks) {
    s_count[threadIdx.x] = 0;
    s_gin[threadIdx.x] = static_cast<int>(threadIdx.x) < p.nranks && ReachedByGin(p, threadIdx.x);
  }
  __syncthreads();
  const EngramGinArea& area = g.area;
  const bool stale = EngramStale(a);
  const uint32_t rpr = static_cast<uint32_t>(a.rows_per_rank);
  const uint32_t V = rpr * static_cast<uint32_t>(p.nranks);
  const uint32_t n = static_cast<uint32_t>(a.num_rows);
  uint32_t* pos = reinterpret_cast<uint32_t*>(MyWindow(p) + area.pos());
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t id = stale ? -1 : __ldg(a.indices + i);
    uint32_t at = 0xffffffffu;
    if (id >= 0 && static_cast<uint32_t>(id) < V) {
      const int o = static_cast<int>(EngramOwnerOf(static_cast<uint32_t>(id), rpr, p.nranks));
      if (s_gin[o]) {
        at = atomicAdd(&s_count[o], 1u);
        reinterpret_cast<uint32_t*>(MyWindow(p) + area.req_out(o))[at] = static_cast<uint32_t>(id) - o * rpr;
      }
    }
    pos[i] = at;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const uint64_t seq = g.counters[kEngramGinSeqCounter] + 1;
  g.counters[kEngramGinSeqCounter] = seq;
  for (int o = 0; o < p.nranks; ++o) {
    if (!s_gin[o]) continue;
    // Whole 16-byte units (the slot has room: 256-byte multiples), which
    // the emulated put copies as vectors.
    SendWithWord(p, kOp, o, area.req_in(p.rank), area.req_out(o), 16 * ((static_cast<size_t>(s_count[o]) + 3) / 4),
                 EngramGinWord::kReqOut, EngramGinWord::kReqIn, MakeTagged(seq, s_count[o]), Shape(a),
                 kGinEngramRequestChannel);
  }
  // The staged ids and words are rewritten by the next fetch.
  FlushPeers(p, 1u << kGinEngramRequestChannel);
}

// Peer j's request: its count once it arrived and agrees, else 0 with
// kFailedFlag (reported). Thread 0 of the exchange CTA, after warp 0's wait.
__device__ uint32_t ReadRequest(const EpPeers& p, const EngramFetchArgs& a, int j, uint64_t seq,
                                bool arrived) {
  if (!arrived) return kFailedFlag;
  const uint64_t* w = Word(p, EngramGinWord::kReqIn, j);
  const uint64_t w0 = LdU64Volatile(w), w1 = LdU64Volatile(w + 1);
  const uint32_t v = static_cast<uint32_t>(w0);
  if (v & kRefusedFlag) {
    report_error(p, kOp, Cause::kPeerRefused, static_cast<uint32_t>(j));
    return kFailedFlag;
  }
  if (!TagMatches(w0, seq) || w1 != Shape(a) || (v & kCountMask) > a.num_rows) {
    ReportShapeMismatch(p, a, j, seq, w0, w1);
    return kFailedFlag;
  }
  return v & kCountMask;
}

// CTA b serves peers b, b + gridDim.x, ... and then waits for their answers.
// Serving waits only for requests, which no rank holds back, so no CTA
// waits for another that waits in turn.
__global__ void __launch_bounds__(kExchangeThreads)
    EngramGinExchangeKernel(const __grid_constant__ EngramFetchArgs a,
                           const __grid_constant__ EngramGinFetchArgs g, const __grid_constant__ EpPeers p) {
  __shared__ uint32_t s_req;
  const EngramGinArea& area = g.area;
  const uint64_t seq = g.counters[kEngramGinSeqCounter];  // the request kernel's
  const unsigned long long t0 = globaltimer_ns();
  const uint32_t vpr = static_cast<uint32_t>(a.row_bytes / 16);
  const uint32_t rpr = static_cast<uint32_t>(a.rows_per_rank);
  const char* table = MyWindow(p) + a.table_off;
  for (int j = blockIdx.x; j < p.nranks; j += gridDim.x) {
    if (j == p.rank || !ReachedByGin(p, j)) continue;
    if (threadIdx.x < 32) {
      const bool arrived = WaitPeerSignalWarp(p, kOp, j, kGinEngramRequestChannel, seq, t0);
      if (threadIdx.x == 0) s_req = ReadRequest(p, a, j, seq, arrived);
    }
    __syncthreads();
    const uint32_t req = s_req;
    const uint32_t count = req & kCountMask;
    const uint32_t* ids = reinterpret_cast<const uint32_t*>(MyWindow(p) + area.req_in(j));
    uint4* stage = reinterpret_cast<uint4*>(MyWindow(p) + area.resp_out(j));
    bool bad = false;
    for (uint32_t q = threadIdx.x; q < count * vpr; q += blockDim.x) {
      const uint32_t row = q / vpr;
      const uint32_t local = __ldcg(ids + row);
      uint4 v = make_uint4(0, 0, 0, 0);
      if (local < rpr) {
        v = *(reinterpret_cast<const uint4*>(table + static_cast<size_t>(local) * a.row_bytes) + (q - row * vpr));
      } else {
        bad = true;
      }
      stage[q] = v;
    }
    // A row id past the shard can only come from a corrupted request.
    const bool any_bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
      uint32_t flags = req & kFailedFlag;
      if (any_bad) {
        report_error(p, kOp, Cause::kBadIndex);
        flags = kFailedFlag;
      }
      SendWithWord(p, kOp, j, area.resp_in(p.rank), area.resp_out(j), static_cast<size_t>(count) * a.row_bytes,
                   EngramGinWord::kRespOut, EngramGinWord::kRespIn, MakeTagged(seq, count | flags),
                   Shape(a), kGinEngramResponseChannel);
      FlushPeers(p, 1u << kGinEngramResponseChannel);
    }
    __syncthreads();  // s_req and the stage are reused for the next peer
  }
  if (threadIdx.x >= 32) return;
  for (int j = blockIdx.x; j < p.nranks; j += gridDim.x) {
    if (j == p.rank || !ReachedByGin(p, j)) continue;
    // The gather checks the answer's word (a failed wait leaves it stale).
    WaitPeerSignalWarp(p, kOp, j, kGinEngramResponseChannel, seq, t0);
  }
}

// Where owner o's rows are read from: 0 its window (LSA, by local row),
// 1 its answer in this window (GIN, by pos), 2 nowhere (its answer failed:
// zeros; reported by block 0).
__device__ int AnswerMode(const EpPeers& p, const EngramFetchArgs& a, int o, uint64_t seq, bool report) {
  if (!ReachedByGin(p, o)) return 0;
  const uint64_t* w = Word(p, EngramGinWord::kRespIn, o);
  const uint64_t w0 = LdU64Volatile(w), w1 = LdU64Volatile(w + 1);
  const uint32_t v = static_cast<uint32_t>(w0);
  const uint64_t asked = LdU64Volatile(Word(p, EngramGinWord::kReqOut, o));
  if (TagMatches(w0, seq) && (v & (kRefusedFlag | kFailedFlag)) == 0 && w1 == Shape(a) &&
      (v & kCountMask) == static_cast<uint32_t>(asked)) {
    return 1;
  }
  if (report) {
    if (v & kRefusedFlag) report_error(p, kOp, Cause::kPeerRefused, static_cast<uint32_t>(o));
    else if (!TagMatches(w0, seq) || w1 != Shape(a)) ReportShapeMismatch(p, a, o, seq, w0, w1);
    else report_error(p, kOp, Cause::kPeerTimeout, 0x80u | static_cast<uint32_t>(o));
  }
  return 2;
}

template <bool kVec>
__global__ void __launch_bounds__(kGatherThreads)
    EngramGinGatherKernel(const __grid_constant__ EngramFetchArgs a,
                           const __grid_constant__ EngramGinFetchArgs g, const __grid_constant__ EpPeers p) {
  __shared__ const char* s_src[kMaxRanks];
  __shared__ int s_mode[kMaxRanks];
  const uint64_t seq = g.counters[kEngramGinSeqCounter];
  if (static_cast<int>(threadIdx.x) < p.nranks) {
    const int o = threadIdx.x;
    const int mode = AnswerMode(p, a, o, seq, blockIdx.x == 0);
    s_mode[o] = mode;
    s_src[o] = mode == 0 ? PeerWindow(p, o) + a.table_off : MyWindow(p) + g.area.resp_in(o);
  }
  __syncthreads();
  const bool stale = EngramStale(a);
  const uint32_t* pos = reinterpret_cast<const uint32_t*>(MyWindow(p) + g.area.pos());
  const uint32_t rb = static_cast<uint32_t>(a.row_bytes);
  const uint32_t unit = kVec ? 16u : 1u;
  const uint32_t per_row = rb / unit;
  const uint32_t total = static_cast<uint32_t>(a.num_rows) * per_row;
  const uint32_t rpr = static_cast<uint32_t>(a.rows_per_rank);
  const uint32_t V = rpr * static_cast<uint32_t>(p.nranks);
  const uint32_t stride = gridDim.x * blockDim.x;
  constexpr int kUnroll = kVec ? kGatherUnroll : 1;
  bool bad = false;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * kUnroll) {
    // Every index load of the pass before any row load (engram.cu).
    int32_t idx[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t q = base + u * stride;
      idx[u] = stale || q >= total ? -1 : __ldg(a.indices + q / per_row);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t q = base + u * stride;
      if (q >= total) continue;
      const uint32_t row = q / per_row;
      const uint32_t off = (q - row * per_row) * unit;
      const int32_t id = idx[u];
      const char* src = nullptr;
      if (id >= 0 && static_cast<uint32_t>(id) < V) {
        const int o = static_cast<int>(EngramOwnerOf(static_cast<uint32_t>(id), rpr, p.nranks));
        const int mode = s_mode[o];
        if (mode == 0) src = s_src[o] + static_cast<size_t>(static_cast<uint32_t>(id) - o * rpr) * rb + off;
        else if (mode == 1) src = s_src[o] + static_cast<size_t>(__ldcg(pos + row)) * rb + off;
      } else if (id != -1) {
        bad = true;
      }
      if constexpr (kVec) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (src != nullptr) v = __ldcg(reinterpret_cast<const uint4*>(src));
        StNa(static_cast<uint4*>(a.out) + q, v);
      } else {
        static_cast<char*>(a.out)[q] = src != nullptr ? *reinterpret_cast<const volatile char*>(src) : 0;
      }
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) report_error(p, kOp, Cause::kBadIndex);
  if (stale && blockIdx.x == 0 && threadIdx.x == 0) report_error(p, kOp, Cause::kStalePublication);
}

// The refused call's stand-in for the exchange (LaunchEngramGinRefusal).
__global__ void EngramGinRefusalKernel(const __grid_constant__ EpPeers p, unsigned long long* counters) {
  if (threadIdx.x != 0) return;
  const uint64_t seq = counters[kEngramGinSeqCounter] + 1;
  counters[kEngramGinSeqCounter] = seq;
  for (int j = 0; j < p.nranks; ++j) {
    if (j == p.rank || !ReachedByGin(p, j)) continue;
    SendWithWord(p, Op::kNone, j, 0, 0, 0, EngramGinWord::kReqOut, EngramGinWord::kReqIn,
                 MakeTagged(seq, kRefusedFlag), 0, kGinEngramRequestChannel);
    SendWithWord(p, Op::kNone, j, 0, 0, 0, EngramGinWord::kRespOut, EngramGinWord::kRespIn,
                 MakeTagged(seq, kRefusedFlag), 0, kGinEngramResponseChannel);
  }
  FlushPeers(p, (1u << kGinEngramRequestChannel) | (1u << kGinEngramResponseChannel));
}

}  // namespace

cudaError_t LoadEngramGinKernels() {
  return LoadEach(EngramGinRequestKernel, EngramGinExchangeKernel, EngramGinGatherKernel<true>,
                  EngramGinGatherKernel<false>, EngramGinRefusalKernel);
}

cudaError_t LaunchEngramGinFetch(const EngramFetchArgs& a, const EngramGinFetchArgs& g,
                                 const EpPeers& p, cudaStream_t stream) {
  if (a.num_rows == 0 || a.row_bytes == 0) return cudaSuccess;
  // The handler (or the harness) fills these whenever a peer is on GIN.
  if (g.counters == nullptr || g.area.nranks != p.nranks) return cudaErrorInvalidValue;
  const bool vec = a.row_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(a.out) % 16) == 0 &&
                   a.table_off % 16 == 0;
  const int cap = a.num_sms > 0 ? a.num_sms : kGatherMaxBlocks;
  EngramGinRequestKernel<<<1, kRequestThreads, 0, stream>>>(a, g, p);
  EngramGinExchangeKernel<<<std::min(cap, p.nranks), kExchangeThreads, 0, stream>>>(a, g, p);
  const uint64_t items = static_cast<uint64_t>(a.num_rows) * (vec ? a.row_bytes / 16 : a.row_bytes);
  const uint64_t per_block = static_cast<uint64_t>(kGatherThreads) * (vec ? kGatherUnroll : 1);
  const int blocks = static_cast<int>(std::max<uint64_t>(
      1, std::min<uint64_t>(static_cast<uint64_t>(cap), (items + per_block - 1) / per_block)));
  if (vec) EngramGinGatherKernel<true><<<blocks, kGatherThreads, 0, stream>>>(a, g, p);
  else EngramGinGatherKernel<false><<<blocks, kGatherThreads, 0, stream>>>(a, g, p);
  return cudaGetLastError();
}

cudaError_t LaunchEngramGinRefusal(const EpPeers& p, unsigned long long* counters,
                                   cudaStream_t stream) {
  if (p.nranks <= 1 || counters == nullptr || !AnyGinPeer(p)) return cudaSuccess;
  EngramGinRefusalKernel<<<1, 32, 0, stream>>>(p, counters);
  return cudaGetLastError();
}

}  // namespace jax_ep
