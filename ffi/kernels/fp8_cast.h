// FP8 casts for the grouped GEMM's training path, straight into the
// layouts its FP8 instances read (grouped_gemm.h), so that no transpose or
// regroup of the e4m3 bytes runs through HBM afterwards.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace jax_ep {

// w [G, H, F] (bf16, or f32 when `f32`) -> per 128 x 128 block one scale
// scales [G, H/128, F/128], and the e4m3 bytes twice: q_nk [G, F, H] (the
// forward's K-major weights) and q_kn [G, H, F] (the data gradient's).
// H and F multiples of 128. num_sms > 0: at most that many CTAs (SMs);
// 0: one per 128 x 128 block.
const char* LaunchCastWeightsFp8(const void* w, bool f32, int64_t groups, int64_t h, int64_t f,
                                 uint8_t* q_nk, uint8_t* q_kn, float* scales, int num_sms,
                                 cudaStream_t stream);

// x [M, C] -> qT [C, P] e4m3 and scales [P/128, C]: chunk k of the padded
// token axis holds rows x[chunk_src[k], chunk_src[k] + chunk_rows[k]) then
// zeros, scaled per (channel, chunk). C and P multiples of 128. num_sms:
// as for the weights (0: one CTA per tile).
const char* LaunchCastTokensFp8(const void* x, bool f32, int64_t c, int64_t p,
                                const int32_t* chunk_src, const int32_t* chunk_rows, uint8_t* qt,
                                float* scales, int num_sms, cudaStream_t stream);

}  // namespace jax_ep
