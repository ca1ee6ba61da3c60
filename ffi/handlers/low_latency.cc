// FFI targets of the dedicated low-latency kernels (kernels/low_latency.cuh).
// Mirrored by jax_ep/_ffi_low_latency.py. Common attrs of every target:
// comm_id i64, num_experts i32, max_tokens i32 (M), reserved_bytes i64
// (window bytes the normal ops of the program need; the low-latency area
// goes above them), num_sms i32 (0 = all).
//
// jax_ep_ll_dispatch        + fp8 i32, ue8m0 i32
//   args: x [T, H] bf16, topk_idx s32 [T, K]
//   rets: recv_x [E_l, R*M, H] (bf16, or f8e4m3fn with fp8), recv_scales f32
//         [E_l, R*M, H/128] (fp8) or [0], recv_count s32 [E_l], src_entry s32 [E_l, R*M]
// jax_ep_ll_dispatch_send   + fp8, ue8m0;  args as jax_ep_ll_dispatch; rets: token s32 [1]
// jax_ep_ll_dispatch_recv   + fp8, num_tokens i32, topk i32, hidden i32
//   args: token s32 [1] (of the send);  rets as jax_ep_ll_dispatch
// jax_ep_ll_combine
//   args: y [E_l, R*M, H] bf16, src_entry s32 [E_l, R*M], recv_count s32 [E_l],
//         topk_idx s32 [T, K], topk_weights f32 [T, K]
//   rets: out [T, H] bf16
// jax_ep_ll_combine_send    args: y, src_entry, recv_count, topk_idx; rets: token s32 [1]
// jax_ep_ll_combine_recv    + hidden i32
//   args: token s32 [1], topk_idx s32 [T, K], topk_weights f32 [T, K]; rets: out [T, H] bf16
//
// A send's token holds its call's sequence number; the receive reads which
// call it completes from it, and XLA runs it after the send.
#include <cstdint>
#include <string>

#include "handlers/state.h"
#include "kernels/launch_policy.h"
#include "kernels/low_latency.cuh"
#include "kernels/peer.cuh"

namespace jax_ep {
static_assert(kLlMismatchCounter < kGinSnapshotCounter, "the low-latency counter slots overlap others (comm.h)");
namespace {

constexpr const char* kDispatchOp = "low_latency_dispatch";
constexpr const char* kCombineOp = "low_latency_combine";
// The kernels reach GIN peers too (kernels/low_latency_peers.cuh).
constexpr bool kGinPath = true;

ffi::Error CheckConfig(const char* op, const EpPeers& peers, int32_t num_experts,
                       int64_t reserved_bytes) {
  if (num_experts < 1 || num_experts % peers.nranks)
    return Invalid(op, "num_experts must be a multiple of the ranks");
  if (reserved_bytes < 0) return Invalid(op, "reserved_bytes must be >= 0");
  return ffi::Error::Success();
}

// The dispatch inputs' shapes: x [T, H] bf16, topk_idx [T, K].
ffi::Error CheckDispatchInputs(ffi::AnyBuffer& x, ffi::Buffer<ffi::S32>& topk_idx) {
  const auto xd = x.dimensions();
  const auto td = topk_idx.dimensions();
  if (x.element_type() != ffi::DataType::BF16) return Invalid(kDispatchOp, "x must be bf16");
  if (xd.size() != 2) return Invalid(kDispatchOp, "x must be [T, H], got " + Dims(xd));
  if (td.size() != 2 || td[0] != xd[0])
    return Invalid(kDispatchOp, "topk_idx must be [T, K] with T = x.shape[0], got " + Dims(td));
  return ffi::Error::Success();
}

ffi::Error CheckDispatchOutputs(int64_t E_l, int64_t m_all, int64_t H, bool fp8,
                                ffi::Result<ffi::AnyBuffer>& recv_x,
                                ffi::Result<ffi::Buffer<ffi::F32>>& recv_scales,
                                ffi::Result<ffi::Buffer<ffi::S32>>& recv_count,
                                ffi::Result<ffi::Buffer<ffi::S32>>& src_entry) {
  const auto rd = recv_x->dimensions();
  if (rd.size() != 3 || rd[0] != E_l || rd[1] != m_all || rd[2] != H)
    return Invalid(kDispatchOp, "recv_x must be [E_l, R*max_tokens, H], got " + Dims(rd));
  const ffi::DataType want = fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
  if (recv_x->element_type() != want) return Invalid(kDispatchOp, "recv_x must be bf16 (e4m3 with fp8)");
  if (fp8) {
    const auto sd = recv_scales->dimensions();
    if (sd.size() != 3 || sd[0] != E_l || sd[1] != m_all || sd[2] != H / 128)
      return Invalid(kDispatchOp, "recv_scales must be [E_l, R*max_tokens, H/128], got " + Dims(sd));
  }
  if (recv_count->element_count() != static_cast<size_t>(E_l))
    return Invalid(kDispatchOp, "recv_count must be [E_l]");
  if (src_entry->element_count() != static_cast<size_t>(E_l * m_all))
    return Invalid(kDispatchOp, "src_entry must be [E_l, R*max_tokens]");
  return ffi::Error::Success();
}

// `notice`: a sending call's (RefusalNotice), told just before the launch.
ffi::Error LaunchDispatch(LlDispatchArgs& a, DeviceLease& lease, int32_t device_ordinal,
                          cudaStream_t stream, LlPart part, RefusalNotice* notice = nullptr) {
  const EpPeers peers = lease.dev->peers();
  a.counters = lease.dev->counters;
  if (std::string msg = ValidateLlDispatch(a, peers); !msg.empty()) return Invalid(kDispatchOp, msg);
  if (ffi::Error err = ClearOverwrittenTables(
          *lease.dev,
          LlWindowBytes(peers.nranks, a.max_tokens, a.hidden, a.topk, a.num_experts, a.reserved_bytes,
                        AnyGinPeer(peers)),
          stream);
      err.failure()) {
    return err;
  }
  if (notice != nullptr) notice->Launched();
  if (cudaError_t err = LaunchLlDispatch(a, peers, DeviceSms(device_ordinal), stream, part);
      err != cudaSuccess) {
    return CudaError(err, "low_latency_dispatch launch");
  }
  return EndCall(lease, stream);
}

LlDispatchArgs DispatchConfig(int32_t num_experts, int32_t max_tokens, int32_t fp8, int32_t ue8m0,
                              int64_t reserved_bytes, int32_t num_sms, int64_t T, int64_t H,
                              int64_t K) {
  LlDispatchArgs a;
  a.num_tokens = static_cast<int>(T);
  a.max_tokens = max_tokens;
  a.hidden = static_cast<int>(H);
  a.topk = static_cast<int>(K);
  a.num_experts = num_experts;
  a.fp8 = fp8 != 0;
  a.ue8m0 = ue8m0 != 0;
  a.reserved_bytes = static_cast<size_t>(reserved_bytes);
  a.num_blocks = num_sms;
  return a;
}

void SetDispatchOutputs(LlDispatchArgs& a, ffi::Result<ffi::AnyBuffer>& recv_x,
                        ffi::Result<ffi::Buffer<ffi::F32>>& recv_scales,
                        ffi::Result<ffi::Buffer<ffi::S32>>& recv_count,
                        ffi::Result<ffi::Buffer<ffi::S32>>& src_entry) {
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = a.fp8 ? recv_scales->typed_data() : nullptr;
  a.recv_count = recv_count->typed_data();
  a.src_entry = src_entry->typed_data();
}

ffi::Error LlDispatchExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                             int64_t comm_id, int32_t num_experts, int32_t max_tokens, int32_t fp8,
                             int32_t ue8m0, int64_t reserved_bytes, int32_t num_sms,
                             ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                             ffi::Result<ffi::AnyBuffer> recv_x,
                             ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
                             ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                             ffi::Result<ffi::Buffer<ffi::S32>> src_entry) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kDispatchOp, lease, kGinPath); err.failure())
    return err;
  RefusalNotice notice(lease, stream, 0, Op::kLowLatencyDispatch);
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kDispatchOp, stream); err.failure()) return err;
  const EpPeers peers = lease.dev->peers();
  if (ffi::Error err = CheckConfig(kDispatchOp, peers, num_experts, reserved_bytes); err.failure())
    return err;
  if (ffi::Error err = CheckDispatchInputs(x, topk_idx); err.failure()) return err;
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1], K = topk_idx.dimensions()[1];
  const int64_t E_l = num_experts / peers.nranks, m_all = int64_t{peers.nranks} * max_tokens;
  if (ffi::Error err = CheckDispatchOutputs(E_l, m_all, H, fp8 != 0, recv_x, recv_scales,
                                            recv_count, src_entry);
      err.failure())
    return err;
  LlDispatchArgs a = DispatchConfig(num_experts, max_tokens, fp8, ue8m0, reserved_bytes, num_sms, T, H, K);
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  SetDispatchOutputs(a, recv_x, recv_scales, recv_count, src_entry);
  return LaunchDispatch(a, lease, device_ordinal, stream, LlPart::kFused, &notice);
}

ffi::Error LlDispatchSendExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                 int64_t comm_id, int32_t num_experts, int32_t max_tokens,
                                 int32_t fp8, int32_t ue8m0, int64_t reserved_bytes,
                                 int32_t num_sms, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                                 ffi::Result<ffi::Buffer<ffi::S32>> token) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kDispatchOp, lease, kGinPath); err.failure())
    return err;
  RefusalNotice notice(lease, stream, 0, Op::kLowLatencyDispatch);
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kDispatchOp, stream); err.failure()) return err;
  if (ffi::Error err = CheckConfig(kDispatchOp, lease.dev->peers(), num_experts, reserved_bytes);
      err.failure())
    return err;
  if (ffi::Error err = CheckDispatchInputs(x, topk_idx); err.failure()) return err;
  if (token->element_count() != 1) return Invalid(kDispatchOp, "token must be s32 [1]");
  LlDispatchArgs a = DispatchConfig(num_experts, max_tokens, fp8, ue8m0, reserved_bytes, num_sms,
                                    x.dimensions()[0], x.dimensions()[1], topk_idx.dimensions()[1]);
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.token_out = token->typed_data();
  return LaunchDispatch(a, lease, device_ordinal, stream, LlPart::kSend, &notice);
}

ffi::Error LlDispatchRecvExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                 int64_t comm_id, int32_t num_experts, int32_t max_tokens,
                                 int32_t fp8, int64_t reserved_bytes, int32_t num_sms,
                                 int32_t num_tokens, int32_t topk, int32_t hidden,
                                 ffi::Buffer<ffi::S32> token, ffi::Result<ffi::AnyBuffer> recv_x,
                                 ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
                                 ffi::Result<ffi::Buffer<ffi::S32>> recv_count,
                                 ffi::Result<ffi::Buffer<ffi::S32>> src_entry) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kDispatchOp, lease, kGinPath); err.failure())
    return err;
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kDispatchOp, stream); err.failure()) return err;
  const EpPeers peers = lease.dev->peers();
  if (ffi::Error err = CheckConfig(kDispatchOp, peers, num_experts, reserved_bytes); err.failure())
    return err;
  if (token.element_count() != 1) return Invalid(kDispatchOp, "token must be the s32 [1] of the send");
  const int64_t E_l = num_experts / peers.nranks, m_all = int64_t{peers.nranks} * max_tokens;
  if (ffi::Error err = CheckDispatchOutputs(E_l, m_all, hidden, fp8 != 0, recv_x, recv_scales,
                                            recv_count, src_entry);
      err.failure())
    return err;
  LlDispatchArgs a = DispatchConfig(num_experts, max_tokens, fp8, 0, reserved_bytes, num_sms,
                                    num_tokens, hidden, topk);
  SetDispatchOutputs(a, recv_x, recv_scales, recv_count, src_entry);
  a.token_in = token.typed_data();
  return LaunchDispatch(a, lease, device_ordinal, stream, LlPart::kRecv);
}

ffi::Error LaunchCombine(LlCombineArgs& a, DeviceLease& lease, int32_t device_ordinal,
                         cudaStream_t stream, LlPart part, RefusalNotice* notice = nullptr) {
  const EpPeers peers = lease.dev->peers();
  a.counters = lease.dev->counters;
  if (std::string msg = ValidateLlCombine(a, peers); !msg.empty()) return Invalid(kCombineOp, msg);
  if (ffi::Error err = ClearOverwrittenTables(
          *lease.dev,
          LlWindowBytes(peers.nranks, a.max_tokens, a.hidden, a.topk, a.num_experts, a.reserved_bytes,
                        AnyGinPeer(peers)),
          stream);
      err.failure()) {
    return err;
  }
  if (notice != nullptr) notice->Launched();
  if (cudaError_t err = LaunchLlCombine(a, peers, DeviceSms(device_ordinal), stream, part);
      err != cudaSuccess) {
    return CudaError(err, "low_latency_combine launch");
  }
  return EndCall(lease, stream);
}

LlCombineArgs CombineConfig(int32_t num_experts, int32_t max_tokens, int64_t reserved_bytes,
                            int32_t num_sms, int64_t T, int64_t H, int64_t K) {
  LlCombineArgs a;
  a.num_tokens = static_cast<int>(T);
  a.max_tokens = max_tokens;
  a.hidden = static_cast<int>(H);
  a.topk = static_cast<int>(K);
  a.num_experts = num_experts;
  a.reserved_bytes = static_cast<size_t>(reserved_bytes);
  a.num_blocks = num_sms;
  return a;
}

// The expert side's inputs: y [E_l, R*M, H] bf16, src_entry, recv_count.
ffi::Error CheckCombineSend(const EpPeers& peers, int32_t num_experts, int32_t max_tokens,
                            ffi::AnyBuffer& y, ffi::Buffer<ffi::S32>& src_entry,
                            ffi::Buffer<ffi::S32>& recv_count) {
  const int64_t E_l = num_experts / peers.nranks, m_all = int64_t{peers.nranks} * max_tokens;
  const auto yd = y.dimensions();
  if (y.element_type() != ffi::DataType::BF16) return Invalid(kCombineOp, "y must be bf16");
  if (yd.size() != 3 || yd[0] != E_l || yd[1] != m_all)
    return Invalid(kCombineOp, "y must be [E_l, R*max_tokens, H], got " + Dims(yd));
  if (src_entry.element_count() != static_cast<size_t>(E_l * m_all))
    return Invalid(kCombineOp, "src_entry must be [E_l, R*max_tokens]");
  if (recv_count.element_count() != static_cast<size_t>(E_l))
    return Invalid(kCombineOp, "recv_count must be [E_l]");
  return ffi::Error::Success();
}

// The token side's: topk_idx [T, K], topk_weights [T, K], out [T, H] bf16.
ffi::Error CheckCombineRecv(ffi::Buffer<ffi::S32>& topk_idx, ffi::Buffer<ffi::F32>& topk_weights,
                            ffi::Result<ffi::AnyBuffer>& out, int64_t H) {
  const auto td = topk_idx.dimensions();
  if (td.size() != 2) return Invalid(kCombineOp, "topk_idx must be [T, K], got " + Dims(td));
  if (topk_weights.element_count() != static_cast<size_t>(td[0] * td[1]))
    return Invalid(kCombineOp, "topk_weights must have topk_idx's shape");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != td[0] || od[1] != H || out->element_type() != ffi::DataType::BF16)
    return Invalid(kCombineOp, "out must be [T, H] bf16, got " + Dims(od));
  return ffi::Error::Success();
}

ffi::Error LlCombineExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                            int64_t comm_id, int32_t num_experts, int32_t max_tokens,
                            int64_t reserved_bytes, int32_t num_sms, ffi::AnyBuffer y,
                            ffi::Buffer<ffi::S32> src_entry, ffi::Buffer<ffi::S32> recv_count,
                            ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                            ffi::Result<ffi::AnyBuffer> out) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kCombineOp, lease, kGinPath); err.failure())
    return err;
  RefusalNotice notice(lease, stream, 0, Op::kLowLatencyCombine);
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kCombineOp, stream); err.failure()) return err;
  const EpPeers peers = lease.dev->peers();
  if (ffi::Error err = CheckConfig(kCombineOp, peers, num_experts, reserved_bytes); err.failure())
    return err;
  if (ffi::Error err = CheckCombineSend(peers, num_experts, max_tokens, y, src_entry, recv_count);
      err.failure())
    return err;
  const int64_t H = y.dimensions()[2];
  if (ffi::Error err = CheckCombineRecv(topk_idx, topk_weights, out, H); err.failure()) return err;
  LlCombineArgs a = CombineConfig(num_experts, max_tokens, reserved_bytes, num_sms,
                                  topk_idx.dimensions()[0], H, topk_idx.dimensions()[1]);
  a.y = y.untyped_data();
  a.src_entry = src_entry.typed_data();
  a.recv_count = recv_count.typed_data();
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.out = out->untyped_data();
  return LaunchCombine(a, lease, device_ordinal, stream, LlPart::kFused, &notice);
}

ffi::Error LlCombineSendExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                int64_t comm_id, int32_t num_experts, int32_t max_tokens,
                                int64_t reserved_bytes, int32_t num_sms, ffi::AnyBuffer y,
                                ffi::Buffer<ffi::S32> src_entry, ffi::Buffer<ffi::S32> recv_count,
                                ffi::Buffer<ffi::S32> topk_idx,
                                ffi::Result<ffi::Buffer<ffi::S32>> token) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kCombineOp, lease, kGinPath); err.failure())
    return err;
  RefusalNotice notice(lease, stream, 0, Op::kLowLatencyCombine);
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kCombineOp, stream); err.failure()) return err;
  const EpPeers peers = lease.dev->peers();
  if (ffi::Error err = CheckConfig(kCombineOp, peers, num_experts, reserved_bytes); err.failure())
    return err;
  if (ffi::Error err = CheckCombineSend(peers, num_experts, max_tokens, y, src_entry, recv_count);
      err.failure())
    return err;
  const auto td = topk_idx.dimensions();
  if (td.size() != 2) return Invalid(kCombineOp, "topk_idx must be [T, K], got " + Dims(td));
  if (token->element_count() != 1) return Invalid(kCombineOp, "token must be s32 [1]");
  LlCombineArgs a = CombineConfig(num_experts, max_tokens, reserved_bytes, num_sms, td[0],
                                  y.dimensions()[2], td[1]);
  a.y = y.untyped_data();
  a.src_entry = src_entry.typed_data();
  a.recv_count = recv_count.typed_data();
  a.topk_idx = topk_idx.typed_data();
  a.token_out = token->typed_data();
  return LaunchCombine(a, lease, device_ordinal, stream, LlPart::kSend, &notice);
}

ffi::Error LlCombineRecvExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                int64_t comm_id, int32_t num_experts, int32_t max_tokens,
                                int64_t reserved_bytes, int32_t num_sms, int32_t hidden,
                                ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> topk_idx,
                                ffi::Buffer<ffi::F32> topk_weights,
                                ffi::Result<ffi::AnyBuffer> out) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kCombineOp, lease, kGinPath); err.failure())
    return err;
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kCombineOp, stream); err.failure()) return err;
  if (ffi::Error err = CheckConfig(kCombineOp, lease.dev->peers(), num_experts, reserved_bytes);
      err.failure())
    return err;
  if (token.element_count() != 1) return Invalid(kCombineOp, "token must be the s32 [1] of the send");
  if (ffi::Error err = CheckCombineRecv(topk_idx, topk_weights, out, hidden); err.failure()) return err;
  LlCombineArgs a = CombineConfig(num_experts, max_tokens, reserved_bytes, num_sms,
                                  topk_idx.dimensions()[0], hidden, topk_idx.dimensions()[1]);
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.out = out->untyped_data();
  a.token_in = token.typed_data();
  return LaunchCombine(a, lease, device_ordinal, stream, LlPart::kRecv);
}

// The attributes every low-latency target starts with, in the handlers' order.
auto BindLl() {
  return BindEpExecute()
      .Attr<int32_t>("num_experts")
      .Attr<int32_t>("max_tokens");
}

}  // namespace
}  // namespace jax_ep

namespace xffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatchExecute, jax_ep::LlDispatchExecute,
                              jax_ep::BindLl()
                                  .Attr<int32_t>("fp8")
                                  .Attr<int32_t>("ue8m0")
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xffi::AnyBuffer>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Ret<xffi::AnyBuffer>()
                                  .Ret<xffi::Buffer<xffi::F32>>()
                                  .Ret<xffi::Buffer<xffi::S32>>()
                                  .Ret<xffi::Buffer<xffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatchSendExecute, jax_ep::LlDispatchSendExecute,
                              jax_ep::BindLl()
                                  .Attr<int32_t>("fp8")
                                  .Attr<int32_t>("ue8m0")
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xffi::AnyBuffer>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Ret<xffi::Buffer<xffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlDispatchRecvExecute, jax_ep::LlDispatchRecvExecute,
                              jax_ep::BindLl()
                                  .Attr<int32_t>("fp8")
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("num_tokens")
                                  .Attr<int32_t>("topk")
                                  .Attr<int32_t>("hidden")
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Ret<xffi::AnyBuffer>()
                                  .Ret<xffi::Buffer<xffi::F32>>()
                                  .Ret<xffi::Buffer<xffi::S32>>()
                                  .Ret<xffi::Buffer<xffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombineExecute, jax_ep::LlCombineExecute,
                              jax_ep::BindLl()
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xffi::AnyBuffer>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::F32>>()
                                  .Ret<xffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombineSendExecute, jax_ep::LlCombineSendExecute,
                              jax_ep::BindLl()
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xffi::AnyBuffer>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Ret<xffi::Buffer<xffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLlCombineRecvExecute, jax_ep::LlCombineRecvExecute,
                              jax_ep::BindLl()
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int32_t>("hidden")
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::S32>>()
                                  .Arg<xffi::Buffer<xffi::F32>>()
                                  .Ret<xffi::AnyBuffer>());
