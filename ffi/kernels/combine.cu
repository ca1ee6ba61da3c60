// Normal (high-throughput) combine: the expert side pushes every row of
// another rank's token (and its weight) back into the source rank's window
// (through transport.cuh: LSA or GIN per peer), at a slot the source can
// find without any index exchange: rank layout [my rank][pos_in_rank],
// expert layout [token][k]. Rows of this rank's own tokens stay where they
// are: the reducers read them from y (docs/design.md §1). Reducers on the source wait per chunk of rows
// (window_layout.h) and sum each token's rows in the fixed order of docs/design.md §2
// (ascending destination rank, then local expert, then k) in f32 with
// __fmul_rn / __fadd_rn (never contracted to FMA), which is exactly
// jax_ep.reference.combine, while later chunks are still in flight.
//
// Why not pre-reduce on the expert side: the sequential f32 sum of a token
// crosses ranks (rank 1's rows are added onto rank 0's partial sum), so a
// partial sum per rank would round differently from the reference.
#include <algorithm>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bulk_copy.cuh"
#include "combine_reduce.cuh"
#include "config_check.cuh"
#include "ep_copy.cuh"
#include "transport.cuh"
#include "vec16.cuh"
#include "ep_kernels.h"
#include "kernel_load.h"
#include "launch_policy.h"
#include "peer.cuh"
#include "window_layout.h"

namespace jax_ep {
namespace {

// One block size for both roles of the data kernel: 32 warps, and the
// reducer keeps kReduceUnroll vectors of two rows in flight so it stays
// under 64 registers (combine_reduce.cuh). With bulk copies
// (bulk_copy.cuh): BulkWarpsFor warps.
constexpr int kThreads = 1024;
constexpr int kStartThreads = 1024;

struct CombineCfg {
  int T, H, K, E, C;
  int expert;
  int has_w;
  int gin_rows;     // > 0: some peer is on GIN; its rows are chunked by this many (gin_stage.cuh)
};

struct CombineIO {
  const void* y;
  const float* weights;
  const int32_t* topk;
  const int32_t* pos_in_rank;
  const int32_t* src_rank;
  const int32_t* src_token;
  const int32_t* src_k;
  const int32_t* recv_counts;
  void* out;
};


// What every rank must have called combine with (config_check.cuh): what
// the window rows and their slots follow from. Its digest rides in the ok
// word (CombineOkValue), so a difference stops every rank before any row
// moves without a barrier of its own.
__device__ __forceinline__ OpConfig CombineConfig(const CombineCfg& c, const CombineWindow& w) {
  const uint32_t elem = static_cast<uint32_t>(w.payload_bytes / static_cast<size_t>(c.H));
  const uint32_t v[] = {static_cast<uint32_t>(c.T), static_cast<uint32_t>(c.H), static_cast<uint32_t>(c.K),
                        static_cast<uint32_t>(c.E), FormatWord(elem, false, c.expert != 0)};
  return MakeOpConfig(Op::kCombine, v);
}
__device__ __forceinline__ uint32_t CombineOkValue(const OpConfig& cfg) {
  return (ConfigDigest(cfg) << 16) | 1u;
}

// Expert layout: the handle's rows are checked and counted by scanner
// blocks, CombineScan (up to kCombineScanBlocks blocks in one launch with the
// control block). A row of this rank's own token is not copied at all: its
// scanner leaves a note in the row's [t][k] slot trailer (LocalNote), and
// the reducers read the row straight from y.
constexpr int kCombineScanBlocks = 32;

// The trailer of slot [t][k] (16 bytes at weight_off): the row's weight, and
// for a row of this rank's own token its y row and the op's epoch (so a
// note left by an earlier op is never taken for this one's).
struct alignas(16) LocalNote {
  float weight;
  int32_t row;
  uint32_t tag;
  uint32_t unused;
};

__device__ __forceinline__ void CombineScan(const CombineCfg& c, const CombineWindow& w, const EpPeers& p,
                                            const CombineIO& io, int b, int blocks) {
  __shared__ int s_send[kMaxRanks];
  __shared__ int s_bad;
  const int R = p.nranks, r = p.rank;
  if (threadIdx.x < kMaxRanks) s_send[threadIdx.x] = 0;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  const uint32_t tag = static_cast<uint32_t>(*p.epoch + 1);  // the epoch this op's barrier uses
  char* const my = PeerWindow(p, r);
  const int per = (c.C + blocks - 1) / blocks;
  const int r0 = min(c.C, b * per), r1 = min(c.C, r0 + per);
  bool bad = false;
  for (int row = r0 + static_cast<int>(threadIdx.x); row < r1; row += blockDim.x) {
    const int s = io.src_rank[row];
    if (s < 0) continue;
    const int t = io.src_token[row], k = io.src_k[row];
    const bool wrong = s >= R || t < 0 || t >= c.T || k < 0 || k >= c.K;
    bad |= wrong;
    if (wrong) continue;
    atomicAdd(&s_send[s], 1);
    if (s == r) {
      LocalNote* note = reinterpret_cast<LocalNote*>(my + w.recv_off + (static_cast<size_t>(t) * c.K + k) * w.row_bytes +
                                                     w.weight_off);
      *note = LocalNote{c.has_w ? io.weights[row] : 1.f, row, tag, 0u};
    }
  }
  if (bad) s_bad = 1;
  __syncthreads();
  unsigned long long* ctr = p.epoch + kCombineScanCounters;
  if (threadIdx.x < R && s_send[threadIdx.x] != 0) atomicAdd(ctr + threadIdx.x, static_cast<unsigned long long>(s_send[threadIdx.x]));
  if (threadIdx.x == 0 && s_bad) atomicOr(ctr + kMaxRanks, 1ull);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p.epoch + kCombineScanDoneCounter, 1ull);
  }
}

// The control block: zero this op's counters, check that the handle
// describes a dispatch of this communicator (so the senders never meet a row
// they cannot place), tell every rank how many rows it will get from us,
// publish ok and pass the start barrier. After it every rank sees the same
// ok words, so either all send or none does; a receiver whose handle
// expects other row counts than announced (e.g. this rank's dispatch failed)
// drains what comes and reports instead of waiting for rows that never
// come. Expert layout: what the `scanners` blocks found (CombineScan).
__device__ __forceinline__ void CombineControl(const CombineCfg& c, const CombineWindow& w, const EpPeers& p,
                                               const CombineIO& io, int scanners) {
  __shared__ int s_bad;
  __shared__ int s_sum;
  __shared__ int s_send[kMaxRanks];
  const int R = p.nranks, r = p.rank;
  ZeroChunkCounters(p, NumChunks(c.T, ChunkRows(c.T)));
  GinSnapshotSignals(p, Op::kCombine);
  if (threadIdx.x == 0) {
    s_bad = 0;
    s_sum = 0;
  }
  if (threadIdx.x < kMaxRanks) s_send[threadIdx.x] = 0;
  __syncthreads();
  if (!c.expert) {
    if (threadIdx.x < R) {
      const int n = io.recv_counts[threadIdx.x];
      if (n < 0 || n > c.T) s_bad = 1;
      atomicAdd(&s_sum, n);
      if (static_cast<int>(threadIdx.x) != r) s_send[threadIdx.x] = n;
    }
  } else if (threadIdx.x == 0) {
    const bool waited = WaitBlocksDone(p, p.epoch + kCombineScanDoneCounter, scanners, Op::kCombine);
    volatile unsigned long long* ctr = p.epoch + kCombineScanCounters;
    for (int j = 0; j < R; ++j) {
      s_send[j] = static_cast<int>(ctr[j]);
      ctr[j] = 0;
    }
    s_bad = !waited || ctr[kMaxRanks] != 0;
    ctr[kMaxRanks] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool bad = s_bad != 0 || (!c.expert && s_sum > c.C);
    if (bad) report_error(p, Op::kCombine, Cause::kBadIndex);
    const uint64_t tag = *p.epoch + 1;  // the epoch the barrier below uses
    for (int j = 0; j < R; ++j) {
      const uint64_t word = MakeTagged(tag, bad ? 0u : static_cast<uint32_t>(s_send[j]));
      const size_t slot = w.sent_off + sizeof(uint64_t) * r;
      if (j == r) StU64Volatile(reinterpret_cast<uint64_t*>(PeerWindow(p, r) + slot), word);
      else PutControlWord(p, j, slot, w.sent_out_off + sizeof(uint64_t) * j, word, Op::kCombine);
    }
    OpConfig cfg = CombineConfig(c, w);
    cfg.tag = static_cast<uint32_t>(tag);
    const uint32_t ok_value = CombineOkValue(cfg);
    PublishConfig(p, cfg, cfg.tag);
    PublishOkAndBarrier(p, w.ok_off, !bad && !has_error(p), ok_value, Op::kCombine);
    // Every rank sees the same ok words, so a peer that failed or called
    // with another configuration stops every rank's sends (CombineData);
    // each names it here rather than returning zeros unexplained. (A word
    // of another epoch: the barrier failed and reported already.)
    const uint64_t* oks = reinterpret_cast<const uint64_t*>(PeerWindow(p, r) + w.ok_off);
    for (int j = 0; j < R && !bad; ++j) {
      const uint64_t word = LdU64Volatile(oks + j);
      if (j == r || !TagMatches(word, *p.epoch)) continue;
      const uint32_t v = static_cast<uint32_t>(word);
      if (v == 0u) {
        report_error(p, Op::kCombine, Cause::kPeerTimeout, 0x80u | static_cast<uint32_t>(j));
      } else if (v != ok_value) {
        bool torn = false;
        ReportConfigMismatch(p, Op::kCombine, j, cfg, ReadConfig(p, j, &torn));
      }
      if (v != ok_value) break;
    }
  }
}

__global__ void __launch_bounds__(kStartThreads) CombineStartKernel(CombineCfg c, CombineWindow w,
                                                                     EpPeers p, CombineIO io) {
  if (blockIdx.x == 0) CombineControl(c, w, p, io, static_cast<int>(gridDim.x) - 1);
  else CombineScan(c, w, p, io, static_cast<int>(blockIdx.x) - 1, static_cast<int>(gridDim.x) - 1);
}

// y row `row` and its weight into the window row `dst_row` (a peer's slot,
// or this rank's staging area for a GIN source). The caller counts it
// (kBulk: once the row's bulk group has written it).
template <bool kBulk>
__device__ __forceinline__ void SendCombineRow(const CombineCfg& c, const CombineWindow& w,
                                               const CombineIO& io, char* dst_row, int row,
                                               BulkSlots& bulk) {
  const int lane = LaneId();
  const int nvec = static_cast<int>(w.payload_bytes / 16);
  if (lane == 0) *reinterpret_cast<float*>(dst_row + w.weight_off) = c.has_w ? io.weights[row] : 1.f;
  const char* yrow = static_cast<const char*>(io.y) + static_cast<size_t>(row) * w.payload_bytes;
  if constexpr (kBulk) {
    const uint32_t nb = static_cast<uint32_t>(w.payload_bytes);
    const int slot = bulk.Load(yrow, nb);
    bulk.Wait(slot);
    bulk.Store(slot, dst_row, nb);
    bulk.Commit();
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(yrow);
  for (int base = 0; base < nvec; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int idx = base + u * 32 + lane;
      if (idx < nvec) v[u] = LdNcNa(src + idx);
    }
    StoreChunk(reinterpret_cast<uint4*>(dst_row), base, nvec, lane, v);
  }
}

// One kernel, two roles (as dispatch's data kernel):
//  - CTAs [0, S) send every y row that belongs to another rank's token (and,
//    in expert layout, this rank's own too) into the source's window slot
//    (rank layout [me][pos], expert layout [t][k]), each counted on the
//    source's chunk counter (chunk of pos, resp. of t).
//  - CTAs [S, S + Q) reduce this rank's tokens in ascending order: each
//    waits for the chunks its rows are in, then sums them in the fixed
//    order of docs/design.md §2 (ascending rank, then local expert, then k) with
//    __fmul_rn / __fadd_rn, exactly jax_ep.reference.combine. In rank
//    layout a token's own-rank row is read straight from y.
template <typename TY, bool kHasW, int kThreads, bool kBulk>
__device__ __forceinline__ void CombineData(const CombineCfg& c, const CombineWindow& w, const EpPeers& p,
                                            const CombineIO& io, int send_blocks, BulkSlots& bulk,
                                            uint32_t piece) {
  __shared__ int s_prefix[kMaxRanks + 1];
  __shared__ int s_sent[kMaxRanks];       // rows my handle expects from rank j
  __shared__ int s_announced[kMaxRanks];  // rows rank j said it sends me
  __shared__ int s_ok;
  __shared__ int s_sends[kMaxRanks];      // rows this rank sends to rank j
  const int R = p.nranks, r = p.rank;
  const int lane = LaneId();
  constexpr int kWarps = kThreads / 32;
  const bool sender = static_cast<int>(blockIdx.x) < send_blocks;
  if (threadIdx.x < kMaxRanks) s_sent[threadIdx.x] = 0;
  if (threadIdx.x == 0) {
    s_ok = FirstPeerNotOk(p, w.ok_off, CombineOkValue(CombineConfig(c, w))) < 0;
    const uint64_t* sent = reinterpret_cast<const uint64_t*>(PeerWindow(p, r) + w.sent_off);
    for (int j = 0; j < R; ++j) {
      const uint64_t word = LdU64Volatile(sent + j);
      // A peer that passed the barrier has announced for this epoch.
      s_announced[j] = TagMatches(word, *p.epoch) ? static_cast<int>(word & 0xffffffffull) : -1;
    }
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      s_prefix[s] = acc;
      acc += io.recv_counts[s];
    }
    s_prefix[R] = acc;
    for (int j = 0; j < R; ++j) s_sends[j] = s_ok ? s_prefix[j + 1] - s_prefix[j] : 0;
  }
  __syncthreads();
  const bool ok = s_ok != 0;  // the same on every rank (start kernel)
  const int chunk = ChunkRows(c.T);  // of the source's positions (rank) / tokens (expert)
  char* const lane_base = PeerWindow(p, lane < R ? lane : 0);  // null for a GIN peer
  char* const my = PeerWindow(p, r);
  const PeerTransport tr{p, my, chunk, {w.stage_off, w.recv_off, w.row_bytes, c.T, c.gin_rows}};

  if (!ok) {
    // Nobody sends: every output token gets zeros (and an error is reported).
    if (!sender) {
      const int nvec = static_cast<int>(w.payload_bytes / 16);
      for (int t = static_cast<int>(blockIdx.x - send_blocks) * kWarps + (threadIdx.x >> 5); t < c.T;
           t += (gridDim.x - send_blocks) * kWarps) {
        uint4* out = reinterpret_cast<uint4*>(static_cast<char*>(io.out) + static_cast<size_t>(t) * w.payload_bytes);
        for (int i = lane; i < nvec; i += 32) StNa(out + i, make_uint4(0, 0, 0, 0));
      }
    }
    return;
  }

  if (sender) {
    const int sw = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x >> 5);
    int nsw = send_blocks * kWarps;
    uint32_t gin_channels = 0;
    if (!c.expert) {
      int maxn = 0;
      for (int j = 0; j < R; ++j) if (j != r) maxn = max(maxn, s_prefix[j + 1] - s_prefix[j]);
      // kBulk: a row is counted once its bulk group has written it, checked
      // after the next row's stores are issued (two rows in flight).
      int pend_j = -1, pend_pos = 0;
      for (int pos = sw; pos < maxn; pos += nsw) {
        for (int d = 1; d < R; ++d) {
          const int j = (r + d) % R;
          if (pos >= s_sends[j]) continue;
          char* const jbase = ShflPtr(lane_base, j);
          SendCombineRow<kBulk>(c, w, io, tr.RowSlot(j, jbase, pos), s_prefix[j] + pos, bulk);
          if constexpr (kBulk) {
            if (pend_j >= 0) {
              bulk.WaitAllButNewest();
              tr.RowWritten(Op::kCombine, pend_j, ShflPtr(lane_base, pend_j), pend_pos, s_sends[pend_j], gin_channels);
            }
            pend_j = j;
            pend_pos = pos;
          } else {
            tr.RowWritten(Op::kCombine, j, jbase, pos, s_sends[j], gin_channels);
          }
        }
      }
      if constexpr (kBulk) {
        bulk.WaitAll();
        if (pend_j >= 0)
          tr.RowWritten(Op::kCombine, pend_j, ShflPtr(lane_base, pend_j), pend_pos, s_sends[pend_j], gin_channels);
      }
    } else {
      // A row for a GIN source goes alone (its slot [t][k] is next to other
      // ranks' slots), from this warp's own stage row, which it may only
      // overwrite once the previous put has read it (GinFlushWarp). The
      // stage area has R*T rows: at most that many warps send then.
      // kBulk: an LSA row is counted after the next row's stores are
      // issued, as above; a GIN row at once (its stage row is reused).
      if (tr.AnyGin()) nsw = min(nsw, R * c.T);
      int pend_s = -1, pend_t = 0;
      size_t pend_slot = 0;
      const size_t staged = w.stage_off + static_cast<size_t>(sw) * w.row_bytes;
      for (int row = sw; sw < nsw && row < c.C; row += nsw) {
        const int s = io.src_rank[row];
        if (s < 0 || s == r) continue;  // own rows: read from y by the reducers (LocalNote)
        const int t = io.src_token[row], k = io.src_k[row];
        const size_t slot = w.recv_off + (static_cast<size_t>(t) * c.K + k) * w.row_bytes;
        char* const sbase = ShflPtr(lane_base, s);
        SendCombineRow<kBulk>(c, w, io, tr.BeginRowPut(s, sbase, slot, staged, gin_channels), row, bulk);
        if constexpr (kBulk) {
          if (tr.Gin(s)) bulk.WaitAll();
          else if (pend_s >= 0) bulk.WaitAllButNewest();
          if (pend_s >= 0) tr.EndRowPut(Op::kCombine, pend_s, ShflPtr(lane_base, pend_s), pend_slot, staged, pend_t, gin_channels);
          pend_s = -1;
          if (tr.Gin(s)) {
            tr.EndRowPut(Op::kCombine, s, sbase, slot, staged, t, gin_channels);
          } else {
            pend_s = s;
            pend_t = t;
            pend_slot = slot;
          }
        } else {
          tr.EndRowPut(Op::kCombine, s, sbase, slot, staged, t, gin_channels);
        }
      }
      if constexpr (kBulk) {
        bulk.WaitAll();
        if (pend_s >= 0) tr.EndRowPut(Op::kCombine, pend_s, ShflPtr(lane_base, pend_s), pend_slot, staged, pend_t, gin_channels);
      }
    }
    tr.Flush(gin_channels);
    return;
  }

  // Reducers. What the handle expects from each rank must be what that rank
  // announced, else this rank's handle is not the one its peers combine
  // with: drain the rows that come, zero the outputs, report.
  if (!c.expert) {
    for (int i = threadIdx.x; i < c.T * R; i += blockDim.x) {
      if (io.pos_in_rank[i] >= 0 && i % R != r) atomicAdd(&s_sent[i % R], 1);
    }
  } else {
    const int El = c.E / R;
    for (int i = threadIdx.x; i < c.T * c.K; i += blockDim.x) {
      const int e = io.topk[i];
      if (e >= 0 && e < c.E) atomicAdd(&s_sent[e / El], 1);
    }
  }
  __syncthreads();
  const int rw = static_cast<int>(blockIdx.x - send_blocks) * kWarps + static_cast<int>(threadIdx.x >> 5);
  const int nrw = static_cast<int>(gridDim.x - send_blocks) * kWarps;
  const unsigned long long t0 = globaltimer_ns();
  bool match = true;
  for (int j = 0; j < R; ++j) match &= s_sent[j] == s_announced[j];
  if (!match) {
    if (rw == 0) {
      if (lane == 0) report_error(p, Op::kCombine, Cause::kBadIndex);
      const int nch = NumChunks(c.T, chunk);
      for (int j = 0; j < R; ++j) {
        if (s_announced[j] <= 0 || (c.expert && j == r)) continue;  // own expert-layout rows are not counted
        // GIN: one signal per chunk (rank layout) or per row (expert layout).
        const int want = tr.AnnouncedCounts(j, s_announced[j], c.expert);
        int got = 0;
        while (got != want) {
          got = __reduce_add_sync(kFullMask, tr.ArrivedPart(Op::kCombine, j, nch));
          if (globaltimer_ns() - t0 > p.timeout_ns) {
            if (lane == 0) report_error(p, Op::kCombine, Cause::kPeerTimeout, static_cast<uint32_t>(j));
            break;
          }
        }
      }
    }
    const int nvec = static_cast<int>(w.payload_bytes / 16);
    for (int t = rw; t < c.T; t += nrw) {
      uint4* out = reinterpret_cast<uint4*>(static_cast<char*>(io.out) + static_cast<size_t>(t) * w.payload_bytes);
      for (int i = lane; i < nvec; i += 32) StNa(out + i, make_uint4(0, 0, 0, 0));
    }
    return;
  }
  // Token t's routing word per lane (rank layout: lane j < R, t's row
  // position in rank j; expert layout: lane k < K, its k-th expert id),
  // loaded a token ahead of its gather so that no reducer waits on it.
  auto load_meta = [&](int t) -> int {
    if (t >= c.T) return -1;
    if (!c.expert) return lane < R ? io.pos_in_rank[static_cast<size_t>(t) * R + lane] : -1;
    return lane < c.K ? io.topk[static_cast<size_t>(t) * c.K + lane] : -1;
  };
  // Token t's rows in sum order once they are complete (lane i: the i-th
  // row), and its weights: lane i's is `wt` on lane `src` — read with one
  // shuffle when the token is summed, so that the weight loads issued here
  // complete while the previous token is summed. n = 0 after a timeout
  // (the token gets zeros).
  int chunk_of = -1, chunk_cnt = 0;  // expert layout: lane j's cached chunk count (gather)
  const uint32_t epoch32 = static_cast<uint32_t>(*p.epoch);  // this op's (LocalNote tags)
  auto gather = [&](int t, int meta, const char*& my_row_out, float& wt_out, int& src_out) {
    int n = 0;
    const char* my_row = nullptr;
    float wt = 1.f;
    int src = lane;
    bool alive = true;
    if (!c.expert) {
      const int pos = meta;
      const unsigned mask = __ballot_sync(kFullMask, pos >= 0);
      n = __popc(mask);
      // Wait for each remote chunk this token needs (in rank order).
      for (unsigned m = mask & ~(1u << r); m && alive; m &= m - 1) {
        const int j = __ffs(m) - 1;
        const int pj = __shfl_sync(kFullMask, pos, j);
        alive = tr.WaitRow(Op::kCombine, j, pj, s_sent[j], t0);
      }
      const char* row = nullptr;
      if (pos >= 0) {
        if (lane == r) {
          const int yrow = s_prefix[r] + pos;
          row = static_cast<const char*>(io.y) + static_cast<size_t>(yrow) * w.payload_bytes;
          if (kHasW) wt = io.weights[yrow];
        } else {
          row = my + w.recv_off + (static_cast<size_t>(lane) * c.T + pos) * w.row_bytes;
          if (kHasW) wt = alive ? *reinterpret_cast<const float*>(row + w.weight_off) : 0.f;
        }
      }
      // List lane i takes the row of the i-th set bit.
      src = lane < n ? NthSetBit(mask, lane) : lane;
      const char* v = ShflPtr(row, src);
      my_row = lane < n ? v : nullptr;
    } else {
      const int id = meta;
      const bool valid = id >= 0 && id < c.E;
      const unsigned vmask = __ballot_sync(kFullMask, valid);
      n = __popc(vmask);
      // Rows expected in t's chunk from each rank: count the chunk's entries.
      const int El = c.E / R;
      unsigned need = 0;  // bit j: some entry of this token is on rank j (not counted: this rank)
      if (valid) need = 1u << (id / El);
      need = __reduce_or_sync(kFullMask, need) & ~(1u << r);
      for (unsigned m = need; m && alive; m &= m - 1) {
        const int j = __ffs(m) - 1;
        // Each source's rows of the chunk of tokens t is in (its transport's
        // chunking), counted from the routing once per chunk: lane j keeps
        // rank j's last count (a warp's tokens are contiguous here).
        const int rows = tr.RowsPerChunk(j);
        const int ch = t / rows;
        int cnt = __shfl_sync(kFullMask, chunk_cnt, j);
        if (__shfl_sync(kFullMask, chunk_of, j) != ch) {
          const int g0 = ch * rows, g1 = min(c.T, g0 + rows);
          cnt = 0;
          for (int i = g0 * c.K + lane; i < g1 * c.K; i += 32) {
            const int e = io.topk[i];
            cnt += (e >= 0 && e < c.E && e / El == j) ? 1 : 0;
          }
          cnt = __reduce_add_sync(kFullMask, cnt);
          if (lane == j) {
            chunk_of = ch;
            chunk_cnt = cnt;
          }
        }
        alive = tr.WaitTokenChunk(Op::kCombine, j, ch, static_cast<uint32_t>(cnt), t0);
      }
      // Order by (expert id, k): expert id ascending = rank then local expert.
      const long long key = valid ? static_cast<long long>(id) * kMaxTopk + lane : -1;
      int rank_in_order = 0;
      for (int l = 0; l < c.K; ++l) {
        const long long kl = __shfl_sync(kFullMask, key, l);
        rank_in_order += (kl >= 0 && kl < key) ? 1 : 0;
      }
      int my_k = lane;
      for (int i = 0; i < n; ++i) {
        const unsigned who = __ballot_sync(kFullMask, valid && rank_in_order == i);
        if (lane == i) my_k = __ffs(who) - 1;
      }
      const int my_id = __shfl_sync(kFullMask, id, my_k);
      if (lane < n) {
        my_row = my + w.recv_off + (static_cast<size_t>(t) * c.K + my_k) * w.row_bytes;
        if (my_id / El == r) {
          // This rank's own row: straight from y, where the scanner's note says.
          const LocalNote note = *reinterpret_cast<const LocalNote*>(my_row + w.weight_off);
          const bool fresh = note.tag == epoch32 && note.row >= 0 && note.row < c.C;
          if (!fresh) {
            report_error(p, Op::kCombine, Cause::kBadIndex);
            alive = false;
          }
          my_row = static_cast<const char*>(io.y) + static_cast<size_t>(fresh ? note.row : 0) * w.payload_bytes;
          wt = note.weight;
        } else if (kHasW && alive) {
          wt = *reinterpret_cast<const float*>(my_row + w.weight_off);
        }
      }
      alive = __all_sync(kFullMask, alive);
    }
    my_row_out = my_row;
    wt_out = wt;
    src_out = src;
    return alive ? n : 0;
  };
  auto out_row = [&](int t) { return static_cast<char*>(io.out) + static_cast<size_t>(t) * w.payload_bytes; };
  // Tokens [tb, te) step ts: rank layout strided over the warps (the rows
  // arrive roughly in position order, hence in token order); expert layout
  // a contiguous run per warp, so each chunk is counted once (gather).
  const int per = (c.T + nrw - 1) / nrw;
  const int tb = c.expert ? min(c.T, rw * per) : rw;
  const int te = c.expert ? min(c.T, tb + per) : c.T;
  const int ts = c.expert ? 1 : nrw;
  if constexpr (!kBulk) {
    for (int t = tb; t < te; t += ts) {
      const char* my_row;
      float wt;
      int src;
      const int n = gather(t, load_meta(t), my_row, wt, src);
      ReduceRows<TY, kHasW>(w, n, my_row, __shfl_sync(kFullMask, wt, src), reinterpret_cast<uint4*>(out_row(t)));
    }
  } else {
    // The first piece of the next token loads (and its routing word two
    // tokens ahead) while the last piece of this one is summed
    // (ReduceRowsBulk overlaps the pieces inside a token).
    const char* my_row;
    float wt;
    int src;
    int n = tb < te ? gather(tb, load_meta(tb), my_row, wt, src) : 0;
    int slot = tb < te ? BulkPiece(w, n, my_row, 0, bulk, piece) : -1;
    int meta = tb + ts < te ? load_meta(tb + ts) : -1;
    for (int t = tb; t < te; t += ts) {
      const int t2 = t + ts;
      const char* row2 = nullptr;
      float wt2 = 1.f;
      int n2 = 0, slot2 = -1, src2 = lane;
      auto prefetch = [&]() {
        if (t2 < te) {
          n2 = gather(t2, meta, row2, wt2, src2);
          slot2 = BulkPiece(w, n2, row2, 0, bulk, piece);
          meta = t2 + ts < te ? load_meta(t2 + ts) : -1;
        }
      };
      ReduceRowsBulk<TY, kHasW>(w, n, my_row, __shfl_sync(kFullMask, wt, src), out_row(t), bulk, piece, slot,
                                prefetch);
      n = n2;
      my_row = row2;
      wt = wt2;
      src = src2;
      slot = slot2;
    }
  }
}

// kBulk: kBulkSlots slots of `slot_bytes` per warp in dynamic shared memory;
// the reducers read `piece` bytes of each row per slot.
template <typename TY, bool kHasW, int kThreads, bool kBulk>
__global__ void __launch_bounds__(kThreads, 1) CombineDataKernel(CombineCfg c, CombineWindow w,
                                                                  EpPeers p, CombineIO io,
                                                                  int send_blocks, uint32_t slot_bytes,
                                                                  uint32_t piece) {
  __shared__ uint64_t s_bar[kBulk ? kThreads / 32 * kBulkSlots : 1];
  extern __shared__ __align__(128) char s_rows[];
  BulkSlots bulk = WarpBulkSlots<kBulk>(s_rows, s_bar, slot_bytes);
  CombineData<TY, kHasW, kThreads, kBulk>(c, w, p, io, send_blocks, bulk, piece);
}

// The data kernel LaunchCombine runs (every variant has one signature),
// its block size, dynamic shared memory, slot and piece bytes.
struct CombineDataChoice {
  void (*fn)(CombineCfg, CombineWindow, EpPeers, CombineIO, int, uint32_t, uint32_t);
  int threads;
  size_t smem;
  uint32_t slot_bytes, piece;
};

template <typename TY, bool kHasW>
CombineDataChoice CombineDataFor(uint32_t slot_bytes, uint32_t piece) {
  if (slot_bytes == 0) return {CombineDataKernel<TY, kHasW, kThreads, false>, kThreads, 0, 0, 0};
  const int warps = BulkWarpsFor(slot_bytes);
  return {warps == kBulkMaxWarps ? CombineDataKernel<TY, kHasW, kBulkMaxWarps * 32, true>
                                 : CombineDataKernel<TY, kHasW, 8 * 32, true>,
          warps * 32, static_cast<size_t>(warps) * kBulkSlots * slot_bytes, slot_bytes, piece};
}

template <typename TY>
CombineDataChoice CombineDataFor(bool has_w, uint32_t slot_bytes, uint32_t piece) {
  return has_w ? CombineDataFor<TY, true>(slot_bytes, piece) : CombineDataFor<TY, false>(slot_bytes, piece);
}

// Bulk copies (bulk_copy.cuh) where a row fits a slot; a reducer's slot
// holds a piece of each of a token's (at most R, resp. K) rows: the whole
// rows where they fit (one rank), since the next token's first piece
// loads while this token's last one is summed.
// A build with JAX_EP_BULK_COPIES=OFF keeps the register copies (comparison).
CombineDataChoice ChooseCombineData(const CombineArgs& a, const CombineWindow& w, int R) {
  const int max_rows = a.layout == EpLayout::kExpert ? a.topk : R;
  const size_t want_slot = std::max<size_t>(w.payload_bytes, 16 * static_cast<size_t>(max_rows));
  uint32_t slot_bytes = 0, piece = 0;
  if (BulkCopiesEnabled() && BulkWarpsFor(want_slot) > 0) {
    slot_bytes = static_cast<uint32_t>(want_slot);
    piece = std::max<uint32_t>(16, slot_bytes / max_rows / 16 * 16);
  }
  const bool has_w = a.weights != nullptr;
  switch (a.y_dtype) {
    case EpDtype::kBF16: return CombineDataFor<__nv_bfloat16>(has_w, slot_bytes, piece);
    case EpDtype::kF16: return CombineDataFor<__half>(has_w, slot_bytes, piece);
    default: return CombineDataFor<float>(has_w, slot_bytes, piece);
  }
}

template <typename TY, bool kHasW>
cudaError_t LoadCombineDataKernels() {
  return LoadEach(CombineDataKernel<TY, kHasW, kThreads, false>, CombineDataKernel<TY, kHasW, kBulkMaxWarps * 32, true>,
                  CombineDataKernel<TY, kHasW, 8 * 32, true>);
}

template <typename TY>
cudaError_t LoadCombineDataKernels() {
  if (cudaError_t err = LoadCombineDataKernels<TY, true>(); err != cudaSuccess) return err;
  return LoadCombineDataKernels<TY, false>();
}

}  // namespace

// Every kernel LaunchCombine can pick (CombineDataFor's variants, for each
// output dtype ChooseCombineData takes).
cudaError_t LoadCombineKernels() {
  if (cudaError_t err = LoadEach(CombineStartKernel); err != cudaSuccess) return err;
  if (cudaError_t err = LoadCombineDataKernels<__nv_bfloat16>(); err != cudaSuccess) return err;
  if (cudaError_t err = LoadCombineDataKernels<__half>(); err != cudaSuccess) return err;
  return LoadCombineDataKernels<float>();
}

size_t CombineWindowBytes(int R, int T, int H, int K, EpDtype y, EpLayout layout) {
  return CombineWindow(R, T, H, K, EpDtypeBytes(y), layout == EpLayout::kExpert).end;
}

std::string ValidateCombine(const CombineArgs& a, const EpPeers& p) {
  const int R = p.nranks;
  auto s = [](long long v) { return std::to_string(v); };
  if (R < 1 || R > kMaxRanks) return "number of ranks " + s(R) + " outside [1, " + s(kMaxRanks) + "]";
  if (a.y_dtype == EpDtype::kFp8E4m3) return "y must be bf16, f16 or f32";
  if (a.num_tokens < 0) return "num_tokens must be >= 0";
  if (a.topk < 1 || a.topk > kMaxTopk) return "topk " + s(a.topk) + " outside [1, 32]";
  if (a.num_experts < 1 || a.num_experts % R) return "num_experts " + s(a.num_experts) + " must be a positive multiple of " + s(R);
  if (a.capacity < 1) return "capacity must be >= 1";
  const long long row = static_cast<long long>(a.hidden) * EpDtypeBytes(a.y_dtype);
  if (a.hidden < 1 || row % 16) return "row bytes (hidden * dtype bytes = " + s(row) + ") must be a positive multiple of 16";
  const size_t need = CombineWindowBytes(R, a.num_tokens, a.hidden, a.topk, a.y_dtype, a.layout);
  if (need > p.window_bytes)
    return "the communicator's window (" + s(p.window_bytes) + " bytes) is too small for this combine: needs " +
           s(need) + " bytes (create the Communicator with num_bytes >= this)";
  return "";
}

cudaError_t LaunchCombine(const CombineArgs& a, const EpPeers& p, cudaStream_t stream) {
  const int R = p.nranks;
  CombineCfg c{};
  c.T = a.num_tokens;
  c.H = a.hidden;
  c.K = a.topk;
  c.E = a.num_experts;
  c.C = a.capacity;
  c.expert = a.layout == EpLayout::kExpert;
  c.has_w = a.weights != nullptr;
  const CombineWindow w(R, c.T, c.H, c.K, EpDtypeBytes(a.y_dtype), c.expert);
  c.gin_rows = AnyGinPeer(p) ? GinChunkRows(c.T) : 0;
  CombineIO io{a.y, a.weights, a.topk_idx, a.pos_in_rank, a.recv_src_rank, a.recv_src_token,
               a.recv_src_k, a.recv_counts, a.out};

  // Allowed before the start kernel starts waiting on the peers (the kernel
  // itself was loaded with the Communicator, kernel_load.h).
  const CombineDataChoice k = ChooseCombineData(a, w, R);
  if (k.smem > 0) {
    if (cudaError_t err = AllowBulkSmem(k.fn, k.smem); err != cudaSuccess) return err;
  }
  // Expert layout: the scanners split the handle's rows among themselves,
  // as many as the op's num_sms leaves beside the control block.
  const int scanners = !c.expert ? 0 : a.num_sms > 0 ? std::max(1, std::min(kCombineScanBlocks, a.num_sms - 1))
                                                     : kCombineScanBlocks;
  CombineStartKernel<<<1 + scanners, kStartThreads, 0, stream>>>(c, w, p, io);
  int send_blocks = 0, recv_blocks = 0;
  // Reducers read two rows per token and write one: half of the CTAs.
  SplitDataBlocks(a.num_sms, a.recv_sms, c.T, k.threads / 32, R, 0.5, a.start, &send_blocks, &recv_blocks);
  if (R == 1) {
    // One rank: nothing to send (a token's rows are read straight from y),
    // so every CTA reduces.
    recv_blocks = std::max(1, send_blocks + recv_blocks);
    send_blocks = 0;
  }
  k.fn<<<send_blocks + recv_blocks, k.threads, k.smem, stream>>>(c, w, p, io, send_blocks, k.slot_bytes, k.piece);
  return cudaGetLastError();
}

}  // namespace jax_ep
