// Normal (high-throughput) dispatch: see ep_kernels.h for the kernel
// sequence, window_layout.h for where the bytes go and transport.cuh for how
// a peer is reached (LSA or GIN).
//
// Why push into [source][slot] rows: XLA's output buffers cannot be mapped by
// the peers, so every remote row must land in the receiver's symmetric window
// first. Indexing the receive area by (source rank, pos_in_rank) lets each
// sender write its rows at offsets it computes alone (pos_in_rank is its own
// prefix sum), so the data phase needs no round trip. The counts exchange
// that precedes it is only for the receiver's output offsets, which lets the
// sender also write its *local* rows straight into the outputs while the
// NVLink stores are in flight (the local copy is then off the critical path).
//
// Errors: a rank that has failed (bad expert id, status already set, peer
// timeout) still takes part in every barrier but stores nothing into peers'
// windows; peers notice through the epoch-tagged counts / ok words and zero
// their outputs (and report), so nothing wrong is ever written.
#include <algorithm>
#include <string>

#include "bulk_copy.cuh"
#include "config_check.cuh"
#include "dispatch.cuh"
#include "ep_copy.cuh"
#include "ep_kernels.h"
#include "fp8.cuh"
#include "kernel_load.h"
#include "launch_policy.h"
#include "peer.cuh"
#include "transport.cuh"
#include "window_layout.h"

namespace jax_ep {

int EpDtypeBytes(EpDtype d) {
  switch (d) {
    case EpDtype::kBF16: return 2;
    case EpDtype::kF16: return 2;
    case EpDtype::kF32: return 4;
    case EpDtype::kFp8E4m3: return 1;
  }
  return 0;
}

namespace {

constexpr int kDataThreads = 1024;      // 32 warps: one token (row) per warp at a time
constexpr int kCastThreads = 512;       // push kernel with the in-kernel FP8 cast

// ---------------------------------------------------------------- data
// One kernel, two roles, so that the window -> output copy runs behind the
// link instead of after it:
//  - CTAs [0, S) send. Warp w takes tokens t = w, w + S*32, ...: it loads
//    x[t] once and stores it into every destination's window row [me][pos]
//    (then counts the row on that rank's chunk counter [me][pos / chunk]) and,
//    for this rank, straight into the output rows. pos grows with t, so the
//    chunks fill roughly in order.
//  - CTAs [S, S + Q) receive. Warp w takes positions w, w + Q*32, ... of
//    each source: it waits until the row's chunk is complete and copies it
//    from the window into the outputs (fanning out per local expert in
//    expert layout).
// Senders never wait, so the roles need not be co-resident.
//
// kSendOk (agreed by every rank in the control block) gates all sending and
// waiting; kOk (this rank's own view: no overflow either) gates all writes
// of outputs. A receiver that is not ok still drains its chunks, and the
// whole grid zeroes the outputs at the end.

// What a sender needs of token t, one word per lane: lane j < R its row
// position in rank j (-1: none), lane k < K its k-th expert id, weight and
// (expert layout) rank among this rank's entries for that expert. Loaded a
// token ahead of use so that no sender waits on them.
struct TokenMeta {
  int pos = -1, id = -1, rv = -1;
  float wt = 0.f;
};

__device__ __forceinline__ TokenMeta LoadTokenMeta(const DispatchCfg& c, int R, const PushIO& io,
                                                   const int* rie, int t) {
  const int lane = LaneId();
  TokenMeta m;
  if (lane < R) m.pos = io.pos_in_rank[static_cast<size_t>(t) * R + lane];
  if (lane < c.K) {
    const size_t i = static_cast<size_t>(t) * c.K + lane;
    m.id = io.topk[i];
    m.wt = io.topk_w[i];
    if (c.expert) m.rv = rie[i];
  }
  return m;
}

// Token t to the ranks in `dest` (lane j < R holds its row position in rank
// j as `pos`, and lane_rows = where row 0 of this rank's slot for rank j
// is: rank j's window, or for a GIN peer the staging area), payload
// cast to FP8 on the way if kCast. Returns with the stores possibly still
// in flight. kBulk: the payload goes through lane 0's bulk slots (one
// group per token, bulk_copy.cuh) instead of registers, from `slot`, where
// the caller has started loading the row (so that it loads while the warp
// still stores the previous token).
template <typename TIn, bool kCast, bool kBulk>
__device__ __forceinline__ void SendToken(const DispatchCfg& c, const DispatchWindow& w,
                                          const EpPeers& p, const PushIO& io, const int* scratch,
                                          int t, const TokenMeta& tm, unsigned dest,
                                          char* lane_rows, int local_prefix, BulkSlots& bulk,
                                          int slot) {
  static_assert(!(kBulk && kCast), "the cast needs the row in registers");
  const int R = p.nranks, r = p.rank, El = c.El, K = c.K;
  const DispatchScratch sc(R, c.E);
  const int lane = LaneId();
  const size_t in_row_bytes = static_cast<size_t>(c.H) * c.in_bytes;
  const char* xrow = static_cast<const char*>(io.x) + t * in_row_bytes;
  const unsigned remote_mask = dest & ~(1u << r);
  const bool to_me = (dest >> r) & 1u;
  const int pos = tm.pos, id = tm.id, rv = tm.rv;
  const float wt = tm.wt;
  const int drank = (id >= 0 && id < c.E) ? id / El : -1;
  // Lane j < R: this token's row in rank j's window.
  char* const lane_row = ((remote_mask >> lane) & 1u) ? lane_rows + static_cast<size_t>(pos) * w.row_bytes : nullptr;
  int local_row = -1;  // expert layout: output row of (t, lane) if its expert is here
  if (to_me && c.expert && drank == r) local_row = scratch[sc.src_off + (id - r * El) * R + r] + rv;
  const unsigned local_mask = __ballot_sync(kFullMask, local_row >= 0);
  const int my_pos = __shfl_sync(kFullMask, pos, r);
  const int rank_row = (to_me && !c.expert) ? local_prefix + my_pos : -1;
  const unsigned out_mask = c.expert ? local_mask : (rank_row >= 0 ? 1u : 0u);
  char* const recv_x = static_cast<char*>(io.recv_x);
  const int H128 = c.H / 128;
  // Lane i in out_mask: an output row this token fills here.
  const int lane_out = c.expert ? local_row : rank_row;
  char* const lane_out_row = lane_out >= 0 ? recv_x + static_cast<size_t>(lane_out) * w.payload_bytes : nullptr;
  auto lane_out_scales = [&]() -> float* {
    return lane_out >= 0 ? io.recv_scales + static_cast<size_t>(lane_out) * H128 : nullptr;
  };

  // Metadata: remote rows (ids already converted for that destination).
  for (unsigned m = remote_mask; m; m &= m - 1) {
    const int j = __ffs(m) - 1;
    int* meta = reinterpret_cast<int*>(ShflPtr(lane_row, j) + w.meta_off);
    if (lane < K) {
      const int lid = drank == j ? id - j * El : -1;
      meta[lane] = lid;
      reinterpret_cast<float*>(meta)[K + lane] = lid >= 0 ? wt : 0.f;
      meta[2 * K + lane] = lid >= 0 ? rv : -1;
    }
    if (lane == 0) meta[3 * K] = t;
  }
  // Metadata: local output rows.
  if (!c.expert) {
    if (rank_row >= 0) {
      if (lane < K) {
        const int lid = drank == r ? id - r * El : -1;
        io.recv_topk_idx[static_cast<size_t>(rank_row) * K + lane] = lid;
        io.recv_topk_w[static_cast<size_t>(rank_row) * K + lane] = lid >= 0 ? wt : 0.f;
      }
      if (lane == 0) {
        io.src_rank[rank_row] = r;
        io.src_token[rank_row] = t;
        io.src_k[rank_row] = -1;
      }
    }
  } else if (local_row >= 0) {
    io.recv_topk_idx[local_row] = id - r * El;
    io.recv_topk_w[local_row] = wt;
    io.src_rank[local_row] = r;
    io.src_token[local_row] = t;
    io.src_k[local_row] = lane;
  }

  if constexpr (kBulk) {
    bulk.Wait(slot);
    const uint32_t nb = static_cast<uint32_t>(in_row_bytes);
    for (unsigned m = remote_mask; m; m &= m - 1) bulk.Store(slot, ShflPtr(lane_row, __ffs(m) - 1), nb);
    for (unsigned m = out_mask; m; m &= m - 1) bulk.Store(slot, ShflPtr(lane_out_row, __ffs(m) - 1), nb);
    bulk.Commit();
  } else {
    const int nvec = static_cast<int>(in_row_bytes / 16);
    const uint4* xv = reinterpret_cast<const uint4*>(xrow);
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int idx = base + u * 32 + lane;
        v[u] = idx < nvec ? LdNcNa(xv + idx) : make_uint4(0, 0, 0, 0);
      }
      if constexpr (!kCast) {
        for (unsigned m = remote_mask; m; m &= m - 1)
          StoreChunk(reinterpret_cast<uint4*>(ShflPtr(lane_row, __ffs(m) - 1)), base, nvec, lane, v);
        for (unsigned m = out_mask; m; m &= m - 1)
          StoreChunk(reinterpret_cast<uint4*>(ShflPtr(lane_out_row, __ffs(m) - 1)), base, nvec, lane, v);
      } else {
        constexpr int LPB = kFp8Block / Vec16<TIn>::N;  // lanes per 128-channel block
        using QT = Fp8Vec<TIn>;
        QT q[kUnroll];
        float s[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) q[u] = CastVec16Fp8<TIn>(v[u], c.ue8m0 != 0, s[u]);
        // Each lane's 16 input bytes become V output bytes at channel idx*V.
        auto put = [&](char* row, float* srow) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int idx = base + u * 32 + lane;
            if (idx < nvec) {
              reinterpret_cast<QT*>(row)[idx] = q[u];
              if (lane % LPB == 0) srow[idx / LPB] = s[u];
            }
          }
        };
        for (unsigned m = remote_mask; m; m &= m - 1) {
          char* row = ShflPtr(lane_row, __ffs(m) - 1);
          put(row, reinterpret_cast<float*>(row + w.scales_off));
        }
        for (unsigned m = out_mask; m; m &= m - 1)
          put(ShflPtr(lane_out_row, __ffs(m) - 1), ShflPtr(lane_out_scales(), __ffs(m) - 1));
      }
    }
  }
  // FP8 input: the scales travel with the row.
  if (!kCast && c.has_scales) {
    const float* xs = io.x_scales + static_cast<size_t>(t) * H128;
    for (unsigned m = remote_mask; m; m &= m - 1) {
      float* srow = reinterpret_cast<float*>(ShflPtr(lane_row, __ffs(m) - 1) + w.scales_off);
      for (int i = lane; i < H128; i += 32) srow[i] = xs[i];
    }
    for (unsigned m = out_mask; m; m &= m - 1) {
      float* srow = ShflPtr(lane_out_scales(), __ffs(m) - 1);
      for (int i = lane; i < H128; i += 32) srow[i] = xs[i];
    }
  }
}

struct RowWriter {
  const DispatchCfg& c;
  const DispatchWindow& w;
  const PushIO& io;
  int lane;

  __device__ void Zero(int row) const {
    const int nv = static_cast<int>(w.payload_bytes / 16);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(io.recv_x) + static_cast<size_t>(row) * w.payload_bytes);
    for (int i = lane; i < nv; i += 32) StNa(dst + i, make_uint4(0, 0, 0, 0));
    if (c.has_scales) {
      const int H128 = c.H / 128;
      for (int i = lane; i < H128; i += 32) io.recv_scales[static_cast<size_t>(row) * H128 + i] = 0.f;
    }
    if (!c.expert) {
      if (lane < c.K) {
        io.recv_topk_idx[static_cast<size_t>(row) * c.K + lane] = -1;
        io.recv_topk_w[static_cast<size_t>(row) * c.K + lane] = 0.f;
      }
    } else if (lane == 0) {
      io.recv_topk_idx[row] = -1;
      io.recv_topk_w[row] = 0.f;
    }
    if (lane == 0) {
      io.src_rank[row] = -1;
      io.src_token[row] = -1;
      io.src_k[row] = -1;
    }
  }
};

// Row p from source s (already complete in this rank's window) into the
// outputs: rank layout row prefix[s] + p; expert layout one row per local
// expert the token chose, at the sender's rie inside the (expert, s) block.
// kBulk: the payload through lane 0's bulk slots, one group per row, from
// `slot`, where the caller has started loading it (RecvLoad).
template <bool kBulk>
__device__ __forceinline__ void RecvRow(const DispatchCfg& c, const DispatchWindow& w,
                                        const EpPeers& p, const PushIO& io, const int* scratch,
                                        const int* s_prefix, int s, int pos, BulkSlots& bulk,
                                        int slot) {
  const int R = p.nranks, El = c.El, K = c.K;
  const DispatchScratch sc(R, c.E);
  const int lane = LaneId();
  const char* src = MyWindow(p) + w.row(s, pos, c.T);
  const int* meta = reinterpret_cast<const int*>(src + w.meta_off);
  char* recv_x = static_cast<char*>(io.recv_x);
  const int nvec = static_cast<int>(w.payload_bytes / 16);
  const int H128 = c.H / 128;
  const uint4* sv = reinterpret_cast<const uint4*>(src);
  const uint32_t nb = static_cast<uint32_t>(w.payload_bytes);
  if (!c.expert) {
    const int row = s_prefix[s] + pos;
    uint4* dst = reinterpret_cast<uint4*>(recv_x + static_cast<size_t>(row) * w.payload_bytes);
    if constexpr (kBulk) {
      bulk.Wait(slot);
      bulk.Store(slot, dst, nb);
      bulk.Commit();
    } else {
      for (int base = 0; base < nvec; base += 32 * kUnroll) {
        uint4 v[kUnroll];
        LoadChunk(sv, base, nvec, lane, v);
        StoreChunk(dst, base, nvec, lane, v);
      }
    }
    if (c.has_scales) {
      const float* ss = reinterpret_cast<const float*>(src + w.scales_off);
      for (int i = lane; i < H128; i += 32) io.recv_scales[static_cast<size_t>(row) * H128 + i] = ss[i];
    }
    if (lane < K) {
      io.recv_topk_idx[static_cast<size_t>(row) * K + lane] = meta[lane];
      io.recv_topk_w[static_cast<size_t>(row) * K + lane] = reinterpret_cast<const float*>(meta)[K + lane];
    }
    if (lane == 0) {
      io.src_rank[row] = s;
      io.src_token[row] = meta[3 * K];
      io.src_k[row] = -1;
    }
    return;
  }
  int lid = -1, orow = -1;
  if (lane < K) {
    lid = meta[lane];
    if (lid >= 0 && lid < El) orow = scratch[sc.src_off + lid * R + s] + meta[2 * K + lane];
  }
  const unsigned omask = __ballot_sync(kFullMask, orow >= 0);
  const int tok = meta[3 * K];
  if (orow >= 0) {
    io.recv_topk_idx[orow] = lid;
    io.recv_topk_w[orow] = reinterpret_cast<const float*>(meta)[K + lane];
    io.src_rank[orow] = s;
    io.src_token[orow] = tok;
    io.src_k[orow] = lane;
  }
  if constexpr (kBulk) {
    bulk.Wait(slot);
    for (unsigned m = omask; m; m &= m - 1) {
      const int o = __shfl_sync(kFullMask, orow, __ffs(m) - 1);
      bulk.Store(slot, recv_x + static_cast<size_t>(o) * w.payload_bytes, nb);
    }
    bulk.Commit();
  } else {
    for (int base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 v[kUnroll];
      LoadChunk(sv, base, nvec, lane, v);
      for (unsigned m = omask; m; m &= m - 1) {
        const int o = __shfl_sync(kFullMask, orow, __ffs(m) - 1);
        StoreChunk(reinterpret_cast<uint4*>(recv_x + static_cast<size_t>(o) * w.payload_bytes), base, nvec, lane, v);
      }
    }
  }
  if (c.has_scales) {
    const float* ss = reinterpret_cast<const float*>(src + w.scales_off);
    for (unsigned m = omask; m; m &= m - 1) {
      const int o = __shfl_sync(kFullMask, orow, __ffs(m) - 1);
      float* srow = io.recv_scales + static_cast<size_t>(o) * H128;
      for (int i = lane; i < H128; i += 32) srow[i] = ss[i];
    }
  }
}

// Start loading row `pos` from source s (its count acquired: WaitRow) into
// a slot; kReadPending as BulkSlots::Begin (0 while the warp still holds an
// uncommitted row in the other slot).
template <int kReadPending>
__device__ __forceinline__ int RecvLoad(const DispatchCfg& c, const DispatchWindow& w, const EpPeers& p,
                                        int s, int pos, BulkSlots& bulk) {
  FenceBeforeBulkRead();
  return bulk.Load<kReadPending>(MyWindow(p) + w.row(s, pos, c.T), static_cast<uint32_t>(w.payload_bytes));
}

// kBulk: rows move through shared memory by bulk copies (bulk_copy.cuh);
// `slot_bytes` per slot, kBulkSlots slots per warp in dynamic shared memory.
template <typename TIn, bool kCast, int kThreads, bool kBulk>
__global__ void __launch_bounds__(kThreads, 1) DispatchDataKernel(DispatchCfg c, DispatchWindow w,
                                                                   EpPeers p, PushIO io,
                                                                   int send_blocks, uint32_t slot_bytes) {
  __shared__ int s_prefix[kMaxRanks + 1];
  __shared__ int s_sends[kMaxRanks];  // rows this rank sends to rank j
  __shared__ uint64_t s_bar[kBulk ? kThreads / 32 * kBulkSlots : 1];
  extern __shared__ __align__(128) char s_rows[];
  const int R = p.nranks, r = p.rank;
  const DispatchScratch sc(R, c.E);
  const int* scratch = ScratchOf(p, w);
  const bool send_ok = scratch[DispatchScratch::kSendOk] != 0;  // grid-uniform
  if (threadIdx.x <= R) s_prefix[threadIdx.x] = scratch[sc.prefix + threadIdx.x];
  if (threadIdx.x < R) s_sends[threadIdx.x] = send_ok ? scratch[sc.tokens_per_rank + threadIdx.x] : 0;
  __syncthreads();
  char* const my = PeerWindow(p, r);
  const bool ok = scratch[DispatchScratch::kOk] != 0;           // grid-uniform
  const int lane = LaneId();
  constexpr int kWarps = kThreads / 32;
  const int gwarp = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x >> 5);
  const int gwarps = static_cast<int>(gridDim.x) * kWarps;
  const RowWriter out{c, w, io, lane};
  const int chunk = ChunkRows(c.T);
  BulkSlots bulk = WarpBulkSlots<kBulk>(s_rows, s_bar, slot_bytes);

  // Padding and tail rows are not data rows of anyone: fill them first.
  if (ok) {
    if (!c.expert) {
      for (int row = s_prefix[R] + gwarp; row < c.C; row += gwarps) out.Zero(row);
    } else {
      for (int e = gwarp; e < c.El; e += gwarps) {
        const int end = scratch[sc.group_off + e + 1];
        for (int row = scratch[sc.group_off + e] + scratch[sc.group_size + e]; row < end; ++row) out.Zero(row);
      }
      for (int row = scratch[sc.group_off + c.El] + gwarp; row < c.C; row += gwarps) out.Zero(row);
    }
  }

  if (send_ok && static_cast<int>(blockIdx.x) < send_blocks) {
    const int* rie = reinterpret_cast<const int*>(PeerWindow(p, r) + w.rie_off);
    // Indexing the by-value EpPeers with a runtime rank goes through local
    // memory; do it once per thread, then move pointers between lanes.
    char* const lane_base = PeerWindow(p, lane < R ? lane : 0);  // null for a GIN peer
    const int jl = lane < R ? lane : 0;
    const PeerTransport tr{p, my, chunk, {w.stage_off, w.recv_off, w.row_bytes, c.T, c.gin_rows}};
    char* const lane_rows = tr.RowSlot(jl, lane_base, 0);  // my [0..T) rows for lane's peer
    const int lane_sends = s_sends[jl];
    uint32_t gin_channels = 0;
    // kBulk: a token's rows are counted once its bulk group has written
    // them, which is checked after the next token's stores are issued, so
    // two tokens' stores stay in flight.
    unsigned pend_remote = 0;
    int pend_pos = -1;
    const int stride = send_blocks * kWarps;
    const size_t in_row_bytes = static_cast<size_t>(c.H) * c.in_bytes;
    auto xrow = [&](int t) { return static_cast<const char*>(io.x) + t * in_row_bytes; };
    // The first token at or after t that has rows to send, with its
    // metadata and destinations; c.T when none is left. `m` holds t's
    // metadata on entry (loaded ahead); later candidates load here.
    auto next_token = [&](int t, TokenMeta& m, unsigned& dest) {
      for (bool first = true; t < c.T; t += stride, first = false) {
        if (!first) m = LoadTokenMeta(c, R, io, rie, t);
        dest = __ballot_sync(kFullMask, m.pos >= 0);
        if (!ok) dest &= ~(1u << r);  // peers still get their rows; our outputs get zeros
        if (dest != 0) return t;
      }
      return c.T;
    };
    auto load_ahead = [&](int t) { return t < c.T ? LoadTokenMeta(c, R, io, rie, t) : TokenMeta{}; };
    int slot = -1;
    unsigned dest = 0;
    TokenMeta m = load_ahead(gwarp);
    int t = next_token(gwarp, m, dest);
    if (kBulk && t < c.T) slot = bulk.Load<0>(xrow(t), static_cast<uint32_t>(in_row_bytes));
    TokenMeta m2 = load_ahead(t + stride);  // the next candidate's
    while (t < c.T) {
      int slot2 = -1;
      unsigned dest2 = 0;
      const int t2 = next_token(t + stride, m2, dest2);
      // kBulk: the next token's row loads while this one's is placed and
      // stored (two loads in flight: a warp's rows are latency-bound).
      if (kBulk && t2 < c.T) slot2 = bulk.Load<0>(xrow(t2), static_cast<uint32_t>(in_row_bytes));
      // (Register copies: no deeper look-ahead, it would spill at 64 registers.)
      const TokenMeta m3 = kBulk ? load_ahead(t2 + stride) : TokenMeta{};
      SendToken<TIn, kCast, kBulk>(c, w, p, io, scratch, t, m, dest, lane_rows, s_prefix[r], bulk, slot);
      const int pos = m.pos;
      const unsigned remote = dest & ~(1u << r);
      if constexpr (kBulk) {
        if (pend_remote != 0) {
          bulk.WaitAllButNewest();
          tr.RowsWritten(Op::kDispatch, pend_remote, lane_base, jl, pend_pos, lane_sends, gin_channels);
        }
        pend_remote = remote;
        pend_pos = pos;
      } else if (remote != 0) {
        tr.RowsWritten(Op::kDispatch, remote, lane_base, jl, pos, lane_sends, gin_channels);
      }
      t = t2;
      m = m2;
      m2 = kBulk ? m3 : load_ahead(t + stride);
      dest = dest2;
      slot = slot2;
    }
    if constexpr (kBulk) bulk.WaitAll();
    if (kBulk && pend_remote != 0)
      tr.RowsWritten(Op::kDispatch, pend_remote, lane_base, jl, pend_pos, lane_sends, gin_channels);
    tr.Flush(gin_channels);
  } else if (send_ok) {
    const int rwarp = gwarp - send_blocks * kWarps;
    const int nrw = gwarps - send_blocks * kWarps;
    int maxn = 0;
    for (int s = 0; s < R; ++s) if (s != r) maxn = max(maxn, s_prefix[s + 1] - s_prefix[s]);
    const unsigned long long t0 = globaltimer_ns();
    const PeerTransport tr{p, my, chunk, {w.stage_off, w.recv_off, w.row_bytes, c.T, c.gin_rows}};
    // Rows in order: positions rwarp, rwarp + nrw, ...; at each, the
    // sources d = 1 .. R-1 ranks back (the one that sends to us first,
    // first). next_row gives the next (s, pos) that exists.
    int ipos = rwarp, id = 1;
    auto next_row = [&](int& s, int& pos) {
      for (; ipos < maxn; ipos += nrw, id = 1) {
        for (; id < R; ++id) {
          const int src = (r - id + R) % R;
          if (ipos < s_prefix[src + 1] - s_prefix[src]) {
            s = src;
            pos = ipos;
            ++id;
            return true;
          }
        }
      }
      return false;
    };
    auto wait_row = [&](int s, int pos) {
      return tr.WaitRow(Op::kDispatch, s, pos, s_prefix[s + 1] - s_prefix[s], t0);
    };
    int s = 0, pos = 0, slot = -1;
    bool have = next_row(s, pos);
    bool alive = !have || wait_row(s, pos);
    if (kBulk && have && alive && ok) slot = RecvLoad<0>(c, w, p, s, pos, bulk);
    while (have && alive) {
      // kBulk: the next row loads while this one is placed, if it has
      // arrived; else this one is placed first (a finished row is not held
      // back waiting for a later one).
      int s2 = 0, pos2 = 0, slot2 = -1;
      const bool have2 = next_row(s2, pos2);
      const bool early = kBulk && have2 && ok && tr.RowArrived(Op::kDispatch, s2, pos2, s_prefix[s2 + 1] - s_prefix[s2]);
      bool alive2 = true;
      if (early) {
        alive2 = wait_row(s2, pos2);
        if (alive2) slot2 = RecvLoad<0>(c, w, p, s2, pos2, bulk);
      }
      if (ok) RecvRow<kBulk>(c, w, p, io, scratch, s_prefix, s, pos, bulk, slot);
      if (have2 && !early) {
        alive2 = wait_row(s2, pos2);
        if (kBulk && alive2 && ok) slot2 = RecvLoad<1>(c, w, p, s2, pos2, bulk);
      }
      s = s2;
      pos = pos2;
      slot = slot2;
      have = have2;
      alive = alive2;
    }
    if constexpr (kBulk) bulk.WaitAll();
  }

  if (!ok) {
    for (int row = gwarp; row < c.C; row += gwarps) out.Zero(row);
  }
}

}  // namespace

size_t DispatchWindowBytes(int R, int T, int H, int K, int E, EpDtype payload, bool fp8_scales) {
  return DispatchWindow(R, T, H, K, E, EpDtypeBytes(payload), fp8_scales).end;
}

size_t DispatchWindowNeed(const DispatchArgs& a, int R) {
  const bool fp8 = a.cast_fp8 || a.x_dtype == EpDtype::kFp8E4m3;
  return DispatchWindowBytes(R, a.num_tokens, a.hidden, a.topk, a.num_experts,
                             fp8 ? EpDtype::kFp8E4m3 : a.x_dtype, fp8);
}

std::string ValidateDispatch(const DispatchArgs& a, const EpPeers& p) {
  const int R = p.nranks;
  auto s = [](long long v) { return std::to_string(v); };
  if (R < 1 || R > kMaxRanks) return "number of ranks " + s(R) + " outside [1, " + s(kMaxRanks) + "]";
  if (a.num_tokens < 0) return "num_tokens must be >= 0";
  if (a.topk < 1 || a.topk > kMaxTopk) return "topk " + s(a.topk) + " outside [1, 32]";
  if (a.num_experts < 1 || a.num_experts % R) return "num_experts " + s(a.num_experts) + " must be a positive multiple of " + s(R);
  if (a.num_experts / R > kMaxLocalExperts) return "local experts " + s(a.num_experts / R) + " > 1024";
  if (a.capacity < 1) return "capacity must be >= 1";
  if (a.expert_alignment < 1) return "expert_alignment must be >= 1";
  if (a.hidden < 1) return "hidden must be >= 1";
  const bool fp8_in = a.x_dtype == EpDtype::kFp8E4m3;
  if (a.cast_fp8 && fp8_in) return "x is already FP8";
  if ((a.cast_fp8 || fp8_in) && a.hidden % 128) return "hidden " + s(a.hidden) + " must be a multiple of 128 for FP8";
  const int in_bytes = EpDtypeBytes(a.x_dtype);
  if ((static_cast<long long>(a.hidden) * in_bytes) % 16)
    return "row bytes (hidden * " + s(in_bytes) + " = " + s(static_cast<long long>(a.hidden) * in_bytes) + ") must be a multiple of 16";
  if (static_cast<long long>(a.num_tokens) * a.topk >= (1ll << 31) || static_cast<long long>(a.capacity) >= (1ll << 31))
    return "too many tokens";
  const size_t need = DispatchWindowNeed(a, R);
  if (need > p.window_bytes)
    return "the communicator's window (" + s(p.window_bytes) + " bytes) is too small for this dispatch: needs " +
           s(need) + " bytes (create the Communicator with num_bytes >= this)";
  return "";
}

namespace {

// The data kernel LaunchDispatch runs for `a` (every variant has one
// signature), its block size and dynamic shared memory. Rows that fit a
// slot move by bulk copies (bulk_copy.cuh); the cast needs them in
// registers. A build with JAX_EP_BULK_COPIES=OFF keeps the register copy.
struct DispatchDataChoice {
  void (*fn)(DispatchCfg, DispatchWindow, EpPeers, PushIO, int, uint32_t);
  int threads;
  size_t smem;
  uint32_t slot_bytes;
};

DispatchDataChoice ChooseDispatchData(const DispatchArgs& a, const DispatchWindow& w) {
  const uint32_t slot_bytes = static_cast<uint32_t>(w.payload_bytes);  // a multiple of 16
  const int bulk_warps = BulkCopiesEnabled() && !a.cast_fp8 ? BulkWarpsFor(slot_bytes) : 0;
  if (bulk_warps > 0) {
    return {bulk_warps == kBulkMaxWarps ? DispatchDataKernel<uint8_t, false, kBulkMaxWarps * 32, true>
                                        : DispatchDataKernel<uint8_t, false, 8 * 32, true>,
            bulk_warps * 32, static_cast<size_t>(bulk_warps) * kBulkSlots * slot_bytes, slot_bytes};
  }
  if (!a.cast_fp8) return {DispatchDataKernel<uint8_t, false, kDataThreads, false>, kDataThreads, 0, 0};
  if (a.x_dtype == EpDtype::kBF16)
    return {DispatchDataKernel<__nv_bfloat16, true, kCastThreads, false>, kCastThreads, 0, 0};
  if (a.x_dtype == EpDtype::kF16) return {DispatchDataKernel<__half, true, kCastThreads, false>, kCastThreads, 0, 0};
  return {DispatchDataKernel<float, true, kCastThreads, false>, kCastThreads, 0, 0};
}

}  // namespace

// Every kernel LaunchDispatch can pick (ChooseDispatchData's variants).
cudaError_t LoadDispatchKernels() {
  return LoadEach(DispatchDataKernel<uint8_t, false, kBulkMaxWarps * 32, true>,
                  DispatchDataKernel<uint8_t, false, 8 * 32, true>, DispatchDataKernel<uint8_t, false, kDataThreads, false>,
                  DispatchDataKernel<__nv_bfloat16, true, kCastThreads, false>,
                  DispatchDataKernel<__half, true, kCastThreads, false>,
                  DispatchDataKernel<float, true, kCastThreads, false>);
}

cudaError_t LaunchDispatch(const DispatchArgs& a, const EpPeers& p, cudaStream_t stream) {
  const int R = p.nranks;
  const bool fp8_in = a.x_dtype == EpDtype::kFp8E4m3;
  const bool fp8 = a.cast_fp8 || fp8_in;
  DispatchCfg c{};
  c.T = a.num_tokens;
  c.H = a.hidden;
  c.K = a.topk;
  c.E = a.num_experts;
  c.El = a.num_experts / R;
  c.C = a.capacity;
  c.align = a.expert_alignment;
  c.expert = a.layout == EpLayout::kExpert;
  c.in_bytes = EpDtypeBytes(a.x_dtype);
  c.has_scales = fp8;
  c.ue8m0 = a.ue8m0;
  const DispatchWindow w(R, c.T, c.H, c.K, c.E, fp8 ? 1 : c.in_bytes, fp8);
  c.gin_rows = AnyGinPeer(p) ? GinChunkRows(c.T) : 0;
  PushIO io{a.x, a.x_scales, a.topk_idx, a.topk_weights, a.pos_in_rank, a.recv_x, a.recv_scales,
            a.recv_topk_idx, a.recv_topk_weights, a.recv_src_rank, a.recv_src_token, a.recv_src_k,
            a.counts, a.recv_counts};
  // Allowed before the setup kernel starts waiting on the peers (the kernel
  // itself was loaded with the Communicator, kernel_load.h).
  const DispatchDataChoice k = ChooseDispatchData(a, w);
  if (k.smem > 0) {
    if (cudaError_t err = AllowBulkSmem(k.fn, k.smem); err != cudaSuccess) return err;
  }

  LaunchDispatchSetup(c, w, p, io, a.num_sms, a.start, stream);

  // One grid: S sending CTAs, Q receiving CTAs (none with one rank).
  int send_blocks = 0, recv_blocks = 0;
  // Receivers copy HBM to HBM what the link brings in: half of the CTAs
  // (measured: 12/12 of 24 beat 16/8 by 9 us at the Normal shape); a quarter
  // when the senders also quantise and the rows are half as long.
  SplitDataBlocks(a.num_sms, a.recv_sms, c.T, k.threads / 32, R, a.cast_fp8 ? 0.25 : 0.5, a.start,
                  &send_blocks, &recv_blocks);
  k.fn<<<send_blocks + recv_blocks, k.threads, k.smem, stream>>>(c, w, p, io, send_blocks, k.slot_bytes);
  return cudaGetLastError();
}

}  // namespace jax_ep
