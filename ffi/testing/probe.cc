// FFI target "jax_ep_probe_all_to_all", built only with JAX_EP_TESTING=ON: a
// check of the communicator (windows, LSA barriers), not an op. Execute
// stage; the instantiate stage is the ops' own (handlers/bindings.cc).
#include <cstdint>
#include <string>

#include "handlers/state.h"
#include "testing/probe.cuh"

namespace jax_ep {
namespace {

ffi::Error ProbeAllToAllExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                int64_t comm_id, ffi::AnyBuffer x,
                                ffi::Result<ffi::AnyBuffer> out) {
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, "probe_all_to_all", lease);
      err.failure()) {
    return err;
  }
  const DeviceResources& dev = *lease.dev;
  const auto dims = x.dimensions();
  if (dims.size() == 0 || dims[0] != dev.nranks) {
    return ffi::Error::InvalidArgument(
        "jax_ep probe_all_to_all: x must have a leading axis of size num_ranks=" +
        std::to_string(dev.nranks));
  }
  if (out->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_ep probe_all_to_all: out must have x's shape and dtype");
  }
  const size_t row_bytes = x.size_bytes() / static_cast<size_t>(dev.nranks);
  const size_t need = ProbeWindowBytes(row_bytes, dev.nranks);
  if (need > dev.window_bytes) {
    return ffi::Error::InvalidArgument(
        "jax_ep probe_all_to_all: needs " + std::to_string(need) +
        " bytes of symmetric window but the Communicator has " + std::to_string(dev.window_bytes) +
        "; create it with a larger num_bytes");
  }
  ProbeArgs args;
  args.x = static_cast<const char*>(x.untyped_data());
  args.out = static_cast<char*>(out->untyped_data());
  args.row_bytes = row_bytes;
  if (cudaError_t err = LaunchProbeAllToAll(args, dev.devcomm, dev.peers(), stream);
      err != cudaSuccess) {
    return CudaError(err, "probe_all_to_all launch");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpProbeAllToAllExecute, jax_ep::ProbeAllToAllExecute,
                              jax_ep::BindEpExecute()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
