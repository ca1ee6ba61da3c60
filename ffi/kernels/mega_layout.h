// Where the fused MoE (docs/mega_moe.md) puts its data in every rank's
// window, from `base_off` on (at or above the runtime header and the
// `reserved_bytes` of the other ops), each area on a 256-byte boundary:
//   tokens   e4m3 [T][H]        my tokens cast to FP8, read by the peers' linear 1
//   scales   f32  [T][H/128]    their per-token, per-128-channel scales
//   counts   i32  [R][E_l]      [s][e]: how many of source s's tokens chose my expert e
//   lists    i32  [R][E_l][T]   [s][e][i]: source s's i-th token for my expert e,
//                               in source token order
//   ready    u64  [R]           [s]: source s's sequence number once its counts
//                               and lists are here (or its refusal)
//   slots    bf16 [T][K][H]     [t][k]: expert output for my token t's k-th choice,
//                               written by the expert's owner
//   arrivals u32  [T]           [t]: slots of token t written so far
// jax_ep._window.mega_moe_bytes mirrors MegaWindow::End (tests/test_window_bytes.py).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_ep {

struct MegaWindow {
  static constexpr size_t kAlign = 256;
  size_t tokens, scales, counts, lists, ready, slots, arrivals, end;

  static constexpr size_t Up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  // R ranks, T tokens per rank at most, H channels (a multiple of 128), top-K,
  // E experts in all (E_l = E / R per rank).
  static MegaWindow At(size_t base_off, int R, int T, int H, int K, int E) {
    const size_t r = size_t(R), t = size_t(T), h = size_t(H), k = size_t(K);
    const size_t e_l = size_t(E) / (r ? r : 1);
    MegaWindow w{};
    w.tokens = Up(base_off);
    w.scales = w.tokens + Up(t * h);
    w.counts = w.scales + Up(4 * t * (h / 128));
    w.lists = w.counts + Up(4 * r * e_l);
    w.ready = w.lists + Up(4 * r * e_l * t);
    w.slots = w.ready + Up(8 * r);
    w.arrivals = w.slots + Up(2 * t * k * h);
    w.end = w.arrivals + Up(4 * t);
    return w;
  }
};

}  // namespace jax_ep
