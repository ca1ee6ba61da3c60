// A 16-byte vector of bf16 / f16 / f32 elements <-> floats: the unit every
// kernel loads and stores (8 or 4 channels). Conversions round to nearest
// even, so kernels and the float32 reference agree bit for bit.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace jax_ep {

template <typename T> struct Vec16;

template <> struct Vec16<__nv_bfloat16> {
  static constexpr int N = 8;
  // bf16 is the top half of an f32: one shift or one mask per element
  // (__bfloat1622float2 spends a byte permute and a multiply on the high
  // one; the reducers of combine issue ~4 instructions per element, so
  // this is an eighth of them). Exact, NaN payloads included.
  __device__ __forceinline__ static void ToFloat(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static uint4 FromFloat(const float* f) {
    uint4 v;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

template <> struct Vec16<__half> {
  static constexpr int N = 8;
  __device__ __forceinline__ static void ToFloat(const uint4& v, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 q = __half22float2(h[i]);
      f[2 * i] = q.x;
      f[2 * i + 1] = q.y;
    }
  }
  __device__ __forceinline__ static uint4 FromFloat(const float* f) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

template <> struct Vec16<float> {
  static constexpr int N = 4;
  __device__ __forceinline__ static void ToFloat(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 FromFloat(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
};

}  // namespace jax_ep
