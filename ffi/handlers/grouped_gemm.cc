// FFI target "jax_ep_grouped_gemm": the expert GEMMs (docs/grouped_gemm.md).
// Stateless: no communicator, only the stream and the buffers. The per-group
// arrays and CUTLASS's workspace live in a second output that Python sizes
// with grouped_gemm_workspace_bytes (XLA's FFI scratch allocator gave
// nothing under jax 0.11.2's PjRt on the GPU machine).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kernels/grouped_gemm.h"
#include "kernels/launch_policy.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_ep grouped_matmul: " + msg);
}

// The checks of rows, H and F (set in g) that both targets share, and the
// masked form's slot size: a is [G, S, .] with S = group_stride, or flat (0).
ffi::Error SetSizesAndStride(GroupedGemmArgs& g, int64_t group_stride) {
  if (g.rows >= (int64_t{1} << 31) || g.h >= (int64_t{1} << 31) || g.f >= (int64_t{1} << 31)) {
    return Invalid("dimensions must be below 2^31");
  }
  if (group_stride < 0 || (group_stride > 0 && group_stride * g.num_groups != g.rows)) {
    return Invalid("masked form: lhs must be [G, S, .] with S = group_stride");
  }
  g.group_stride = group_stride;
  return ffi::Error::Success();
}

// The part every grouped GEMM call shares: SM count, workspace check, launch.
ffi::Error Launch(const GroupedGemmArgs& g, cudaStream_t stream, int32_t device_ordinal,
                  int32_t num_sms, ffi::AnyBuffer workspace) {
  int sms = DeviceSms(device_ordinal);
  if (sms <= 0) return ffi::Error::Internal("jax_ep grouped_matmul: cannot read the SM count");
  if (num_sms > 0 && num_sms < sms) sms = num_sms;
  const size_t need = GroupedGemmScratchBytes(g, sms);
  if (workspace.size_bytes() < need) {
    return Invalid("workspace of " + std::to_string(workspace.size_bytes()) +
                   " bytes, the call needs " + std::to_string(need));
  }
  if (const char* err = LaunchGroupedGemm(g, workspace.untyped_data(), sms, stream)) {
    return ffi::Error::Internal(std::string("jax_ep grouped_matmul: ") + err);
  }
  return ffi::Error::Success();
}

// a, b, out as grouped_gemm.h describes per kind. `a` may carry a leading
// group axis (masked form: [G, S, .]); the handler sees its rows flat.
ffi::Error GroupedGemmExecute(cudaStream_t stream, int32_t device_ordinal,
                              int32_t kind, int64_t group_stride, int32_t num_sms,
                              ffi::AnyBuffer a, ffi::AnyBuffer b,
                              ffi::Buffer<ffi::S32> group_sizes,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  if (a.element_type() != ffi::DataType::BF16 || b.element_type() != ffi::DataType::BF16) {
    return Invalid("operands must be bf16");
  }
  GroupedGemmArgs g;
  if (kind < 0 || kind > 2) return Invalid("unknown bf16 kind " + std::to_string(kind));
  g.kind = static_cast<GgKind>(kind);
  const ffi::DataType od = out->element_type();
  if (od != ffi::DataType::BF16 && !(od == ffi::DataType::F32 && g.kind == GgKind::kForward)) {
    return Invalid("output must be bf16 (or f32 for the forward product)");
  }
  g.out_dtype = od == ffi::DataType::F32 ? GgOut::kF32 : GgOut::kBF16;
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (ad.size() < 2) return Invalid("lhs must have rank >= 2");
  g.num_groups = static_cast<int>(group_sizes.element_count());
  g.rows = static_cast<int64_t>(a.element_count()) / ad.back();
  switch (g.kind) {
    case GgKind::kForward:
    case GgKind::kTransW:
      if (bd.size() != 3 || bd[0] != g.num_groups) return Invalid("rhs must be [G, H, F]");
      g.h = bd[1];
      g.f = bd[2];
      if (ad.back() != (g.kind == GgKind::kForward ? g.h : g.f)) {
        return Invalid("lhs width does not match the weights");
      }
      break;
    case GgKind::kWeightGrad:
      if (bd.size() < 2 || static_cast<int64_t>(b.element_count()) / bd.back() != g.rows) {
        return Invalid("weight gradient: x and dy must have the same rows");
      }
      g.h = ad.back();
      g.f = bd.back();
      break;
  }
  if (g.h % 8 != 0 || g.f % 8 != 0) return Invalid("H and F must be multiples of 8");
  if (ffi::Error err = SetSizesAndStride(g, group_stride); err.failure()) return err;
  const int64_t out_elems = g.kind == GgKind::kWeightGrad ? g.num_groups * g.h * g.f
                            : g.rows * (g.kind == GgKind::kForward ? g.f : g.h);
  if (static_cast<int64_t>(out->element_count()) != out_elems) {
    return Invalid("output shape does not match the operands");
  }
  g.a = a.untyped_data();
  g.b = b.untyped_data();
  g.out = out->untyped_data();
  g.group_sizes = group_sizes.typed_data();
  if (out_elems == 0) return ffi::Error::Success();
  if (g.num_groups == 0) {
    cudaError_t err = cudaMemsetAsync(g.out, 0, out->size_bytes(), stream);
    return err == cudaSuccess ? ffi::Error::Success()
                              : ffi::Error::Internal(std::string("jax_ep grouped_matmul: ") +
                                                     cudaGetErrorString(err));
  }
  return Launch(g, stream, device_ordinal, num_sms, *workspace);
}

// The FP8 products (GroupedGemmArgs in grouped_gemm.h has the layouts).
// kForwardFp8: xq [rows, H] (or [G, S, H]) e4m3, xs [rows, H/128] (or
// [G, S, H/128]) f32, wq [G, F, H] e4m3, ws [G, H/128, F/128] f32 -> out
// [rows, F] (or [G, S, F]) bf16. The same call with (dy, w as stored) is the
// FP8 dgrad.
ffi::Error SetForwardFp8(GroupedGemmArgs& g, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_scales,
                         ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_scales, int64_t group_stride,
                         int64_t out_elems) {
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (ad.size() < 2 || bd.size() != 3 || bd[0] != g.num_groups || bd[2] != ad.back()) {
    return Invalid("FP8: x must be [M, H] (or [G, S, H]) and w [G, F, H]");
  }
  g.h = ad.back();
  g.f = bd[1];
  g.rows = static_cast<int64_t>(a.element_count()) / g.h;
  if (g.h % 128 != 0 || g.f % 128 != 0) return Invalid("FP8: H and F must be multiples of 128");
  if (g.h * g.f >= (int64_t{1} << 31)) return Invalid("FP8: H * F must be below 2^31");
  if (ffi::Error err = SetSizesAndStride(g, group_stride); err.failure()) return err;
  if (static_cast<int64_t>(a_scales.element_count()) != g.rows * (g.h / 128) ||
      static_cast<int64_t>(b_scales.element_count()) != g.num_groups * (g.h / 128) * (g.f / 128)) {
    return Invalid("FP8: scales must be [M, H/128] (or [G, S, H/128]) and [G, H/128, F/128]");
  }
  if (out_elems != g.rows * g.f) return Invalid("output shape does not match the operands");
  return ffi::Error::Success();
}

// kWeightGradFp8: xT [H, P] e4m3, xs [P/128, H] f32, dyT [F, P] e4m3, dys
// [P/128, F] f32, padded group sizes [G] -> dw [G, H, F] bf16.
ffi::Error SetWeightGradFp8(GroupedGemmArgs& g, ffi::AnyBuffer a, ffi::Buffer<ffi::F32> a_scales,
                            ffi::AnyBuffer b, ffi::Buffer<ffi::F32> b_scales,
                            int64_t group_stride, int64_t out_elems) {
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1]) {
    return Invalid("FP8 weight gradient: xT must be [H, P] and dyT [F, P]");
  }
  if (group_stride != 0) return Invalid("FP8 weight gradient: contiguous groups only");
  g.h = ad[0];
  g.f = bd[0];
  g.rows = ad[1];
  if (g.h % 128 != 0 || g.f % 128 != 0 || g.rows % 128 != 0) {
    return Invalid("FP8 weight gradient: H, F and the padded token count must be multiples of 128");
  }
  if (g.h * g.rows >= (int64_t{1} << 31) || g.f * g.rows >= (int64_t{1} << 31)) {
    return Invalid("FP8 weight gradient: operands must hold fewer than 2^31 elements");
  }
  if (static_cast<int64_t>(a_scales.element_count()) != (g.rows / 128) * g.h ||
      static_cast<int64_t>(b_scales.element_count()) != (g.rows / 128) * g.f) {
    return Invalid("FP8 weight gradient: scales must be [P/128, H] and [P/128, F]");
  }
  if (out_elems != g.num_groups * g.h * g.f) return Invalid("output must be [G, H, F]");
  g.group_stride = 0;
  return ffi::Error::Success();
}

ffi::Error GroupedGemmFp8Execute(cudaStream_t stream, int32_t device_ordinal, int32_t kind,
                                 int32_t schedule, int64_t group_stride, int32_t num_sms,
                                 ffi::AnyBuffer a,
                                 ffi::Buffer<ffi::F32> a_scales, ffi::AnyBuffer b,
                                 ffi::Buffer<ffi::F32> b_scales,
                                 ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace) {
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid("FP8 operands must be float8_e4m3fn");
  }
  if (out->element_type() != ffi::DataType::BF16) return Invalid("FP8 output must be bf16");
  GroupedGemmArgs g;
  if (schedule != 0 && schedule != 1) return Invalid("unknown FP8 schedule");
  g.schedule = schedule;
  g.num_groups = static_cast<int>(group_sizes.element_count());
  const int64_t out_elems = static_cast<int64_t>(out->element_count());
  ffi::Error err = ffi::Error::Success();
  if (kind == static_cast<int>(GgKind::kForwardFp8)) {
    g.kind = GgKind::kForwardFp8;
    err = SetForwardFp8(g, a, a_scales, b, b_scales, group_stride, out_elems);
  } else if (kind == static_cast<int>(GgKind::kWeightGradFp8)) {
    g.kind = GgKind::kWeightGradFp8;
    err = SetWeightGradFp8(g, a, a_scales, b, b_scales, group_stride, out_elems);
  } else {
    return Invalid("unknown FP8 kind " + std::to_string(kind));
  }
  if (err.failure()) return err;
  g.a = a.untyped_data();
  g.b = b.untyped_data();
  g.a_scales = a_scales.typed_data();
  g.b_scales = b_scales.typed_data();
  g.out = out->untyped_data();
  g.group_sizes = group_sizes.typed_data();
  if (out_elems == 0) return ffi::Error::Success();
  if (g.num_groups == 0 || g.rows == 0) {
    cudaError_t e = cudaMemsetAsync(g.out, 0, out->size_bytes(), stream);
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(std::string("jax_ep grouped_matmul: ") +
                                                   cudaGetErrorString(e));
  }
  return Launch(g, stream, device_ordinal, num_sms, *workspace);
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGroupedGemmExecute, jax_ep::GroupedGemmExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int64_t>("group_stride")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpGroupedGemmFp8Execute, jax_ep::GroupedGemmFp8Execute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("schedule")
                                  .Attr<int64_t>("group_stride")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
