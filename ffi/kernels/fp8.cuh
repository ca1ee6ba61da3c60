// Per-token, per-128-channel FP8 (e4m3) quantisation, bit-for-bit the steps of
// jax_ep/fp8.py: amax = max|x| (f32); s = max(amax, 1e-4) * float32(1/448);
// UE8M0: s rounded up to a power of two from its bits; inv = 1 / s (IEEE);
// q = e4m3_rn(clamp(x * inv, -448, 448)). XLA rewrites a division by a
// broadcast value into a product with its reciprocal, so the reference is
// defined in that form and the kernel follows it (explicit _rn intrinsics,
// so nothing is contracted into an FMA).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "vec16.cuh"

namespace jax_ep {

constexpr int kFp8Block = 128;
constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

__device__ __forceinline__ float Ue8m0RoundUp(float s) {
  uint32_t bits = __float_as_uint(s);
  uint32_t exp = bits & 0x7F800000u;
  if (bits & 0x007FFFFFu) exp += 0x00800000u;
  return __uint_as_float(exp);
}

__device__ __forceinline__ float Fp8Scale(float amax, bool ue8m0) {
  constexpr float kInvE4m3Max = 1.0f / 448.0f;  // rounded to float32, as in fp8.py
  float s = __fmul_rn(fmaxf(amax, kAmaxFloor), kInvE4m3Max);
  return ue8m0 ? Ue8m0RoundUp(s) : s;
}

// Callers pass inv_s = __fdiv_rn(1.0f, s) (one division per 128 channels).
__device__ __forceinline__ uint8_t Fp8Quantize(float x, float inv_s) {
  float v = __fmul_rn(x, inv_s);
  v = fminf(fmaxf(v, -kE4m3Max), kE4m3Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace jax_ep
