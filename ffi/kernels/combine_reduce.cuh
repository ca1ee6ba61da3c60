// How combine's reducers sum a token's rows: in list order, in f32, each
// product and sum rounded on its own (never an FMA), which is exactly
// jax_ep.reference.combine (docs/design.md §2). From registers (ReduceRows)
// or, with bulk copies, from pieces of the rows staged in shared memory
// (ReduceRowsBulk). Only combine.cu includes it.
#pragma once

#include <cstdint>

#include "bulk_copy.cuh"
#include "common.cuh"
#include "ep_copy.cuh"
#include "vec16.cuh"
#include "window_layout.h"

namespace jax_ep {
namespace {

// Vectors of two rows each lane keeps in flight in ReduceRows: the reducer
// stays under 64 registers with the data kernel's 32 warps.
constexpr int kReduceUnroll = 2;
constexpr int kSmemUnroll = 4;  // the bulk reducer's vectors per lane per step

// acc += w * v (kHasW) or acc += v, element by element, each product and
// sum rounded on its own (never an FMA): the roundings of docs/design.md §2.
template <typename TY, bool kHasW>
__device__ __forceinline__ void AccumulateVec(float (&acc)[Vec16<TY>::N], const uint4& v, float w) {
  float f[Vec16<TY>::N];
  Vec16<TY>::ToFloat(v, f);
#pragma unroll
  for (int e = 0; e < Vec16<TY>::N; ++e) acc[e] = kHasW ? __fadd_rn(acc[e], __fmul_rn(w, f[e])) : __fadd_rn(acc[e], f[e]);
}

// Sum the n rows listed by lanes 0..n-1 (lane i: row pointer and weight) in
// list order, in f32 with separate roundings, into out. Two rows are loaded
// before either is added, so each step has twice the loads in flight.
template <typename TY, bool kHasW>
__device__ __forceinline__ void ReduceRows(const CombineWindow& w, int n, const char* my_row,
                                           float my_w, uint4* out) {
  constexpr int V = Vec16<TY>::N;
  constexpr int U = kReduceUnroll;
  const int lane = LaneId();
  const int nvec = static_cast<int>(w.payload_bytes / 16);
  // -0.0 is the exact additive identity (the reference starts there, since
  // XLA folds 0 + p into p); a token with no rows gets +0.0.
  const float init = n > 0 ? -0.f : 0.f;
  for (int base = 0; base < nvec; base += 32 * U) {
    float acc[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = init;
    for (int i = 0; i < n; i += 2) {
      const bool two = i + 1 < n;
      const uint4* r0 = reinterpret_cast<const uint4*>(ShflPtr(my_row, i));
      const uint4* r1 = reinterpret_cast<const uint4*>(ShflPtr(my_row, two ? i + 1 : i));
      const float w0 = __shfl_sync(kFullMask, my_w, i);
      const float w1 = __shfl_sync(kFullMask, my_w, two ? i + 1 : i);
      uint4 v0[U], v1[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * 32 + lane;
        v0[u] = idx < nvec ? LdV4(r0 + idx) : make_uint4(0, 0, 0, 0);
        v1[u] = (two && idx < nvec) ? LdV4(r1 + idx) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        AccumulateVec<TY, kHasW>(acc[u], v0[u], w0);
        if (two) AccumulateVec<TY, kHasW>(acc[u], v1[u], w1);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * 32 + lane;
      if (idx < nvec) StNa(out + idx, Vec16<TY>::FromFloat(acc[u]));
    }
  }
}

// Start loading piece `off` (`piece` bytes, less at the row's end) of each
// of the n rows lane i holds in my_row into the next slot, rows side by
// side; -1 when n = 0. The rows' counts were acquired (gather).
__device__ __forceinline__ int BulkPiece(const CombineWindow& w, int n, const char* my_row, uint32_t off,
                                         BulkSlots& bulk, uint32_t piece) {
  if (n == 0) return -1;
  if (off == 0) FenceBeforeBulkRead();
  const uint32_t b = min(piece, static_cast<uint32_t>(w.payload_bytes) - off);
  const int s = bulk.Begin(b * static_cast<uint32_t>(n));
  for (int i = 0; i < n; ++i) bulk.LoadPart(s, i * b, ShflPtr(my_row, i) + off, b);
  return s;
}

// ReduceRows through shared memory: piece 0 of the n rows is loading into
// `slot` (BulkPiece); while each piece is summed (same order and roundings
// as ReduceRows) the next one loads into the other slot, and while the last
// is summed, `prefetch()` starts the next token's first piece. n * piece
// fits a slot.
template <typename TY, bool kHasW, typename Prefetch>
__device__ __forceinline__ void ReduceRowsBulk(const CombineWindow& w, int n, const char* my_row,
                                               float my_w, char* out, BulkSlots& bulk, uint32_t piece,
                                               int slot, Prefetch&& prefetch) {
  constexpr int V = Vec16<TY>::N;
  const int lane = LaneId();
  const uint32_t row_bytes = static_cast<uint32_t>(w.payload_bytes);
  const float init = n > 0 ? -0.f : 0.f;
  if (n == 0) {
    prefetch();
    float zero[V];
#pragma unroll
    for (int e = 0; e < V; ++e) zero[e] = init;
    for (uint32_t v = lane; v < row_bytes / 16; v += 32) StNa(reinterpret_cast<uint4*>(out) + v, Vec16<TY>::FromFloat(zero));
    return;
  }
  int s = slot;
  for (uint32_t off = 0; off < row_bytes; off += piece) {
    const uint32_t b = min(piece, row_bytes - off);
    int s_next = -1;
    if (off + piece < row_bytes) s_next = BulkPiece(w, n, my_row, off + piece, bulk, piece);
    else prefetch();
    bulk.Wait(s);
    const char* rows = bulk.Slot(s);
    const int nv = static_cast<int>(b / 16);
    // kSmemUnroll vectors per lane at a time: independent loads and sums,
    // so few warps still keep the SM busy (8 per CTA at BF16 H = 7168).
    for (int base = 0; base < nv; base += 32 * kSmemUnroll) {
      float acc[kSmemUnroll][V];
#pragma unroll
      for (int u = 0; u < kSmemUnroll; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] = init;
      for (int i = 0; i < n; ++i) {
        const float wi = __shfl_sync(kFullMask, my_w, i);
        const uint4* ri = reinterpret_cast<const uint4*>(rows + static_cast<size_t>(i) * b);
        uint4 x[kSmemUnroll];
#pragma unroll
        for (int u = 0; u < kSmemUnroll; ++u) {
          const int v = base + u * 32 + lane;
          x[u] = v < nv ? ri[v] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kSmemUnroll; ++u) AccumulateVec<TY, kHasW>(acc[u], x[u], wi);
      }
#pragma unroll
      for (int u = 0; u < kSmemUnroll; ++u) {
        const int v = base + u * 32 + lane;
        if (v < nv) StNa(reinterpret_cast<uint4*>(out + off) + v, Vec16<TY>::FromFloat(acc[u]));
      }
    }
    s = s_next;
  }
}

}  // namespace
}  // namespace jax_ep
