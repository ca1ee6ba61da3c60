// The FFI state shared by every jax_ep handler: created once per call site
// per executable by the instantiate stage and, as measured (docs/design.md §3), shared
// by all local GPUs of that executable; execute picks its device by ordinal.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "runtime/comm.h"
#include "kernels/abort.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

namespace ffi = ::xla::ffi;

struct CommState {
  // Filled in by XLA when Python registers the type (register_ffi_type).
  static inline ffi::TypeId id = XLA_FFI_UNKNOWN_TYPE_ID;

  explicit CommState(std::shared_ptr<CommResources> r) : resources(std::move(r)) {}
  std::shared_ptr<CommResources> resources;
};

inline constexpr ffi::TypeInfo kCommStateTypeInfo = ffi::MakeTypeInfo<CommState>();

// Instantiate stage of every jax_ep target: resolve `comm_id` once.
ffi::ErrorOr<std::unique_ptr<CommState>> InstantiateCommState(ffi::Dictionary attrs);

// What an execute handler needs after the common checks: the device's
// resources and a shared lock that keeps close() from freeing them while
// the handler enqueues.
struct DeviceLease {
  CommResources* comm = nullptr;
  DeviceResources* dev = nullptr;
  std::shared_lock<std::shared_mutex> lock;
};

// Checks that the state matches `comm_id`, that the communicator is open and
// drives `device_ordinal`, and that no earlier kernel left an error in the
// status word (the message names the op and cause). `op` names the caller.
// Unless `gin_data_path` (the op's kernels branch on EpPeers::gin_mask
// wherever they touch a peer), a communicator with GIN peers is refused.
// take_status: refuse the op after a fatal error (IsFatalStatus) a kernel
// reported since the last call (other errors are reported by EndCall); only
// a *_done skips it, so that it always releases its start.
ffi::Error AcquireDevice(CommState* state, int64_t comm_id, int32_t device_ordinal,
                         const char* op, DeviceLease& lease, bool gin_data_path = false,
                         bool take_status = true);

// A window op on a device whose side lane has a start without its done is
// refused: the start's kernels may still be using the window. The refusal
// ends that program, so its done never comes: XLA's stream takes over the
// wait and the lane is free again, and the next program works.
inline ffi::Error RefuseWhileStartPending(DeviceResources& d, const char* op, cudaStream_t xla) {
  if (d.side.pending == nullptr) return ffi::Error::Success();
  const std::string start = d.side.pending;
  SideJoin(d.side, xla);
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("jax_ep ") + op + ": a " + start +
                        " on this device has no matching *_done yet; one start/done pair at a "
                        "time, and no other dispatch, combine, low-latency op or Engram publish "
                        "in between");
}

// The stream an op enqueues on: XLA's, or for a *_start (`start_op` not
// null) the device's side lane after everything already on XLA's stream.
inline ffi::Error EnterStream(DeviceResources& d, const char* op, const char* start_op,
                              cudaStream_t xla, cudaStream_t* s) {
  if (ffi::Error err = RefuseWhileStartPending(d, op, xla); err.failure()) return err;
  *s = xla;
  if (start_op == nullptr) return ffi::Error::Success();
  if (cudaError_t err = SideBegin(d.side, xla, s); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_ep ") + start_op + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// After a *_start's launches: its done waits for them.
inline ffi::Error LeaveStream(DeviceResources& d, const char* start_op) {
  if (start_op == nullptr) return ffi::Error::Success();
  if (cudaError_t err = SideEnd(d.side, start_op); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_ep ") + start_op + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// The end of an op's execute once its kernels are enqueued on `stream`.
// Deferred mode: the op fails with an earlier call's error that
// AcquireDevice took and held, having run anyway so that its peers were not
// left waiting for it. Checked mode (Communicator.create(checked=True)): it
// waits for its own kernels and fails with their error too, so the program
// that caused it fails and fetching any of its results raises
// (docs/errors.md); not while XLA captures the stream into a command buffer
// (no waiting there), where it stays deferred. Before failing, the op waits
// for its kernels (outside capture): XLA may free a failed program's
// buffers, which they are still writing.
inline ffi::Error EndCall(const DeviceLease& lease, cudaStream_t stream) {
  DeviceResources& d = *lease.dev;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool capturing = cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
                         capture != cudaStreamCaptureStatusNone;
  const bool check_now = lease.comm->checked && !capturing;
  if (!check_now && d.held_report.empty()) return ffi::Error::Success();
  if (!capturing) {
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jax_ep: waiting for the kernels: ") +
                                  cudaGetErrorString(err));
    }
  }
  std::string msg = check_now ? lease.comm->TakeReport(d) : std::move(d.held_report);
  d.held_report.clear();
  if (!msg.empty()) return ffi::Error::Internal(msg);
  return ffi::Error::Success();
}

// Declared right after an op's AcquireDevice succeeded: if the op returns
// before Launched() (a bad argument on this rank, a start still pending), its
// peers, which may already wait in the op's `barriers` barriers, are told at
// once (kernels/abort.h) instead of waiting out the timeout. Only where
// it is safe to stand in for those barriers: this process drives just this
// rank (one process runs the same program on all its devices, so they refuse
// alike, and XLA need not run the other devices' part of a failed program),
// no start is pending (its kernels share the epoch counter), and
// AcquireDevice itself did not refuse (after a fatal error the epochs may
// already be out of step). Launched() goes before the launches: once any
// kernel of the op is enqueued it takes part in the barriers itself.
// A low-latency sending call (`low_latency` = its op) has no barrier to
// stand in for: it stands in for the call itself (abort.h LaunchLlRefusal),
// with a refused record for LSA peers and a refusal word and the call's
// signal for GIN peers. An Engram fetch (`engram_fetch`) with a GIN peer
// also stands in for its request / answer exchange (abort.h
// LaunchEngramGinRefusal), after the barriers of a publish fused with it.
class RefusalNotice {
 public:
  RefusalNotice(const DeviceLease& lease, cudaStream_t stream, int barriers, Op low_latency = Op::kNone,
                bool engram_fetch = false)
      : lease_(lease), stream_(stream), barriers_(barriers), low_latency_(low_latency),
        engram_fetch_(engram_fetch) {}
  RefusalNotice(const RefusalNotice&) = delete;
  RefusalNotice& operator=(const RefusalNotice&) = delete;
  ~RefusalNotice() {
    const DeviceResources* d = lease_.dev;
    if (armed_ && d != nullptr && d->counters != nullptr && lease_.comm->devices.size() == 1 &&
        d->nranks > 1 && d->side.pending == nullptr) {
      // best effort
      if (low_latency_ == Op::kNone) LaunchRefusedBarriers(d->peers(), barriers_, stream_);
      else LaunchLlRefusal(d->peers(), low_latency_ == Op::kLowLatencyCombine, d->counters, stream_);
      if (engram_fetch_ && d->gin_mask != 0) LaunchEngramGinRefusal(d->peers(), d->counters, stream_);
    }
  }
  // The op's kernels are about to be enqueued: they take part in the
  // barriers themselves.
  void Launched() { armed_ = false; }

 private:
  const DeviceLease& lease_;
  cudaStream_t stream_;
  int barriers_;
  Op low_latency_;
  bool engram_fetch_;
  bool armed_ = true;
};

// The part of every execute binding that is the same for all jax_ep targets:
// stream, device ordinal and the shared state, in the order the handlers take
// them. Handlers that decode their attributes as one struct (.Attrs<T>())
// start from this; XLA FFI does not let them mix it with single .Attr ones.
inline auto BindEpContext() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<CommState>>();
}

// BindEpContext() plus the `comm_id` attribute, for handlers that bind their
// attributes one by one.
inline auto BindEpExecute() { return BindEpContext().Attr<int64_t>("comm_id"); }

// A bad argument of op `op` (the message names it).
inline ffi::Error Invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string("jax_ep ") + op + ": " + msg);
}

inline std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("jax_ep ") + what + ": " + cudaGetErrorName(err) +
                              " (" + cudaGetErrorString(err) + ")");
}

// An op about to write window bytes [0, end): the Engram tables there are
// stale from now on (a later fetch of one reports it instead of reading the
// op's bytes). Their version words are cleared on `stream`, before the op's
// kernels, so that a replayed command buffer clears them too.
inline ffi::Error ClearOverwrittenTables(const DeviceResources& d, size_t end, cudaStream_t stream) {
  if (cudaError_t err = LaunchEngramClear(d.engram_versions->Overlapping(0, end), d.engram_words(),
                                          stream);
      err != cudaSuccess) {
    return CudaError(err, "clearing the Engram tables this op overwrites");
  }
  return ffi::Error::Success();
}

}  // namespace jax_ep
