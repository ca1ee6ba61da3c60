// FFI targets "jax_ep_fp8_cast_weights" and "jax_ep_fp8_cast_tokens": the
// FP8 casts of the grouped GEMM's training path (kernels/fp8_cast.h).
// Stateless, like the grouped GEMM. Mirrored by jax_ep/_ffi/fp8_cast.py.
//   attrs: num_sms i32 (0: a CTA per 128 x 128 tile; n > 0: at most n SMs)
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/fp8_cast.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_ep fp8 cast: " + msg);
}

bool HighPrecision(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F32;
}

ffi::Error Done(const char* err) {
  return err ? ffi::Error::Internal(std::string("jax_ep fp8 cast: ") + err)
             : ffi::Error::Success();
}

ffi::Error CastWeightsExecute(cudaStream_t stream, int32_t num_sms, ffi::AnyBuffer w,
                              ffi::Result<ffi::AnyBuffer> q_nk, ffi::Result<ffi::AnyBuffer> q_kn,
                              ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  const auto d = w.dimensions();
  if (d.size() != 3 || !HighPrecision(w.element_type())) {
    return Invalid("weights must be [G, H, F] bf16 or f32");
  }
  const int64_t g = d[0], h = d[1], f = d[2];
  if (h % 128 != 0 || f % 128 != 0) return Invalid("H and F must be multiples of 128");
  if (q_nk->element_type() != ffi::DataType::F8E4M3FN ||
      q_kn->element_type() != ffi::DataType::F8E4M3FN ||
      static_cast<int64_t>(q_nk->element_count()) != g * h * f ||
      static_cast<int64_t>(q_kn->element_count()) != g * h * f ||
      static_cast<int64_t>(scales->element_count()) != g * (h / 128) * (f / 128)) {
    return Invalid("outputs must be e4m3 [G, F, H], e4m3 [G, H, F] and f32 [G, H/128, F/128]");
  }
  return Done(LaunchCastWeightsFp8(w.untyped_data(), w.element_type() == ffi::DataType::F32, g,
                                   h, f, static_cast<uint8_t*>(q_nk->untyped_data()),
                                   static_cast<uint8_t*>(q_kn->untyped_data()),
                                   scales->typed_data(), num_sms, stream));
}

ffi::Error CastTokensExecute(cudaStream_t stream, int32_t num_sms, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> chunk_src, ffi::Buffer<ffi::S32> chunk_rows,
                             ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  const auto d = x.dimensions();
  if (d.size() != 2 || !HighPrecision(x.element_type())) {
    return Invalid("x must be [M, C] bf16 or f32");
  }
  const int64_t m = d[0], c = d[1];
  const int64_t chunks = static_cast<int64_t>(chunk_src.element_count());
  const int64_t p = chunks * 128;
  if (c % 128 != 0) return Invalid("C must be a multiple of 128");
  if (static_cast<int64_t>(chunk_rows.element_count()) != chunks) {
    return Invalid("chunk_src and chunk_rows must have one entry per chunk");
  }
  if (qt->element_type() != ffi::DataType::F8E4M3FN ||
      static_cast<int64_t>(qt->element_count()) != c * p ||
      static_cast<int64_t>(scales->element_count()) != chunks * c) {
    return Invalid("outputs must be e4m3 [C, P] and f32 [P/128, C]");
  }
  if (m == 0 && chunks > 0) {
    // No rows to read: every chunk is zeros (chunk_rows must say 0).
    cudaError_t e = cudaMemsetAsync(qt->untyped_data(), 0, qt->size_bytes(), stream);
    if (e != cudaSuccess) return Done(cudaGetErrorString(e));
  }
  return Done(LaunchCastTokensFp8(x.untyped_data(), x.element_type() == ffi::DataType::F32, c,
                                  m == 0 ? 0 : p, chunk_src.typed_data(), chunk_rows.typed_data(),
                                  static_cast<uint8_t*>(qt->untyped_data()),
                                  scales->typed_data(), num_sms, stream));
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpFp8CastWeightsExecute, jax_ep::CastWeightsExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpFp8CastTokensExecute, jax_ep::CastTokensExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
