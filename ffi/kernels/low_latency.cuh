// Low-latency (decode) dispatch / combine as dedicated kernels
// (docs/low_latency.md). Semantics: jax_ep/reference.py low_latency_* (rows
// of local expert l packed from row 0 in (source rank, token, k) order; the
// combine sums w * y per token in ascending (expert, k) order, in f32, with
// explicitly rounded products and sums).
//
// One kernel per op, no barrier (but see `reset` below): senders store
// rows straight into the
// owner's window area for (expert, source rank) and then a count word
// carrying the call's sequence number; receivers wait for the words they
// need and copy the valid rows out. Every area is double-buffered by the
// parity of the call's sequence number, which is what makes a barrier
// unnecessary: a rank writes buffer b of call n + 2 only after it has
// received call n + 1 from every peer, and each peer sent call n + 1 only
// after it had finished reading call n.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <cuda_runtime.h>

#include "common.cuh"

namespace jax_ep {

// Device-local counter slots (comm.h's counters) the kernels own.
constexpr int kLlDispatchSeqCounter = 2;
constexpr int kLlCombineSeqCounter = 3;
constexpr int kLlDispatchSentCounter = 4;  // CTAs done sending (reset by the last)
constexpr int kLlCombineSentCounter = 5;
constexpr int kLlDispatchDoneCounter = 6;  // CTAs done (the last bumps the sequence)
constexpr int kLlCombineDoneCounter = 7;
constexpr int kLlResetCounter = 8;         // 1 while CTA 0's layout reset is done (this kernel)
constexpr int kLlDispatchRecvCounter = 9;  // sequence number of the last dispatch received
constexpr int kLlCombineRecvCounter = 10;
constexpr int kLlLayoutCounter = 11;       // 5 slots: the layout (M, H, K, E, reserved) in use
static_assert(kLlLayoutCounter + 5 <= kCombineScanCounters && kLlDispatchSeqCounter > kDispatchPrepCounter,
              "the low-latency counter slots overlap others (comm.h)");
// 1 when a fused kernel's receive found a peer with another configuration:
// its last CTA then forgets the layout instead of recording it, so that
// every rank's next call resets (and passes the reset's barriers) together.
constexpr int kLlMismatchCounter = kCombineScanDoneCounter + 1;
// Rows per (expert, source) fit the count word's low 16 bits; the high 16
// carry the configuration's digest (config_check.cuh).
constexpr int kLlMaxTokens = 0xffff;

constexpr size_t kLlAlign = 256;

// Where each area sits in every rank's window, from `base_off` on (>= the
// runtime header and the `reserved_bytes` of the normal ops). Per buffer
// b in {0, 1}:
//   dispatch counts  u64 [E_l][R]        (seq << 32 | rows), written by source r
//   dispatch meta    i32 [E_l][R][M]     t * K + k of each row
//   dispatch rows    [E_l][R][M][H * 2]  bf16, or FP8: the e4m3 payload (H bytes)
//                                        then the f32 scales (H/128 of them). One
//                                        stride for both, so calls of either kind
//                                        alternate buffers without overlapping.
//   combine flags    u64 [R]             seq, written by expert owner r
//   combine rows     [M][K][H * 2]       the expert output for (t, k), bf16
// Then, only on a communicator with GIN peers (`gin`), one staging area
// (low_latency_peers.cuh; its puts are flushed before the kernel ends):
//   dispatch counts  u64 [R][E_l]        my count word for (destination d, expert l)
//   dispatch meta    i32 [R][E_l][M]
//   dispatch rows    [R][E_l][M][H * 2]  so one put carries a (d, l) run of rows
//   combine flags    u64 [R]             my flag word for source rank s
//   combine rows     [R][M][K][H * 2]    my expert outputs for source s's (t, k)
// Its offsets come after every area above, so `gin` moves nothing else.
struct LlLayout {
  int R = 0, M = 0, H = 0, K = 0, E_l = 0;
  bool gin = false;
  size_t base_off = 0;
  size_t row_bytes = 0, y_row_bytes = 0;
  size_t disp_counts_bytes = 0, disp_meta_bytes = 0, disp_rows_bytes = 0, disp_buf = 0;
  size_t comb_flags_bytes = 0, comb_rows_bytes = 0, comb_buf = 0;
  size_t stage_comb_rows_bytes = 0;

  static __host__ __device__ size_t Up(size_t n) { return (n + kLlAlign - 1) / kLlAlign * kLlAlign; }

  __host__ __device__ LlLayout(int r, int m, int h, int k, int e_l, size_t base, bool g = false)
      : R(r), M(m), H(h), K(k), E_l(e_l), gin(g), base_off(Up(base)) {
    row_bytes = static_cast<size_t>(H) * 2;
    y_row_bytes = static_cast<size_t>(H) * 2;
    const size_t slots = static_cast<size_t>(E_l) * R;
    disp_counts_bytes = Up(slots * 8);
    disp_meta_bytes = Up(slots * M * 4);
    disp_rows_bytes = Up(slots * M * row_bytes);
    disp_buf = disp_counts_bytes + disp_meta_bytes + disp_rows_bytes;
    comb_flags_bytes = Up(static_cast<size_t>(R) * 8);
    comb_rows_bytes = Up(static_cast<size_t>(M) * K * y_row_bytes);
    comb_buf = comb_flags_bytes + comb_rows_bytes;
    stage_comb_rows_bytes = Up(static_cast<size_t>(R) * M * K * y_row_bytes);
  }

  __host__ __device__ size_t DispCounts(int b) const { return base_off + b * disp_buf; }
  __host__ __device__ size_t DispMeta(int b) const { return DispCounts(b) + disp_counts_bytes; }
  __host__ __device__ size_t DispRows(int b) const { return DispMeta(b) + disp_meta_bytes; }
  __host__ __device__ size_t CombFlags(int b) const { return base_off + 2 * disp_buf + b * comb_buf; }
  __host__ __device__ size_t CombRows(int b) const { return CombFlags(b) + comb_flags_bytes; }
  // The staging area (gin only): a dispatch buffer's size, then combine
  // flags and rows for every source.
  __host__ __device__ size_t StageBase() const { return base_off + 2 * disp_buf + 2 * comb_buf; }
  __host__ __device__ size_t StageDispCounts() const { return StageBase(); }
  __host__ __device__ size_t StageDispMeta() const { return StageDispCounts() + disp_counts_bytes; }
  __host__ __device__ size_t StageDispRows() const { return StageDispMeta() + disp_meta_bytes; }
  __host__ __device__ size_t StageCombFlags() const { return StageBase() + disp_buf; }
  __host__ __device__ size_t StageCombRows() const { return StageCombFlags() + comb_flags_bytes; }
  // Window bytes from the base that the layout needs (the size hint).
  __host__ __device__ size_t End() const {
    return StageBase() + (gin ? disp_buf + comb_flags_bytes + stage_comb_rows_bytes : 0);
  }
};

struct LlDispatchArgs {
  const void* x = nullptr;           // [T, H] bf16
  const int32_t* topk_idx = nullptr; // [T, K]
  int num_tokens = 0;                // T <= M
  int max_tokens = 0;                // M
  int hidden = 0;                    // H (multiple of 128 with FP8, of 8 otherwise)
  int topk = 0;                      // K <= 32
  int num_experts = 0;               // E, E % R == 0
  bool fp8 = false;
  bool ue8m0 = false;
  size_t reserved_bytes = 0;
  void* recv_x = nullptr;            // [E_l, R * M, H] bf16, or e4m3 with fp8
  float* recv_scales = nullptr;      // [E_l, R * M, H / 128] with fp8, else null
  int32_t* recv_count = nullptr;     // [E_l]
  int32_t* src_entry = nullptr;      // [E_l, R * M]: (s * T + t) * K + k, -1 past the count
  unsigned long long* counters = nullptr;  // the device's counters (comm.h)
  int num_blocks = 0;                // 0: every SM
  // The split form (LlPart): the send writes its sequence number here, the
  // receive reads which call it completes from here.
  int32_t* token_out = nullptr;
  const int32_t* token_in = nullptr;
};

// Configurations that differ across ranks (config_check.cuh): each
// sender publishes its OpConfig record (tag: the call's sequence number)
// and puts the record's digest into its count / flag words. A receiver
// reports Cause::kConfigMismatch when a word's digest is not its own, or,
// while it waits for a word that a peer with another layout wrote
// elsewhere, when that peer's record for this call differs. The rows of
// such a call may have landed anywhere in the low-latency area: the
// receive reads none of them (zeros out), and every rank's next call
// resets the layout.
//
// Layout changes. When a sending kernel's layout (M, H, K, E, reserved)
// differs from the one recorded on the device (kLlLayoutCounter), the areas
// moved and old bytes may sit where count words now are: CTA 0 passes a
// barrier (every rank has finished its earlier calls), clears this rank's
// count / flag words of the new layout, and passes a second barrier (no peer
// writes them before they are clear) before anyone sends; the kernel's last
// CTA records the new layout. Every rank runs the same calls, so every rank
// decides alike, and the decision is made on the device, so a CUDA graph
// replays it correctly.

struct LlCombineArgs {
  const void* y = nullptr;              // [E_l, R * M, H] bf16
  const int32_t* src_entry = nullptr;   // [E_l, R * M]
  const int32_t* recv_count = nullptr;  // [E_l]
  const int32_t* topk_idx = nullptr;    // [T, K]
  const float* topk_weights = nullptr;  // [T, K]
  int num_tokens = 0, max_tokens = 0, hidden = 0, topk = 0, num_experts = 0;
  size_t reserved_bytes = 0;
  void* out = nullptr;                  // [T, H] bf16
  unsigned long long* counters = nullptr;
  int num_blocks = 0;
  int32_t* token_out = nullptr;      // as LlDispatchArgs
  const int32_t* token_in = nullptr;
};

// Window bytes (from the base) the low-latency ops need for a config: the
// communicator's size hint must be at least this (jax_ep._window mirrors
// it). `gin`: some peer is reached by GIN (the staging area).
size_t LlWindowBytes(int R, int M, int H, int K, int E, size_t reserved_bytes, bool gin = false);

// "" when the launch can proceed, else a message naming the argument.
std::string ValidateLlDispatch(const LlDispatchArgs& a, const EpPeers& p);
std::string ValidateLlCombine(const LlCombineArgs& a, const EpPeers& p);

// Which part of an op one kernel runs: all of it, or the send (rows and
// count/flag words out; advances the sequence number, which it writes into
// its token) and the receive (waits and copies / reduces the call its token
// names) as two kernels that XLA may separate with other work (*_start /
// *_done). Sends and receives of one op must alternate (start, done, start,
// done): the two buffers cover one call in flight and the next one. A send
// that finds the previous call of its op not yet received, or a layout
// change while a call of either op is pending, reports Cause::kOutOfOrder.
enum class LlPart : int { kFused = 0, kSend = 1, kRecv = 2 };

// Enqueue the op or one part of it (one kernel). Device-side problems
// (expert id outside [-1, E), more than M rows from one source for one
// expert, a peer that never arrives) go to the status word. A receive-only
// dispatch reads no x / topk_idx, a send-only one writes no outputs; a
// send-only combine reads no weights, a receive-only one no y.
cudaError_t LaunchLlDispatch(const LlDispatchArgs& a, const EpPeers& p, int device_sms,
                             cudaStream_t stream, LlPart part = LlPart::kFused);
cudaError_t LaunchLlCombine(const LlCombineArgs& a, const EpPeers& p, int device_sms,
                            cudaStream_t stream, LlPart part = LlPart::kFused);

}  // namespace jax_ep
