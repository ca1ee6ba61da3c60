// The FP8 casts of the grouped GEMM's training path (fp8_cast.h): one pass
// over the high-precision tensor each, written in the layouts the FP8
// tensor cores read (K-major), so no transpose or regroup runs through HBM
// afterwards. Steps bit for bit those of jax_ep/fp8.py (fp8.cuh), except
// that a NaN stays NaN (as jnp.clip keeps it) instead of being clamped.
//
// Both kernels work on 128 x 128 tiles with 256 threads: warp w owns the
// tile's columns [16w, 16w + 16), lane l its rows [4l, 4l + 4). A thread
// packs the 4 rows of one column into a 32-bit word, so the transposed tile
// goes through shared memory as words (rows padded to 33 words: conflict
// free both ways) and leaves as 16-byte rows.
#include "kernels/fp8_cast.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/fp8.cuh"

namespace jax_ep {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kPadWords = kTile / 4 + 1;

__device__ __forceinline__ uint32_t QuantizeKeepNan(float x, float inv_s) {
  // SATFINITE clamps finite values and infinities to +-448, as the clip of
  // the reference does, and keeps NaN.
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(__fmul_rn(x, inv_s), __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__device__ __forceinline__ void Load16(const T* p, float (&v)[16]);

template <>
__device__ __forceinline__ void Load16<__nv_bfloat16>(const __nv_bfloat16* p, float (&v)[16]) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
  uint4 a = q[0], b = q[1];
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* k = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    float2 g = __bfloat1622float2(k[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
    v[8 + 2 * i] = g.x;
    v[8 + 2 * i + 1] = g.y;
  }
}

template <>
__device__ __forceinline__ void Load16<float>(const float* p, float (&v)[16]) {
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float4 f = q[i];
    v[4 * i] = f.x;
    v[4 * i + 1] = f.y;
    v[4 * i + 2] = f.z;
    v[4 * i + 3] = f.w;
  }
}

// Max of |v| that keeps a NaN (fmaxf would drop it).
__device__ __forceinline__ float AbsMaxNan(float a, float b) {
  float m = fmaxf(a, fabsf(b));
  return (b != b || a != a) ? __int_as_float(0x7fffffff) : m;
}

// 16 consecutive elements of T kept as loaded: 2 (bf16) or 4 (f32) 16-byte
// words, widened to float when needed (fewer registers than 16 floats).
template <typename T>
struct Raw16 {
  static constexpr int kWords = 16 * sizeof(T) / 16;
  uint4 w[kWords];
  __device__ __forceinline__ void Load(const T* p) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = q[i];
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void ToFloat(float (&v)[16]) const {
    Load16(reinterpret_cast<const T*>(w), v);
  }
};

// Writes the transposed tile: word [c][r/4] of `tile` holds rows r..r+3 of
// column c; row c of the output (128 bytes) at out + c * ld.
__device__ __forceinline__ void StoreTransposed(const uint32_t (*tile)[kPadWords], uint8_t* out,
                                                int64_t ld) {
  const int c = threadIdx.x / 2, half = threadIdx.x % 2;
  uint32_t w[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) w[j] = tile[c][half * 16 + j];
  uint4* dst = reinterpret_cast<uint4*>(out + c * ld + half * 64);
#pragma unroll
  for (int j = 0; j < 4; ++j) dst[j] = make_uint4(w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]);
}

// One 128 x 128 block of w[g] (rows h, columns f): its scale, the block in
// w's own orientation (q_kn, for the data gradient) and transposed (q_nk,
// for the forward product).
template <typename T>
__device__ __forceinline__ void CastWeightBlock(const T* w, int64_t H, int64_t F, uint8_t* q_nk,
                                                uint8_t* q_kn, float* scales, int fb, int hb,
                                                int64_t g, uint32_t (*tile)[kPadWords],
                                                float* warp_max) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = g * H * F + (hb * kTile) * F + fb * kTile;
  Raw16<T> raw[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) raw[r].Load(w + base + (4 * lane + r) * F + 16 * warp);
  float amax = 0.0f;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float v[16];
    raw[r].ToFloat(v);
#pragma unroll
    for (int j = 0; j < 16; ++j) amax = AbsMaxNan(amax, v[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) amax = AbsMaxNan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) warp_max[warp] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int i = 1; i < kThreads / 32; ++i) amax = AbsMaxNan(amax, warp_max[i]);
  // A NaN in the block makes its scale NaN, as jnp.maximum does.
  const float s = amax != amax ? amax : Fp8Scale(amax, false);
  const float inv = __fdiv_rn(1.0f, s);
  if (threadIdx.x == 0) scales[(g * (H / kTile) + hb) * (F / kTile) + fb] = s;
  uint32_t col[16] = {};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float v[16];
    raw[r].ToFloat(v);
    uint32_t row[4] = {};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t b = QuantizeKeepNan(v[j], inv);
      row[j / 4] |= b << (8 * (j % 4));
      col[j] |= b << (8 * r);
    }
    *reinterpret_cast<uint4*>(q_kn + base + (4 * lane + r) * F + 16 * warp) =
        make_uint4(row[0], row[1], row[2], row[3]);
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) tile[16 * warp + j][lane] = col[j];
  __syncthreads();
  StoreTransposed(tile, q_nk + g * F * H + (fb * kTile) * H + hb * kTile, H);
}

// The blocks of every group, a CTA per block or, with fewer CTAs (the op's
// num_sms), each CTA taking every gridDim.x-th block.
template <typename T>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 2)
    CastWeightBlocks(const T* w, int64_t groups, int64_t H, int64_t F, uint8_t* q_nk,
                     uint8_t* q_kn, float* scales) {
  __shared__ uint32_t tile[kTile][kPadWords];
  __shared__ float warp_max[kThreads / 32];
  const int64_t nf = F / kTile, nh = H / kTile;
  for (int64_t b = blockIdx.x; b < groups * nh * nf; b += gridDim.x) {
    CastWeightBlock(w, H, F, q_nk, q_kn, scales, static_cast<int>(b % nf),
                    static_cast<int>(b / nf % nh), b / (nf * nh), tile, warp_max);
    __syncthreads();  // the next block reuses `tile` and `warp_max`
  }
}


// One (128-token chunk, 128 channels) tile of x [M, C]: the chunk's rows
// are x[src, src + n) (rows past n are zeros), its scales one per channel
// over those tokens, its e4m3 bytes written transposed into qT [C, P] at
// columns [128 c, 128 c + 128). The tile stays in registers as loaded and
// is widened twice (amax, cast), so that three tiles fit an SM.
template <typename T>
__device__ __forceinline__ void CastTokenChunk(const T* x, int64_t C, int64_t P,
                                               const int32_t* chunk_src, const int32_t* chunk_rows,
                                               uint8_t* qt, float* scales, int chunk, int cb,
                                               uint32_t (*tile)[kPadWords]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int src = chunk_src[chunk];
  int n = chunk_rows[chunk];
  n = n < 0 ? 0 : (n > kTile ? kTile : n);
  Raw16<T> raw[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int t = 4 * lane + r;
    if (t < n) {
      raw[r].Load(x + (static_cast<int64_t>(src) + t) * C + cb * kTile + 16 * warp);
    } else {
      raw[r].Zero();
    }
  }
  // Per column (channel): the max over the warp's 32 lanes x 4 rows.
  float inv[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) inv[j] = 0.0f;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float v[16];
    raw[r].ToFloat(v);
#pragma unroll
    for (int j = 0; j < 16; ++j) inv[j] = AbsMaxNan(inv[j], v[j]);
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    float m = inv[j];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = AbsMaxNan(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = m != m ? m : Fp8Scale(m, false);
    inv[j] = __fdiv_rn(1.0f, s);
    if (lane == j) scales[static_cast<int64_t>(chunk) * C + cb * kTile + 16 * warp + j] = s;
  }
  uint32_t col[16] = {};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float v[16];
    raw[r].ToFloat(v);
#pragma unroll
    for (int j = 0; j < 16; ++j) col[j] |= QuantizeKeepNan(v[j], inv[j]) << (8 * r);
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) tile[16 * warp + j][lane] = col[j];
  __syncthreads();
  StoreTransposed(tile, qt + (cb * kTile) * P + static_cast<int64_t>(chunk) * kTile, P);
}

// Every (chunk, 128 channels) tile, a CTA per tile or, with fewer CTAs (the
// op's num_sms), each CTA taking every gridDim.x-th tile.
template <typename T>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 3 : 2)
    CastTokenChunks(const T* x, int64_t C, int64_t P, const int32_t* chunk_src,
                    const int32_t* chunk_rows, uint8_t* qt, float* scales) {
  __shared__ uint32_t tile[kTile][kPadWords];
  const int64_t nc = P / kTile;
  for (int64_t b = blockIdx.x; b < nc * (C / kTile); b += gridDim.x) {
    CastTokenChunk(x, C, P, chunk_src, chunk_rows, qt, scales, static_cast<int>(b % nc),
                   static_cast<int>(b / nc), tile);
    __syncthreads();  // the next tile reuses `tile`
  }
}

// A CTA per tile, or `num_sms` > 0 of them at most.
int CastBlocks(int64_t tiles, int num_sms) {
  const int64_t cap = num_sms > 0 ? num_sms : int64_t{1} << 30;
  return static_cast<int>(tiles < cap ? tiles : cap);
}

}  // namespace

const char* LaunchCastWeightsFp8(const void* w, bool f32, int64_t groups, int64_t h, int64_t f,
                                 uint8_t* q_nk, uint8_t* q_kn, float* scales, int num_sms,
                                 cudaStream_t stream) {
  if (groups == 0 || h == 0 || f == 0) return nullptr;
  const int grid = CastBlocks(groups * (h / kTile) * (f / kTile), num_sms);
  if (f32) {
    CastWeightBlocks<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(w), groups,
                                                           h, f, q_nk, q_kn, scales);
  } else {
    CastWeightBlocks<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(w), groups, h, f, q_nk, q_kn, scales);
  }
  return cudaGetLastError() == cudaSuccess ? nullptr : "FP8 weight cast launch failed";
}

const char* LaunchCastTokensFp8(const void* x, bool f32, int64_t c, int64_t p,
                                const int32_t* chunk_src, const int32_t* chunk_rows, uint8_t* qt,
                                float* scales, int num_sms, cudaStream_t stream) {
  if (p == 0 || c == 0) return nullptr;
  const int grid = CastBlocks((p / kTile) * (c / kTile), num_sms);
  if (f32) {
    CastTokenChunks<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), c, p,
                                                          chunk_src, chunk_rows, qt, scales);
  } else {
    CastTokenChunks<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(x), c, p, chunk_src, chunk_rows, qt, scales);
  }
  return cudaGetLastError() == cudaSuccess ? nullptr : "FP8 token cast launch failed";
}

}  // namespace jax_ep
