// Host interface of the grouped GEMM (docs/grouped_gemm.md): contiguous row
// groups of an expert layout times one weight matrix per group, on Hopper
// tensor cores (CUTLASS ptr-array grouped kernels). Group sizes are read on
// the device by a small prep kernel that writes the per-group problem shapes,
// pointers and strides; the host never learns them.
//
// Only this header is seen by the FFI handler; CUTLASS is confined to the
// grouped_gemm_*.cu instance files (one per operand arrangement), so the
// handler and the rest of the build stay light.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace jax_ep {

// Which product, in the row-major storage the JAX side uses. M_g is the
// number of rows of group g; H, F the weight's two dims.
enum class GgKind : int {
  // out[rows_g, F] = x[rows_g, H] @ w[g][H, F]          (forward)
  kForward = 0,
  // out[rows_g, H] = dy[rows_g, F] @ w[g][H, F]^T       (dx)
  kTransW = 1,
  // out[g][H, F] = x[rows_g, H]^T @ dy[rows_g, F]       (dw)
  kWeightGrad = 2,
  // out[rows_g, F] = (xq * xs)[rows_g, H] @ ((wq * ws)[g][F, H])^T: FP8 e4m3
  // operands, f32 scales per (row, 128 channels) of x and per 128 x 128
  // block of w, applied to the f32 accumulators (no dequantised copy).
  kForwardFp8 = 3,
  // out[g][H, F] = (xT * xs)[H, K_g] @ ((dyT * dys)[F, K_g])^T: the FP8
  // weight gradient over group g's tokens (K_g, a multiple of 128), both
  // operands transposed and scaled per (channel, 128 tokens).
  kWeightGradFp8 = 4,
};

enum class GgOut : int { kBF16 = 0, kF32 = 1 };

struct GroupedGemmArgs {
  GgKind kind = GgKind::kForward;
  GgOut out_dtype = GgOut::kBF16;
  // kForward: a = x [rows, H], b = w [G, H, F], out [rows, F]
  // kTransW:  a = dy [rows, F], b = w [G, H, F], out [rows, H]
  // kWeightGrad: a = x [rows, H], b = dy [rows, F], out [G, H, F]
  // kForwardFp8: a = xq [rows, H] e4m3, b = wq [G, F, H] e4m3 (K-major, as
  //   FP8 wgmma needs), out [rows, F]; a_scales [rows, H/128] (x's scales as
  //   quantize/dispatch give them); b_scales [G, H/128, F/128].
  // kWeightGradFp8: a = xT [H, rows] e4m3, b = dyT [F, rows] e4m3 (rows = the
  //   padded token axis, each group starting on a 128-token chunk),
  //   a_scales [rows/128, H], b_scales [rows/128, F]; out [G, H, F] bf16;
  //   group_sizes are the groups' padded sizes.
  const void* a = nullptr;
  const void* b = nullptr;
  const float* a_scales = nullptr;
  const float* b_scales = nullptr;
  void* out = nullptr;
  const int32_t* group_sizes = nullptr;  // [G], on the device
  int num_groups = 0;
  int64_t rows = 0;  // rows of a (and of b for kWeightGrad)
  int64_t h = 0;
  int64_t f = 0;
  // 0: groups are contiguous, group g starting at sum(sizes[:g]).
  // > 0: masked form, group g occupies rows [g*group_stride, g*group_stride +
  //      min(sizes[g], group_stride)) of a (and of out for row outputs).
  int64_t group_stride = 0;
  int num_sms = 0;  // 0: all of the device's
  // kForwardFp8: 0 cooperative 128-row tiles (contiguous groups), 1
  // pingpong 64-row tiles (the masked decode grid).
  int schedule = 0;
};

// Bytes of device scratch one call needs: the per-group arrays plus
// CUTLASS's own workspace (tensor maps per SM). Reads kind, out_dtype and
// num_groups.
size_t GroupedGemmScratchBytes(const GroupedGemmArgs& args, int device_sms);

// Enqueues the whole op on `stream`: prep, the grouped kernel, and the zero
// fills the contract asks for (row outputs past the last group in the
// contiguous form; weight-gradient groups with no rows). `scratch` holds
// GroupedGemmScratchBytes(args, device_sms) bytes, 256-aligned (the caller
// checks). Returns a message on failure (nullptr on success); the message is
// static storage.
const char* LaunchGroupedGemm(const GroupedGemmArgs& args, void* scratch, int device_sms,
                              cudaStream_t stream);

// One instance per (kind, out dtype); defined in grouped_gemm_<kind>.cu.
size_t GgScratchForward(const GroupedGemmArgs&, int sms);
size_t GgScratchTransW(const GroupedGemmArgs&, int sms);
size_t GgScratchWeightGrad(const GroupedGemmArgs&, int sms);
size_t GgScratchForwardFp8(const GroupedGemmArgs&, int sms);
size_t GgScratchForwardFp8Pingpong(const GroupedGemmArgs&, int sms);
size_t GgScratchWeightGradFp8(const GroupedGemmArgs&, int sms);
const char* GgRunForward(const GroupedGemmArgs&, void*, int, cudaStream_t);
const char* GgRunTransW(const GroupedGemmArgs&, void*, int, cudaStream_t);
const char* GgRunWeightGrad(const GroupedGemmArgs&, void*, int, cudaStream_t);
const char* GgRunForwardFp8(const GroupedGemmArgs&, void*, int, cudaStream_t);
const char* GgRunForwardFp8Pingpong(const GroupedGemmArgs&, void*, int, cudaStream_t);
const char* GgRunWeightGradFp8(const GroupedGemmArgs&, void*, int, cudaStream_t);

}  // namespace jax_ep
