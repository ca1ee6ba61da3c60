// `*_done` of the normal ops' start/done pairs (side_lane.h): XLA's stream
// waits for the kernels the start put on the side lane. Its operands are the
// start's results (aliased to its own results, so XLA reads them only through
// the done) and, after them, whatever must stay alive or be computed before
// the wait (the start's inputs, the compute to overlap).
#include <string>

#include "handlers/state.h"

namespace jax_ep {
namespace {

ffi::Error SideDoneExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                           int64_t comm_id, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr const char* kOp = "*_done";
  DeviceLease lease;
  // No status check here: the done must release its start whatever the
  // kernels reported; the next op on the communicator reports it.
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kOp, lease,
                                     /*gin_data_path=*/true, /*take_status=*/false);
      err.failure()) {
    return err;
  }
  DeviceResources& d = *lease.dev;
  if (d.side.pending == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_ep *_done: no dispatch_start / combine_start is pending on this device");
  }
  const std::string op = d.side.pending;
  if (cudaError_t err = SideJoin(d.side, stream); err != cudaSuccess) return CudaError(err, "*_done");
  // A result that is not its operand's buffer means XLA copied the operand
  // before this wait, i.e. before the side kernels finished writing it.
  if (rets.size() > args.size()) return Invalid(kOp, "more results than operands");
  for (size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> a = args.get<ffi::AnyBuffer>(i);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r = rets.get<ffi::AnyBuffer>(i);
    if (a.has_error() || r.has_error()) return Invalid(kOp, "operands and results must be buffers");
    if (a->untyped_data() != (*r)->untyped_data() && a->size_bytes() > 0) {
      return ffi::Error::Internal("jax_ep " + op + " / done: XLA gave result " + std::to_string(i) +
                                  " its own buffer instead of aliasing the start's, so it read the "
                                  "start's result before the kernels finished; use each *_start's "
                                  "result only through its *_done");
    }
  }
  // Checked mode: the start's error is this done's (XLA's stream now waits
  // for the start's kernels).
  return EndCall(lease, stream);
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpSideDoneExecute, jax_ep::SideDoneExecute,
                              jax_ep::BindEpExecute().RemainingArgs().RemainingRets());
