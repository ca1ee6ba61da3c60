// Per-token, per-128-channel FP8 (e4m3) quantisation, bit-for-bit the steps of
// jax_ep/fp8.py: amax = max|x| (f32); s = max(amax, 1e-4) * float32(1/448);
// UE8M0: s rounded up to a power of two from its bits; inv = 1 / s (IEEE);
// q = e4m3_rn(clamp(x * inv, -448, 448)). XLA rewrites a division by a
// broadcast value into a product with its reciprocal, so the reference is
// defined in that form and the kernel follows it (explicit _rn intrinsics,
// so nothing is contracted into an FMA).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
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

// The e4m3 bytes of one 16-byte vector of TIn channels: 8 (bf16/f16) in a
// uint2, 4 (f32) in a uint32_t.
template <typename TIn>
using Fp8Vec = typename std::conditional<Vec16<TIn>::N == 8, uint2, uint32_t>::type;

// One lane's 16-byte vector `v` of channels -> its e4m3 bytes (returned) and
// the scale `s` of its 128-channel block. The kFp8Block / N consecutive lanes of
// a block reduce their amax together, so every lane of the warp calls this
// with a whole number of blocks in flight (lanes past the row pass zeros).
template <typename TIn>
__device__ __forceinline__ Fp8Vec<TIn> CastVec16Fp8(const uint4& v, bool ue8m0, float& s) {
  constexpr int V = Vec16<TIn>::N;   // channels per 16-byte load
  constexpr int LPB = kFp8Block / V; // lanes per 128-channel block
  float f[V];
  Vec16<TIn>::ToFloat(v, f);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int off = LPB / 2; off >= 1; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  s = Fp8Scale(amax, ue8m0);
  const float inv = __fdiv_rn(1.0f, s);  // as jax_ep/fp8.py: q = x * (1 / s)
  uint8_t b[V];
#pragma unroll
  for (int i = 0; i < V; ++i) b[i] = Fp8Quantize(f[i], inv);
  Fp8Vec<TIn> q;
  memcpy(&q, b, sizeof(q));
  return q;
}

}  // namespace jax_ep
