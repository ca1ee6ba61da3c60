// FFI target "jax_ep_dispatch_layout" (execute stage; instantiate is shared,
// see bindings.cc). Mirrored by jax_ep/_ffi/layout.py.
//   attrs: comm_id i64, num_experts i32, num_ranks i32, num_sms i32 (0: the
//          kernel's own; n > 0: at most n SMs; the kernel is one CTA, within
//          any n >= 1)
#include <cstdint>
#include <string>

#include "handlers/state.h"
#include "kernels/layout.cuh"

namespace jax_ep {
namespace {

ffi::Error DispatchLayoutExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                 int64_t comm_id, int32_t num_experts, int32_t num_ranks,
                                 int32_t num_sms, ffi::Buffer<ffi::S32> topk_idx,
                                 ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_rank,
                                 ffi::Result<ffi::Buffer<ffi::S32>> num_tokens_per_expert,
                                 ffi::Result<ffi::Buffer<ffi::PRED>> is_token_in_rank,
                                 ffi::Result<ffi::Buffer<ffi::S32>> pos_in_rank) {
  (void)num_sms;  // one CTA (LaunchDispatchLayout): within any n >= 1
  DeviceLease lease;
  // The layout kernel reaches no peer, so GIN peers are no reason to refuse.
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, "get_dispatch_layout", lease,
                                     /*gin_data_path=*/true);
      err.failure()) {
    return err;
  }
  const auto dims = topk_idx.dimensions();
  if (dims.size() != 2) {
    return ffi::Error::InvalidArgument("jax_ep get_dispatch_layout: topk_idx must be [T, K], got rank " +
                                       std::to_string(dims.size()));
  }
  const int64_t T = dims[0];
  const int64_t K = dims[1];
  if (num_ranks < 1 || num_ranks > kLayoutMaxRanks) {
    return ffi::Error::InvalidArgument("jax_ep get_dispatch_layout: num_ranks must be in [1, " +
                                       std::to_string(kLayoutMaxRanks) + "], got " +
                                       std::to_string(num_ranks));
  }
  if (num_experts < 1 || num_experts % num_ranks != 0) {
    return ffi::Error::InvalidArgument(
        "jax_ep get_dispatch_layout: num_experts must be a positive multiple of num_ranks, got " +
        std::to_string(num_experts) + " experts for " + std::to_string(num_ranks) + " ranks");
  }
  if (DispatchLayoutSmemBytes(num_experts) > 200 * 1024) {
    return ffi::Error::InvalidArgument("jax_ep get_dispatch_layout: num_experts " +
                                       std::to_string(num_experts) + " too large (max 51200)");
  }
  if (T > (int64_t{1} << 30) / (K > 0 ? K : 1)) {
    return ffi::Error::InvalidArgument("jax_ep get_dispatch_layout: topk_idx too large");
  }
  const int64_t R = num_ranks;
  if (num_tokens_per_rank->element_count() != static_cast<size_t>(R) ||
      num_tokens_per_expert->element_count() != static_cast<size_t>(num_experts) ||
      is_token_in_rank->element_count() != static_cast<size_t>(T * R) ||
      pos_in_rank->element_count() != static_cast<size_t>(T * R)) {
    return ffi::Error::InvalidArgument(
        "jax_ep get_dispatch_layout: output shapes do not match [R], [E], [T, R], [T, R]");
  }

  LayoutArgs args;
  args.topk_idx = topk_idx.typed_data();
  args.num_tokens = static_cast<int>(T);
  args.topk = static_cast<int>(K);
  args.num_experts = num_experts;
  args.num_ranks = num_ranks;
  args.num_tokens_per_rank = num_tokens_per_rank->typed_data();
  args.num_tokens_per_expert = num_tokens_per_expert->typed_data();
  args.is_token_in_rank = is_token_in_rank->typed_data();
  args.pos_in_rank = pos_in_rank->typed_data();
  if (cudaError_t err = LaunchDispatchLayout(args, lease.dev->peers(), stream); err != cudaSuccess) {
    return CudaError(err, "get_dispatch_layout launch");
  }
  return EndCall(lease, stream);
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchLayoutExecute, jax_ep::DispatchLayoutExecute,
                              jax_ep::BindEpExecute()
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());
