// FFI targets "jax_ep_dispatch" and "jax_ep_combine" (execute stage; the
// instantiate stage is the shared one in bindings.cc). Operand order and
// attributes are mirrored by jax_ep/_ffi_dispatch.py; each op's attributes are
// decoded as one struct (DispatchAttrs / CombineAttrs below).
//
// jax_ep_dispatch
//   attrs: comm_id i64, num_experts i32, layout i32 (0 rank, 1 expert),
//          expert_alignment i32, fp8_cast i32, ue8m0 i32, num_sms i32 (0 = model),
//          recv_sms i32 (receiving SMs, 0 = model), start i32 (1: dispatch_start, on the
//          side stream; jax_ep_side_done is its done)
//   args:  x [T, H] bf16/f16/f32/f8e4m3fn, x_scales f32 [T, H/128] (FP8 input) or [0],
//          topk_idx s32 [T, K], topk_weights f32 [T, K]
//   rets:  recv_x [C, H] (x dtype, e4m3 when fp8_cast), recv_scales f32 [C, H/128] or [0],
//          recv_topk_idx s32 ([C, K] rank / [C] expert), recv_topk_weights f32 (same shape),
//          counts s32 ([R] rank / [E_l] expert), pos_in_rank s32 [T, R],
//          recv_src_rank, recv_src_token, recv_src_k s32 [C], recv_counts s32 [R]
// jax_ep_combine
//   attrs: comm_id i64, num_experts i32, layout i32, has_weights i32, num_sms i32,
//          recv_sms i32, start i32 (as for dispatch: combine_start)
//   args:  y [C, H] bf16/f16/f32, weights f32 [C] (or [0] when has_weights == 0),
//          topk_idx s32 [T, K], pos_in_rank s32 [T, R], recv_src_rank, recv_src_token,
//          recv_src_k s32 [C], recv_counts s32 [R]
//   rets:  out [T, H] (y dtype)
#include <cstdint>
#include <string>

#include "handlers/state.h"
#include "kernels/ep_kernels.h"

namespace jax_ep {
// The attributes of one call, decoded from the op's attribute dictionary (all
// of it: XLA FFI cannot mix a struct with single .Attr bindings, so comm_id is
// a member too). The names are the ones _ffi_dispatch.py passes.
struct DispatchAttrs {
  int64_t comm_id;
  int32_t num_experts, layout, expert_alignment, fp8_cast, ue8m0, num_sms, recv_sms, start;
};
struct CombineAttrs {
  int64_t comm_id;
  int32_t num_experts, layout, has_weights, num_sms, recv_sms, start;
};
}  // namespace jax_ep

// (The member list expands inside namespace xla::ffi.)
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_ep::DispatchAttrs, StructMember<int64_t>("comm_id"), StructMember<int32_t>("num_experts"),
    StructMember<int32_t>("layout"), StructMember<int32_t>("expert_alignment"),
    StructMember<int32_t>("fp8_cast"), StructMember<int32_t>("ue8m0"), StructMember<int32_t>("num_sms"),
    StructMember<int32_t>("recv_sms"), StructMember<int32_t>("start"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jax_ep::CombineAttrs, StructMember<int64_t>("comm_id"), StructMember<int32_t>("num_experts"),
    StructMember<int32_t>("layout"), StructMember<int32_t>("has_weights"), StructMember<int32_t>("num_sms"),
    StructMember<int32_t>("recv_sms"), StructMember<int32_t>("start"));

namespace jax_ep {
namespace {

bool ToEpDtype(ffi::DataType t, EpDtype* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = EpDtype::kBF16; return true;
    case ffi::DataType::F16: *out = EpDtype::kF16; return true;
    case ffi::DataType::F32: *out = EpDtype::kF32; return true;
    case ffi::DataType::F8E4M3FN: *out = EpDtype::kFp8E4m3; return true;
    default: return false;
  }
}


ffi::Error DispatchExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                           DispatchAttrs at, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scales,
                           ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                           ffi::Result<ffi::AnyBuffer> recv_x,
                           ffi::Result<ffi::Buffer<ffi::F32>> recv_scales,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_topk_idx,
                           ffi::Result<ffi::Buffer<ffi::F32>> recv_topk_weights,
                           ffi::Result<ffi::Buffer<ffi::S32>> counts,
                           ffi::Result<ffi::Buffer<ffi::S32>> pos_in_rank,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_src_rank,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_src_token,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_src_k,
                           ffi::Result<ffi::Buffer<ffi::S32>> recv_counts) {
  const char* kOp = at.start ? "dispatch_start" : "dispatch";
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, at.comm_id, device_ordinal, kOp, lease, /*gin_data_path=*/true); err.failure()) {
    return err;
  }
  RefusalNotice notice(lease, stream, kDispatchBarriers);
  const EpPeers peers = lease.dev->peers();
  const int64_t R = peers.nranks;
  const auto xd = x.dimensions();
  const auto td = topk_idx.dimensions();
  if (xd.size() != 2) return Invalid(kOp, "x must be [T, H], got " + Dims(xd));
  if (td.size() != 2 || td[0] != xd[0]) return Invalid(kOp, "topk_idx must be [T, K] with T = x.shape[0], got " + Dims(td));
  if (topk_weights.dimensions().size() != 2 || topk_weights.dimensions()[0] != td[0] ||
      topk_weights.dimensions()[1] != td[1])
    return Invalid(kOp, "topk_weights must have topk_idx's shape, got " + Dims(topk_weights.dimensions()));
  if (at.layout != 0 && at.layout != 1) return Invalid(kOp, "layout must be 0 (rank) or 1 (expert)");

  DispatchArgs a;
  if (!ToEpDtype(x.element_type(), &a.x_dtype)) return Invalid(kOp, "x dtype must be bf16, f16, f32 or float8_e4m3fn");
  a.x = x.untyped_data();
  a.topk_idx = topk_idx.typed_data();
  a.topk_weights = topk_weights.typed_data();
  a.cast_fp8 = at.fp8_cast != 0;
  a.ue8m0 = at.ue8m0 != 0;
  a.num_tokens = static_cast<int>(xd[0]);
  a.hidden = static_cast<int>(xd[1]);
  a.topk = static_cast<int>(td[1]);
  a.num_experts = at.num_experts;
  a.expert_alignment = at.expert_alignment;
  a.layout = at.layout == 1 ? EpLayout::kExpert : EpLayout::kRank;
  a.num_sms = at.num_sms;
  a.start = at.start != 0;
  a.recv_sms = at.recv_sms;

  const bool fp8_in = a.x_dtype == EpDtype::kFp8E4m3;
  const bool fp8 = fp8_in || a.cast_fp8;
  const auto rd = recv_x->dimensions();
  if (rd.size() != 2 || rd[1] != xd[1]) return Invalid(kOp, "recv_x must be [C, H], got " + Dims(rd));
  const int64_t C = rd[0];
  a.capacity = static_cast<int>(C);
  const ffi::DataType want = fp8 ? ffi::DataType::F8E4M3FN : x.element_type();
  if (recv_x->element_type() != want) return Invalid(kOp, "recv_x dtype does not match x (or e4m3 for fp8_cast)");
  const int64_t H128 = xd[1] / 128;
  if (fp8_in && (x_scales.dimensions().size() != 2 || x_scales.dimensions()[0] != xd[0] ||
                 x_scales.dimensions()[1] != H128))
    return Invalid(kOp, "x_scales must be f32 [T, H/128] for an FP8 x, got " + Dims(x_scales.dimensions()));
  if (fp8 && recv_scales->element_count() != static_cast<size_t>(C * H128))
    return Invalid(kOp, "recv_scales must be [C, H/128], got " + Dims(recv_scales->dimensions()));
  a.x_scales = fp8_in ? x_scales.typed_data() : nullptr;
  a.recv_x = recv_x->untyped_data();
  a.recv_scales = fp8 ? recv_scales->typed_data() : nullptr;
  const int64_t El = R > 0 ? at.num_experts / R : 0;
  const int64_t K = td[1];
  const size_t meta_elems = static_cast<size_t>(at.layout == 1 ? C : C * K);
  if (recv_topk_idx->element_count() != meta_elems || recv_topk_weights->element_count() != meta_elems)
    return Invalid(kOp, "recv_topk_idx / recv_topk_weights must be [C, K] (rank) or [C] (expert)");
  if (counts->element_count() != static_cast<size_t>(at.layout == 1 ? El : R))
    return Invalid(kOp, "counts must be [R] (rank) or [E/R] (expert), got " + Dims(counts->dimensions()));
  if (pos_in_rank->element_count() != static_cast<size_t>(xd[0] * R))
    return Invalid(kOp, "pos_in_rank must be [T, R=" + std::to_string(R) + "]");
  if (recv_src_rank->element_count() != static_cast<size_t>(C) ||
      recv_src_token->element_count() != static_cast<size_t>(C) ||
      recv_src_k->element_count() != static_cast<size_t>(C))
    return Invalid(kOp, "recv_src_rank / recv_src_token / recv_src_k must be [C]");
  if (recv_counts->element_count() != static_cast<size_t>(R)) return Invalid(kOp, "recv_counts must be [R]");
  a.recv_topk_idx = recv_topk_idx->typed_data();
  a.recv_topk_weights = recv_topk_weights->typed_data();
  a.counts = counts->typed_data();
  a.pos_in_rank = pos_in_rank->typed_data();
  a.recv_src_rank = recv_src_rank->typed_data();
  a.recv_src_token = recv_src_token->typed_data();
  a.recv_src_k = recv_src_k->typed_data();
  a.recv_counts = recv_counts->typed_data();

  if (std::string msg = ValidateDispatch(a, peers); !msg.empty()) return Invalid(kOp, msg);
  // Engram tables this dispatch's window area overwrites are stale from now
  // on: a later fetch of one reports it instead of reading these rows.
  cudaStream_t s = stream;
  if (ffi::Error err = EnterStream(*lease.dev, kOp, at.start ? kOp : nullptr, stream, &s); err.failure()) {
    return err;
  }
  if (ffi::Error err = ClearOverwrittenTables(*lease.dev, DispatchWindowNeed(a, peers.nranks), s);
      err.failure()) {
    return err;
  }
  notice.Launched();
  if (cudaError_t err = LaunchDispatch(a, peers, s); err != cudaSuccess) {
    return CudaError(err, "dispatch launch");
  }
  if (at.start) return LeaveStream(*lease.dev, kOp);  // its done does the check
  return EndCall(lease, stream);
}

ffi::Error CombineExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                          CombineAttrs at, ffi::AnyBuffer y,
                          ffi::Buffer<ffi::F32> weights,
                          ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::S32> pos_in_rank,
                          ffi::Buffer<ffi::S32> recv_src_rank, ffi::Buffer<ffi::S32> recv_src_token,
                          ffi::Buffer<ffi::S32> recv_src_k, ffi::Buffer<ffi::S32> recv_counts,
                          ffi::Result<ffi::AnyBuffer> out) {
  const char* kOp = at.start ? "combine_start" : "combine";
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, at.comm_id, device_ordinal, kOp, lease, /*gin_data_path=*/true); err.failure()) {
    return err;
  }
  RefusalNotice notice(lease, stream, kCombineBarriers);
  const EpPeers peers = lease.dev->peers();
  const int64_t R = peers.nranks;
  const auto yd = y.dimensions();
  const auto td = topk_idx.dimensions();
  if (yd.size() != 2) return Invalid(kOp, "y must be [C, H], got " + Dims(yd));
  if (td.size() != 2) return Invalid(kOp, "topk_idx must be [T, K], got " + Dims(td));
  if (at.layout != 0 && at.layout != 1) return Invalid(kOp, "layout must be 0 (rank) or 1 (expert)");
  const int64_t C = yd[0], T = td[0];
  CombineArgs a;
  if (!ToEpDtype(y.element_type(), &a.y_dtype) || a.y_dtype == EpDtype::kFp8E4m3)
    return Invalid(kOp, "y dtype must be bf16, f16 or f32");
  if (at.has_weights && weights.element_count() != static_cast<size_t>(C)) return Invalid(kOp, "weights must be [C]");
  if (pos_in_rank.element_count() != static_cast<size_t>(T * R)) return Invalid(kOp, "pos_in_rank must be [T, R]");
  if (recv_src_rank.element_count() != static_cast<size_t>(C) ||
      recv_src_token.element_count() != static_cast<size_t>(C) ||
      recv_src_k.element_count() != static_cast<size_t>(C))
    return Invalid(kOp, "recv_src_rank / recv_src_token / recv_src_k must be [C]");
  if (recv_counts.element_count() != static_cast<size_t>(R)) return Invalid(kOp, "recv_counts must be [R]");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != T || od[1] != yd[1] || out->element_type() != y.element_type())
    return Invalid(kOp, "out must be [T, H] of y's dtype, got " + Dims(od));
  a.y = y.untyped_data();
  a.weights = at.has_weights ? weights.typed_data() : nullptr;
  a.topk_idx = topk_idx.typed_data();
  a.pos_in_rank = pos_in_rank.typed_data();
  a.recv_src_rank = recv_src_rank.typed_data();
  a.recv_src_token = recv_src_token.typed_data();
  a.recv_src_k = recv_src_k.typed_data();
  a.recv_counts = recv_counts.typed_data();
  a.num_tokens = static_cast<int>(T);
  a.hidden = static_cast<int>(yd[1]);
  a.topk = static_cast<int>(td[1]);
  a.num_experts = at.num_experts;
  a.capacity = static_cast<int>(C);
  a.layout = at.layout == 1 ? EpLayout::kExpert : EpLayout::kRank;
  a.num_sms = at.num_sms;
  a.start = at.start != 0;
  a.recv_sms = at.recv_sms;
  a.out = out->untyped_data();
  if (std::string msg = ValidateCombine(a, peers); !msg.empty()) return Invalid(kOp, msg);
  cudaStream_t s = stream;
  if (ffi::Error err = EnterStream(*lease.dev, kOp, at.start ? kOp : nullptr, stream, &s); err.failure()) {
    return err;
  }
  if (ffi::Error err = ClearOverwrittenTables(
          *lease.dev, CombineWindowBytes(peers.nranks, a.num_tokens, a.hidden, a.topk, a.y_dtype, a.layout), s);
      err.failure()) {
    return err;
  }
  notice.Launched();
  if (cudaError_t err = LaunchCombine(a, peers, s); err != cudaSuccess) {
    return CudaError(err, "combine launch");
  }
  if (at.start) return LeaveStream(*lease.dev, kOp);  // its done does the check
  return EndCall(lease, stream);
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchExecute, jax_ep::DispatchExecute,
                              jax_ep::BindEpContext()
                                  .Attrs<jax_ep::DispatchAttrs>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineExecute, jax_ep::CombineExecute,
                              jax_ep::BindEpContext()
                                  .Attrs<jax_ep::CombineAttrs>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>());
