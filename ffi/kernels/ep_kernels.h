// Host-side launchers of the normal (high-throughput) dispatch and combine.
// Semantics: docs/design.md §2 and jax_ep/reference.py (bitwise for dispatch, same
// f32 order for combine). Window layout: window_layout.h.
//
// Both ops are a short sequence of kernels on one stream (a kernel boundary
// is the grid barrier; a few µs each):
//   dispatch: setup, one launch of two roles: prep blocks (pos_in_rank,
//             per-expert ranks) beside the control block (zero chunk
//             counters, start barrier, then, once the prep blocks are done,
//             counts exchange, barrier, offsets, capacity) -> data (sending CTAs push rows
//             into peers' windows and local rows to the outputs; receiving
//             CTAs copy each chunk of window rows to the outputs as soon as
//             its count is complete).
//   combine:  start (zero chunk counters, check the handle, publish ok,
//             barrier) -> data (sending CTAs push rows back to their source's
//             window; reducing CTAs sum each token once its chunks are in).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <cuda_runtime.h>

#include "common.cuh"

namespace jax_ep {

enum class EpLayout : int { kRank = 0, kExpert = 1 };
enum class EpDtype : int { kBF16 = 0, kF16 = 1, kF32 = 2, kFp8E4m3 = 3 };

int EpDtypeBytes(EpDtype d);
struct DispatchArgs {
  // Inputs (this rank's tokens).
  const void* x = nullptr;             // [T, H] of x_dtype
  const float* x_scales = nullptr;     // [T, H/128] when x_dtype is FP8, else null
  const int32_t* topk_idx = nullptr;   // [T, K]
  const float* topk_weights = nullptr; // [T, K]
  EpDtype x_dtype = EpDtype::kBF16;
  bool cast_fp8 = false;               // quantise x (bf16/f16/f32) to e4m3 in the kernel
  bool ue8m0 = false;                  // power-of-two scales (cast_fp8 only)
  int num_tokens = 0;                  // T (may be 0)
  int hidden = 0;                      // H
  int topk = 0;                        // K (1..32)
  int num_experts = 0;                 // E (E % R == 0, E/R <= 1024)
  int capacity = 0;                    // C >= 1
  int expert_alignment = 1;
  EpLayout layout = EpLayout::kRank;
  int num_sms = 0;                     // CTAs of each kernel, at most; 0 = the bandwidth model
  int recv_sms = 0;                    // of the data kernel's, receiving; 0 = the model's share
  bool start = false;                  // dispatch_start: on the side stream, beside compute
  // Outputs.
  void* recv_x = nullptr;              // [C, H] (e4m3 when FP8)
  float* recv_scales = nullptr;        // [C, H/128] when FP8 (input or cast), else null
  int32_t* recv_topk_idx = nullptr;    // rank: [C, K]; expert: [C]
  float* recv_topk_weights = nullptr;  // rank: [C, K]; expert: [C]
  int32_t* counts = nullptr;           // rank: [R]; expert: group_sizes [E_l]
  int32_t* pos_in_rank = nullptr;      // [T, R]
  int32_t* recv_src_rank = nullptr;    // [C]
  int32_t* recv_src_token = nullptr;   // [C]
  int32_t* recv_src_k = nullptr;       // [C]
  int32_t* recv_counts = nullptr;      // [R]
};

struct CombineArgs {
  const void* y = nullptr;                // [C, H] of y_dtype (bf16/f16/f32)
  const float* weights = nullptr;         // [C] or null (= plain sum)
  const int32_t* topk_idx = nullptr;      // [T, K] handle.topk_idx
  const int32_t* pos_in_rank = nullptr;   // [T, R]
  const int32_t* recv_src_rank = nullptr; // [C]
  const int32_t* recv_src_token = nullptr;// [C]
  const int32_t* recv_src_k = nullptr;    // [C]
  const int32_t* recv_counts = nullptr;   // [R]
  EpDtype y_dtype = EpDtype::kBF16;
  int num_tokens = 0;                     // T
  int hidden = 0;                         // H
  int topk = 0;                           // K
  int num_experts = 0;                    // E
  int capacity = 0;                       // C
  EpLayout layout = EpLayout::kRank;
  int num_sms = 0;                        // CTAs of each kernel, at most; 0 = the bandwidth model
  int recv_sms = 0;                       // reducers among num_sms; 0 = the model's share
  bool start = false;                     // combine_start: on the side stream, beside compute
  void* out = nullptr;                    // [T, H] of y_dtype
};

// "" when the launch can proceed, else a message naming the argument.
std::string ValidateDispatch(const DispatchArgs& a, const EpPeers& p);
std::string ValidateCombine(const CombineArgs& a, const EpPeers& p);

// Enqueues the whole op on `stream`. Device-side errors go to the status word.
// The rank barriers each op's kernels pass (also when the first fails): what
// a refusing rank stands in for (abort.h).
constexpr int kDispatchBarriers = 2;
constexpr int kCombineBarriers = 1;

cudaError_t LaunchDispatch(const DispatchArgs& a, const EpPeers& p, cudaStream_t stream);
cudaError_t LaunchCombine(const CombineArgs& a, const EpPeers& p, cudaStream_t stream);

// Bytes (from the window base, header included) that one config needs; the
// communicator's size hint should be at least this (window_layout.h).
size_t DispatchWindowBytes(int R, int T, int H, int K, int E, EpDtype payload, bool fp8_scales);
// What one dispatch writes, from the window base (ValidateDispatch's need).
size_t DispatchWindowNeed(const DispatchArgs& a, int R);
size_t CombineWindowBytes(int R, int T, int H, int K, EpDtype y, EpLayout layout);

}  // namespace jax_ep
