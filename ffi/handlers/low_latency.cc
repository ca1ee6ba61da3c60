// FFI targets "jax_ep_ll_dispatch" and "jax_ep_ll_combine": the dedicated
// low-latency kernels (kernels/low_latency.cuh). Mirrored by
// jax_ep/_ffi_low_latency.py.
//
// jax_ep_ll_dispatch
//   attrs: comm_id i64, num_experts i32, max_tokens i32, fp8 i32, ue8m0 i32,
//          reserved_bytes i64 (window bytes the normal ops of the program
//          need; the low-latency area goes above them), num_sms i32 (0 = all)
//   args:  x [T, H] bf16, topk_idx s32 [T, K]
//   rets:  recv_x [E_l, R*M, H] (bf16, or f8e4m3fn with fp8),
//          recv_scales f32 [E_l, R*M, H/128] (fp8) or [0],
//          recv_count s32 [E_l], src_entry s32 [E_l, R*M]
// jax_ep_ll_combine
//   attrs: comm_id i64, num_experts i32, max_tokens i32, reserved_bytes i64, num_sms i32
//   args:  y [E_l, R*M, H] bf16, src_entry s32 [E_l, R*M], recv_count s32 [E_l],
//          topk_idx s32 [T, K], topk_weights f32 [T, K]
//   rets:  out [T, H] bf16
#include <cstdint>
#include <string>

#include "handlers/state.h"
#include "kernels/low_latency.cuh"

namespace jax_ep {
namespace {

// A non-zero reset generation when this call's window layout differs from
// the previous low-latency call's on this device (LlDispatchArgs::reset_gen).
unsigned long long LayoutReset(DeviceResources& dev, int64_t m, int64_t h, int64_t k, int64_t e,
                               int64_t reserved) {
  const int64_t key[6] = {1, m, h, k, e, reserved};
  bool same = true;
  for (int i = 0; i < 6; ++i) same &= dev.ll_layout[i] == key[i];
  if (same) return 0;
  for (int i = 0; i < 6; ++i) dev.ll_layout[i] = key[i];
  return ++dev.ll_reset_gen;
}

int DeviceSms(int32_t device_ordinal) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_ordinal) != cudaSuccess) {
    return 1;
  }
  return sms;
}

ffi::Error LlDispatchExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                             int64_t comm_id, int32_t num_experts, int32_t max_tokens, int32_t fp8,
                             int32_t ue8m0, int64_t reserved_bytes, int32_t num_sms,
                             ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                             ffi::Result<ffi::AnyBuffer> recv_x,
                             ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
                             ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                             ffi::Result<ffi::Buffer<ffi::S32>> src_entry) {
  constexpr const char* kOp = "low_latency_dispatch";
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kOp, lease); err.failure()) {
    return err;
  }
  const EpPeers peers = lease.dev->peers();
  const int64_t R = peers.nranks;
  const auto xd = x.dimensions();
  const auto td = topk_idx.dimensions();
  if (x.element_type() != ffi::DataType::BF16) return Invalid(kOp, "x must be bf16");
  if (xd.size() != 2) return Invalid(kOp, "x must be [T, H], got " + Dims(xd));
  if (td.size() != 2 || td[0] != xd[0])
    return Invalid(kOp, "topk_idx must be [T, K] with T = x.shape[0], got " + Dims(td));
  if (num_experts < 1 || num_experts % R) return Invalid(kOp, "num_experts must be a multiple of the ranks");
  if (reserved_bytes < 0) return Invalid(kOp, "reserved_bytes must be >= 0");
  const int64_t E_l = num_experts / R, m_all = R * max_tokens, H = xd[1];
  const auto rd = recv_x->dimensions();
  if (rd.size() != 3 || rd[0] != E_l || rd[1] != m_all || rd[2] != H)
    return Invalid(kOp, "recv_x must be [E_l, R*max_tokens, H], got " + Dims(rd));
  const ffi::DataType want = fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
  if (recv_x->element_type() != want) return Invalid(kOp, "recv_x must be bf16 (e4m3 with fp8)");
  if (fp8) {
    const auto sd = recv_scales->dimensions();
    if (sd.size() != 3 || sd[0] != E_l || sd[1] != m_all || sd[2] != H / 128)
      return Invalid(kOp, "recv_scales must be [E_l, R*max_tokens, H/128], got " + Dims(sd));
  }
  if (recv_count->element_count() != static_cast<size_t>(E_l)) return Invalid(kOp, "recv_count must be [E_l]");
  if (src_entry->element_count() != static_cast<size_t>(E_l * m_all))
    return Invalid(kOp, "src_entry must be [E_l, R*max_tokens]");
  LlDispatchArgs a;
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.num_tokens = static_cast<int>(xd[0]);
  a.max_tokens = max_tokens;
  a.hidden = static_cast<int>(H);
  a.topk = static_cast<int>(td[1]);
  a.num_experts = num_experts;
  a.fp8 = fp8 != 0;
  a.ue8m0 = ue8m0 != 0;
  a.reserved_bytes = static_cast<size_t>(reserved_bytes);
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = fp8 ? recv_scales->typed_data() : nullptr;
  a.recv_count = recv_count->typed_data();
  a.src_entry = src_entry->typed_data();
  a.counters = lease.dev->counters;
  a.num_blocks = num_sms;
  if (std::string msg = ValidateLlDispatch(a, peers); !msg.empty()) return Invalid(kOp, msg);
  a.reset_gen = LayoutReset(*lease.dev, max_tokens, H, a.topk, num_experts, reserved_bytes);
  if (cudaError_t err = LaunchLlDispatch(a, peers, DeviceSms(device_ordinal), stream);
      err != cudaSuccess) {
    return CudaError(err, "low_latency_dispatch launch");
  }
  return ffi::Error::Success();
}

ffi::Error LlCombineExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                            int64_t comm_id, int32_t num_experts, int32_t max_tokens,
                            int64_t reserved_bytes, int32_t num_sms, ffi::AnyBuffer y,
                            ffi::Buffer<ffi::S32> src_entry, ffi::Buffer<ffi::S32> recv_count,
                            ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                            ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = "low_latency_combine";
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kOp, lease); err.failure()) {
    return err;
  }
  const EpPeers peers = lease.dev->peers();
  const int64_t R = peers.nranks;
  const auto yd = y.dimensions();
  const auto td = topk_idx.dimensions();
  if (y.element_type() != ffi::DataType::BF16) return Invalid(kOp, "y must be bf16");
  if (num_experts < 1 || num_experts % R) return Invalid(kOp, "num_experts must be a multiple of the ranks");
  if (reserved_bytes < 0) return Invalid(kOp, "reserved_bytes must be >= 0");
  const int64_t E_l = num_experts / R, m_all = R * max_tokens;
  if (yd.size() != 3 || yd[0] != E_l || yd[1] != m_all)
    return Invalid(kOp, "y must be [E_l, R*max_tokens, H], got " + Dims(yd));
  if (td.size() != 2) return Invalid(kOp, "topk_idx must be [T, K], got " + Dims(td));
  if (topk_weights.element_count() != static_cast<size_t>(td[0] * td[1]))
    return Invalid(kOp, "topk_weights must have topk_idx's shape");
  if (src_entry.element_count() != static_cast<size_t>(E_l * m_all))
    return Invalid(kOp, "src_entry must be [E_l, R*max_tokens]");
  if (recv_count.element_count() != static_cast<size_t>(E_l)) return Invalid(kOp, "recv_count must be [E_l]");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != td[0] || od[1] != yd[2] || out->element_type() != y.element_type())
    return Invalid(kOp, "out must be [T, H] bf16, got " + Dims(od));
  LlCombineArgs a;
  a.y = y.untyped_data();
  a.src_entry = src_entry.typed_data();
  a.recv_count = recv_count.typed_data();
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.num_tokens = static_cast<int>(td[0]);
  a.max_tokens = max_tokens;
  a.hidden = static_cast<int>(yd[2]);
  a.topk = static_cast<int>(td[1]);
  a.num_experts = num_experts;
  a.reserved_bytes = static_cast<size_t>(reserved_bytes);
  a.out = out->untyped_data();
  a.counters = lease.dev->counters;
  a.num_blocks = num_sms;
  if (std::string msg = ValidateLlCombine(a, peers); !msg.empty()) return Invalid(kOp, msg);
  a.reset_gen = LayoutReset(*lease.dev, max_tokens, a.hidden, a.topk, num_experts, reserved_bytes);
  if (cudaError_t err = LaunchLlCombine(a, peers, DeviceSms(device_ordinal), stream);
      err != cudaSuccess) {
    return CudaError(err, "low_latency_combine launch");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatchExecute, jax_ep::LlDispatchExecute,
                              jax_ep::BindEpExecute()
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("max_tokens")
                                  .Attr<int32_t>("fp8")
                                  .Attr<int32_t>("ue8m0")
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombineExecute, jax_ep::LlCombineExecute,
                              jax_ep::BindEpExecute()
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("max_tokens")
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>());
