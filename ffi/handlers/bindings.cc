// nanobind surface of the CUDA build: communicator lifetime, the FFI handler
// and state-type capsules, and small diagnostics. The shared instantiate stage
// and the common execute-time checks live here too, next to the registration.
// What only tests and benchmarks use (virtual ranks, the probe, device
// timers) is in ffi/testing/ and exists only with JAX_EP_TESTING=ON.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/comm.h"
#include "handlers/state.h"
#include "kernels/gin.cuh"
#include "kernels/engram_layout.h"
#include "kernels/grouped_gemm.h"
#include "kernels/low_latency.cuh"
#include "kernels/mega_layout.h"
#include "kernels/window_layout.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchLayoutExecute);
#ifdef JAX_EP_TESTING
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpProbeAllToAllExecute);
#endif
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCombineExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpEngramPublishExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpEngramFetchExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpEngramPublishFetchExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpGroupedGemmExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpEngramGradExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpGroupedGemmFp8Execute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpFp8CastWeightsExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpFp8CastTokensExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchSendExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchRecvExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineSendExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineRecvExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpSideDoneExecute);

namespace jax_ep {

ffi::ErrorOr<std::unique_ptr<CommState>> InstantiateCommState(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> comm_id = attrs.get<int64_t>("comm_id");
  if (comm_id.has_error()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jax_ep: custom call has no int64 attribute comm_id: " + comm_id.error().message()));
  }
  std::shared_ptr<CommResources> res = LookupComm(*comm_id);
  if (res == nullptr) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jax_ep: communicator " + std::to_string(*comm_id) +
        " is not open in this process (closed, or never created here); create the "
        "Communicator before running the computation that uses it"));
  }
  return std::make_unique<CommState>(std::move(res));
}

ffi::Error AcquireDevice(CommState* state, int64_t comm_id, int32_t device_ordinal, const char* op,
                         DeviceLease& lease, bool gin_data_path, bool take_status) {
  if (state == nullptr || state->resources == nullptr) {
    return ffi::Error::Internal(std::string("jax_ep ") + op + ": missing communicator state");
  }
  CommResources* comm = state->resources.get();
  if (comm->comm_id != comm_id) {
    return ffi::Error::Internal(std::string("jax_ep ") + op + ": state holds communicator " +
                                std::to_string(comm->comm_id) + " but the call names " +
                                std::to_string(comm_id));
  }
  lease.lock = std::shared_lock<std::shared_mutex>(comm->mutex());
  if (comm->closed()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("jax_ep ") + op + ": communicator " + std::to_string(comm_id) +
                          " was closed; create a new Communicator (and re-trace) to continue");
  }
  DeviceResources* dev = comm->ForOrdinal(device_ordinal);
  // One device per process (the jax.distributed path): whatever numbering
  // XLA reports for its only device, it can only be ours.
  if (dev == nullptr && comm->devices.size() == 1) dev = &comm->devices[0];
  if (dev == nullptr) {
    return ffi::Error::InvalidArgument(std::string("jax_ep ") + op + ": communicator " +
                                       std::to_string(comm_id) + " does not drive device " +
                                       std::to_string(device_ordinal) +
                                       " (is the op used on a mesh other than the "
                                       "Communicator's?)");
  }
  lease.comm = comm;
  lease.dev = dev;
  ++dev->calls;
  if (!take_status) return ffi::Error::Success();
  // An error a kernel reported since the last call: after a fatal one
  // (IsFatalStatus) this op is refused before it enqueues anything. Any other
  // is taken off the word now (the op's kernels read it: a set word makes
  // them fail) and held, so the op runs, its peers are not left waiting for
  // it, and EndCall then reports the error.
  const uint32_t pending = comm->PeekStatus(*dev);
  if (IsFatalStatus(pending)) return ffi::Error::Internal(comm->TakeReport(*dev));
  if (pending != 0) comm->HoldStatus(*dev);
  // Ops whose kernels reach every peer through its LSA pointer, which a GIN
  // peer does not have, are refused rather than let write through a null
  // one. Normal dispatch / combine branch on EpPeers::gin_mask wherever
  // they touch a peer.
  if (dev->gin_mask != 0 && !gin_data_path) {
    std::string peers;
    for (int j = 0; j < dev->nranks; ++j) {
      if ((dev->gin_mask >> j) & 1u) peers += (peers.empty() ? "" : ", ") + std::to_string(j);
    }
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string("jax_ep ") + op + " (EP rank " + std::to_string(dev->rank) +
                          "): EP rank(s) " + peers +
                          " are reached by GIN on this communicator, and this op has no GIN "
                          "data path yet; put the EP axis on GPUs of one NVLink domain");
  }
  lease.comm = comm;
  lease.dev = dev;
  return ffi::Error::Success();
}

}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpInstantiate, jax_ep::InstantiateCommState,
                              xla::ffi::Ffi::BindInstantiate().Attrs<xla::ffi::Dictionary>());

namespace {

nb::capsule HandlerCapsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Bundle(XLA_FFI_Error* (*execute)(XLA_FFI_CallFrame*)) {
  nb::dict d;
  d["instantiate"] = HandlerCapsule(JaxEpInstantiate);
  d["execute"] = HandlerCapsule(execute);
  return d;
}

jax_ep::GroupSpec MakeGroup(const nb::bytes& unique_id, int nranks, std::vector<int> ranks,
                            std::vector<int> device_ordinals) {
  jax_ep::GroupSpec g;
  if (unique_id.size() != sizeof(g.id)) {
    throw std::invalid_argument("unique_id must be " + std::to_string(sizeof(g.id)) +
                                " bytes (from get_unique_id()), got " +
                                std::to_string(unique_id.size()));
  }
  std::memcpy(&g.id, unique_id.c_str(), sizeof(g.id));
  g.nranks = nranks;
  g.ranks = std::move(ranks);
  g.device_ordinals = std::move(device_ordinals);
  return g;
}

}  // namespace

#ifdef JAX_EP_TESTING
void RegisterTestingBindings(nb::module_& m);  // testing/bindings.cc
#endif

void RegisterCudaBindings(nb::module_& m) {
  m.def(
      "get_unique_id",
      [] {
        ncclUniqueId id = jax_ep::NewUniqueId();
        return nb::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
      },
      "A fresh NCCL unique id (bytes) for one EP group.");

  m.def(
      "comm_create",
      [](nb::bytes unique_id, int nranks, std::vector<int> ranks, std::vector<int> device_ordinals,
         size_t num_bytes, double timeout_s) {
        std::vector<jax_ep::GroupSpec> groups;
        groups.push_back(MakeGroup(unique_id, nranks, std::move(ranks), std::move(device_ordinals)));
        nb::gil_scoped_release release;  // blocks until every rank has joined
        return jax_ep::CreateComm(groups, num_bytes, timeout_s);
      },
      nb::arg("unique_id"), nb::arg("nranks"), nb::arg("ranks"), nb::arg("device_ordinals"),
      nb::arg("num_bytes"), nb::arg("timeout_s"),
      "Creates one EP group's communicator over the listed local devices; returns comm_id.");

  m.def(
      "comm_create_groups",
      [](std::vector<std::tuple<nb::bytes, int, std::vector<int>, std::vector<int>>> specs,
         size_t num_bytes, double timeout_s, bool checked, std::string transport) {
        std::vector<jax_ep::GroupSpec> groups;
        for (auto& [uid, nranks, ranks, ordinals] : specs)
          groups.push_back(MakeGroup(uid, nranks, std::move(ranks), std::move(ordinals)));
        nb::gil_scoped_release release;
        return jax_ep::CreateComm(groups, num_bytes, timeout_s, checked, transport);
      },
      nb::arg("groups"), nb::arg("num_bytes"), nb::arg("timeout_s"), nb::arg("checked") = false,
      nb::arg("transport") = "",
      "Like comm_create for several EP groups at once (every local device of a mesh), "
      "groups = [(unique_id, nranks, ranks, device_ordinals), ...]; one comm_id for all.");

  m.def(
      "comm_destroy",
      [](int64_t comm_id) {
        nb::gil_scoped_release release;
        jax_ep::DestroyComm(comm_id);
      },
      nb::arg("comm_id"), "Closes the communicator (collective; idempotent).");

  m.def(
      "comm_info",
      [](int64_t comm_id) {
        auto res = jax_ep::LookupComm(comm_id);
        if (res == nullptr) throw std::invalid_argument("unknown comm_id " + std::to_string(comm_id));
        nb::list devices;
        for (const auto& d : res->devices) {
          nb::dict e;
          e["device_ordinal"] = d.device_ordinal;
          e["rank"] = d.rank;
          e["nranks"] = d.nranks;
          e["group"] = d.group;
          e["window_bytes"] = d.window_bytes;
          e["calls"] = d.calls;
          e["lsa_size"] = d.devcomm.lsaSize;
          e["gin_mask"] = d.gin_mask;
          e["gin_emulated"] = d.gin_emulated;
          devices.append(e);
        }
        return devices;
      },
      nb::arg("comm_id"),
      "Per local device: ordinal, rank, nranks, group, window_bytes, lsa_size, gin_mask, "
      "gin_emulated.");

  m.def(
      "transport_plan",
      [](int rank, std::vector<int> lsa_member, bool force_gin, const std::string& gin,
         int nccl_version, bool emulate) {
        const int n = static_cast<int>(lsa_member.size());
        if (n < 1 || n > 32 || rank < 0 || rank >= n) {
          throw std::invalid_argument("need 1..32 ranks and 0 <= rank < len(lsa_member)");
        }
        jax_ep::TransportInputs in;
        in.rank = rank;
        for (int member : lsa_member) in.lsa_member.push_back(member != 0);
        in.force_gin = force_gin || emulate;
        in.emulate_gin = emulate;
        in.nccl_version = nccl_version;
        if (gin == "not_built") in.gin = jax_ep::GinSupport::kNotBuilt;
        else if (gin == "untested") in.gin = jax_ep::GinSupport::kUntested;
        else if (gin == "no_device") in.gin = jax_ep::GinSupport::kNoDevice;
        else if (gin == "rail_only") in.gin = jax_ep::GinSupport::kRailOnly;
        else if (gin == "available") in.gin = jax_ep::GinSupport::kAvailable;
        else throw std::invalid_argument("unknown GIN support '" + gin + "'");
        const jax_ep::TransportPlan plan = jax_ep::PlanTransports(in);
        std::vector<std::string> names;
        for (jax_ep::Transport t : plan.per_peer) {
          names.push_back(t == jax_ep::Transport::kSelf ? "self"
                          : t == jax_ep::Transport::kLsa ? "lsa" : "gin");
        }
        return std::make_tuple(names, plan.gin_mask, plan.error);
      },
      nb::arg("rank"), nb::arg("lsa_member"), nb::arg("force_gin"), nb::arg("gin"),
      nb::arg("nccl_version"), nb::arg("emulate") = false,
      "The per-peer transport choice made at create, as a pure function: "
      "(['self'|'lsa'|'gin' per rank], gin_mask, error message or ''). gin is one of "
      "not_built, untested, no_device, rail_only, available; emulate: "
      "transport gin_emulated (GIN carried over NVLink; implies force_gin).");

  m.def(
      "status_message",
      [](int64_t comm_id) -> std::string {
        auto res = jax_ep::LookupComm(comm_id);
        if (res == nullptr) return "";
        return res->TakeStatusMessage();
      },
      nb::arg("comm_id"),
      "Reads and clears the device status words; '' when no kernel reported an error. "
      "Only reports what finished kernels wrote: synchronise first.");

  m.def(
      "describe_status",
      [](uint32_t code, int rank, int device_ordinal, double timeout_s, unsigned long long call) {
        return jax_ep::DescribeStatus(code, rank, device_ordinal, timeout_s, call);
      },
      nb::arg("code"), nb::arg("rank"), nb::arg("device_ordinal"), nb::arg("timeout_s"),
      nb::arg("call") = 0,
      "The message of a status code (what a kernel's error becomes); for tests.");

  m.def("is_fatal_status", &jax_ep::IsFatalStatus, nb::arg("code"),
        "True when the next op after this status code is refused (runtime/status.h IsFatalStatus); for tests.");

  m.def("nccl_version", [] { return jax_ep::NcclVersions(); },
        "(NCCL_VERSION_CODE compiled against, ncclGetVersion() loaded)");

  m.def("registrations", [] {
    nb::dict d;
    d["jax_ep_dispatch_layout"] = Bundle(JaxEpDispatchLayoutExecute);
#ifdef JAX_EP_TESTING
    d["jax_ep_probe_all_to_all"] = Bundle(JaxEpProbeAllToAllExecute);
#endif
    d["jax_ep_dispatch"] = Bundle(JaxEpDispatchExecute);
    d["jax_ep_combine"] = Bundle(JaxEpCombineExecute);
    d["jax_ep_engram_publish"] = Bundle(JaxEpEngramPublishExecute);
    d["jax_ep_engram_fetch"] = Bundle(JaxEpEngramFetchExecute);
    d["jax_ep_engram_publish_fetch"] = Bundle(JaxEpEngramPublishFetchExecute);
    d["jax_ep_ll_dispatch"] = Bundle(JaxEpLlDispatchExecute);
    d["jax_ep_ll_dispatch_send"] = Bundle(JaxEpLlDispatchSendExecute);
    d["jax_ep_ll_dispatch_recv"] = Bundle(JaxEpLlDispatchRecvExecute);
    d["jax_ep_ll_combine"] = Bundle(JaxEpLlCombineExecute);
    d["jax_ep_ll_combine_send"] = Bundle(JaxEpLlCombineSendExecute);
    d["jax_ep_ll_combine_recv"] = Bundle(JaxEpLlCombineRecvExecute);
    d["jax_ep_side_done"] = Bundle(JaxEpSideDoneExecute);
    nb::dict stateless;  // needs no communicator: execute stage only
    stateless["execute"] = HandlerCapsule(JaxEpGroupedGemmExecute);
    d["jax_ep_grouped_gemm"] = stateless;
    nb::dict stateless_fp8;
    stateless_fp8["execute"] = HandlerCapsule(JaxEpGroupedGemmFp8Execute);
    d["jax_ep_grouped_gemm_fp8"] = stateless_fp8;
    nb::dict cast_weights;
    cast_weights["execute"] = HandlerCapsule(JaxEpFp8CastWeightsExecute);
    d["jax_ep_fp8_cast_weights"] = cast_weights;
    nb::dict cast_tokens;
    cast_tokens["execute"] = HandlerCapsule(JaxEpFp8CastTokensExecute);
    d["jax_ep_fp8_cast_tokens"] = cast_tokens;
    nb::dict stateless_grad;
    stateless_grad["execute"] = HandlerCapsule(JaxEpEngramGradExecute);
    d["jax_ep_engram_grad"] = stateless_grad;
    return d;
  }, "FFI targets: name -> {'instantiate': capsule, 'execute': capsule}.");

  m.def("state_type", [] {
    nb::dict d;
    d["type_id"] = nb::capsule(reinterpret_cast<void*>(&jax_ep::CommState::id));
    d["type_info"] = nb::capsule(
        const_cast<void*>(reinterpret_cast<const void*>(&jax_ep::kCommStateTypeInfo)));
    return nb::make_tuple("jax_ep.CommState", d);
  }, "(name, {'type_id': capsule, 'type_info': capsule}) for jax.ffi.register_ffi_type.");

  m.def(
      "ll_window_bytes",
      [](int R, int M, int H, int K, int E, int64_t reserved_bytes, bool gin) {
        return jax_ep::LlWindowBytes(R, M, H, K, E, static_cast<size_t>(reserved_bytes), gin);
      },
      nb::arg("num_ranks"), nb::arg("max_tokens"), nb::arg("hidden"), nb::arg("topk"),
      nb::arg("num_experts"), nb::arg("reserved_bytes") = 0, nb::arg("gin") = false,
      "Window bytes the low-latency kernels lay out (kernels/low_latency.cuh), with the "
      "staging area of GIN peers when `gin`; jax_ep._window.low_latency_bytes must agree "
      "with it.");

  m.def(
      "mega_window_bytes",
      [](int R, int T, int H, int K, int E, int64_t reserved_bytes) {
        const size_t base = std::max(static_cast<size_t>(reserved_bytes),
                                     static_cast<size_t>(jax_ep::kWindowHeaderBytes));
        return jax_ep::MegaWindow::At(base, R, T, H, K, E).end;
      },
      nb::arg("num_ranks"), nb::arg("tokens_per_rank"), nb::arg("hidden"), nb::arg("topk"),
      nb::arg("num_experts"), nb::arg("reserved_bytes") = 0,
      "Window bytes the fused MoE lays out (kernels/mega_layout.h) above `reserved_bytes`; "
      "jax_ep._window.mega_moe_bytes must agree with it.");

  m.def(
      "window_bytes_needed",
      [](int R, int T, int H, int K, int E, int x_bytes, bool fp8, int y_bytes) {
        return jax_ep::WindowBytesNeeded(R, T, H, K, E, x_bytes, fp8, y_bytes);
      },
      nb::arg("num_ranks"), nb::arg("tokens_per_rank"), nb::arg("hidden"), nb::arg("topk"),
      nb::arg("num_experts"), nb::arg("x_bytes"), nb::arg("fp8"), nb::arg("y_bytes"),
      "The kernels' own window need for normal dispatch + combine (window_layout.h); "
      "jax_ep._ffi_dispatch.window_bytes_needed must agree with it.");

  m.def(
      "engram_window_bytes",
      [](int64_t rows_per_rank, int64_t row_bytes, int64_t reserved_bytes, int64_t end_offset,
         int gin_ranks, int64_t gin_rows) {
        const size_t gin = gin_ranks > 0 ? jax_ep::EngramGinArea::Bytes(gin_ranks, gin_rows,
                                                                          static_cast<size_t>(row_bytes))
                                         : 0;
        return jax_ep::EngramWindow(0, rows_per_rank, static_cast<size_t>(row_bytes),
                                    static_cast<size_t>(reserved_bytes),
                                    static_cast<size_t>(end_offset), gin)
            .need;
      },
      nb::arg("rows_per_rank"), nb::arg("row_bytes"), nb::arg("reserved_bytes") = 0,
      nb::arg("end_offset") = 0, nb::arg("gin_ranks") = 0, nb::arg("gin_rows") = 0,
      "Smallest window that holds an Engram table shard above reserved_bytes and, for a fetch "
      "of gin_rows rows at gin_ranks ranks with GIN peers, its request/answer scratch "
      "(EngramWindow::need, EngramGinArea, kernels/engram_layout.h); "
      "jax_ep._window.engram_bytes must agree with it.");

  m.def(
      "grouped_gemm_workspace_bytes",
      [](int kind, bool out_f32, int num_groups, int sms, int schedule) {
        jax_ep::GroupedGemmArgs g;
        g.kind = static_cast<jax_ep::GgKind>(kind);
        g.out_dtype = out_f32 ? jax_ep::GgOut::kF32 : jax_ep::GgOut::kBF16;
        g.num_groups = num_groups;
        g.schedule = schedule;
        return jax_ep::GroupedGemmScratchBytes(g, sms);
      },
      nb::arg("kind"), nb::arg("out_f32"), nb::arg("num_groups"), nb::arg("sms"),
      nb::arg("schedule") = 0,
      "Workspace bytes of one grouped GEMM call on up to `sms` SMs (per-group "
      "arrays + CUTLASS's workspace).");

  m.attr("lsa_barrier_count") = jax_ep::kLsaBarrierCount;
  m.attr("gin_built") = static_cast<bool>(JAX_EP_HAVE_GIN);
  m.attr("window_header_bytes") = jax_ep::kWindowHeaderBytes;
  m.attr("chunks_per_source") = jax_ep::kChunksPerSource;
  m.attr("max_ranks") = jax_ep::kMaxRanks;
  m.attr("ll_max_tokens") = jax_ep::kLlMaxTokens;
#ifdef JAX_EP_TESTING
  RegisterTestingBindings(m);
#endif
}
