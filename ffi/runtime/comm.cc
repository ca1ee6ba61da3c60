// Communicator registry (see comm.h). Compiled by nvcc: it holds the one tiny
// kernel that asks the NCCL device API for the LSA addresses of the windows.
#include "comm.h"

#include <cuda_runtime.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "kernels/gin.cuh"
#include "kernels/kernel_load.h"

namespace jax_ep {
namespace {

[[noreturn]] void Fail(const std::string& what) { throw std::runtime_error("jax_ep: " + what); }

void CheckCuda(cudaError_t err, const char* call, int device) {
  if (err != cudaSuccess) {
    Fail(std::string(call) + " failed on device " + std::to_string(device) + ": " +
         cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

void CheckNccl(ncclResult_t res, const char* call, ncclComm_t comm = nullptr) {
  if (res != ncclSuccess && res != ncclInProgress) {
    std::string msg = std::string(call) + " failed: " + ncclGetErrorString(res);
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') msg += std::string(" (") + last + ")";
    Fail(msg);
  }
}

// Teardown never throws: it reports and carries on, so one failed step does
// not leak the rest.
void Warn(const char* call, const char* msg) {
  std::fprintf(stderr, "jax_ep: warning: %s during communicator close: %s\n", call, msg);
}
void WarnCuda(cudaError_t err, const char* call) {
  if (err != cudaSuccess) Warn(call, cudaGetErrorString(err));
}
void WarnNccl(ncclResult_t res, const char* call) {
  if (res != ncclSuccess) Warn(call, ncclGetErrorString(res));
}

// Restores the caller's current device: JAX and other libraries assume
// nobody changes it behind their back.
class DeviceGuard {
 public:
  DeviceGuard() { had_ = cudaGetDevice(&prev_) == cudaSuccess; }
  ~DeviceGuard() {
    if (had_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool had_ = false;
};

// An NCCL group that is always ended, also when a call inside it throws;
// collective setup calls for several local devices must share one group or
// the first call would wait forever for its peers on the same thread.
class NcclGroup {
 public:
  NcclGroup() { CheckNccl(ncclGroupStart(), "ncclGroupStart"); }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();
  }
  void End(const char* what) {
    open_ = false;
    CheckNccl(ncclGroupEnd(), what);
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = true;
};

// The window struct lives in device memory; the documented way to turn it
// into addresses is the device-side accessor, so ask a one-warp kernel.
// Only for the ranks in `want`: a rank outside the LSA team has no address.
__global__ void LsaPointersKernel(ncclWindow_t window, int nranks, uint32_t want, char** out) {
  const int peer = threadIdx.x;
  // Peer pointer by world (= EP) rank: NCCL maps the LSA team's windows into
  // one flat range, so even this rank's own entry is an alias of the
  // ncclMemAlloc pointer at another virtual address.
  if (peer < nranks) {
    out[peer] = ((want >> peer) & 1u) ? static_cast<char*>(ncclGetPeerPointer(window, 0, peer))
                                      : nullptr;
  }
}

struct Registry {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<CommResources>> comms;
  int64_t next_id = 1;
};

// Deliberately never destroyed (see comm.h: no collective teardown at exit).
Registry& GetRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

void CheckVersion() {
  int runtime = 0;
  CheckNccl(ncclGetVersion(&runtime), "ncclGetVersion");
  if (runtime != NCCL_VERSION_CODE) {
    Fail("NCCL version mismatch: jax_ep was compiled against NCCL " +
         std::to_string(NCCL_VERSION_CODE) + " but the loaded libnccl is " +
         std::to_string(runtime) +
         "; the device API (ncclDevComm layout, barriers) is only compatible with the "
         "headers it was built with. Rebuild jax_ep against the NCCL that JAX loads "
         "(the nvidia-nccl-cu* wheel).");
  }
}

void SetupOneDevice(DeviceResources& d) {
  CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
  CheckNccl(ncclMemAlloc(&d.window_ptr, d.window_bytes), "ncclMemAlloc", d.comm);
  // Zeroed header: barrier flags and epochs start at 0 on every rank.
  CheckCuda(cudaMemset(d.window_ptr, 0, d.window_bytes), "cudaMemset(window)", d.device_ordinal);
  CheckCuda(cudaHostAlloc(reinterpret_cast<void**>(&d.status_host), kStatusBytes,
                          cudaHostAllocMapped | cudaHostAllocPortable),
            "cudaHostAlloc(status word)", d.device_ordinal);
  std::memset(d.status_host, 0, kStatusBytes);
  CheckCuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d.status_dev), d.status_host, 0),
            "cudaHostGetDevicePointer(status word)", d.device_ordinal);
  CheckCuda(cudaMalloc(reinterpret_cast<void**>(&d.counters),
                       kNumDeviceCounters * sizeof(unsigned long long)),
            "cudaMalloc(counters)", d.device_ordinal);
  CheckCuda(cudaMemset(d.counters, 0, kNumDeviceCounters * sizeof(unsigned long long)),
            "cudaMemset(counters)", d.device_ordinal);
}

static_assert(kEngramVersionCounter - kGinSnapshotCounter == kGinSignalCount,
              "one snapshot counter per GIN signal");

// The transport choice: Communicator.create(transport=...); "" is "auto".
struct TransportChoice {
  bool force_gin = false;
  bool emulate_gin = false;
};
TransportChoice TransportFrom(const std::string& choice) {
  std::string v = choice;
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v.empty() || v == "auto") return {};
  if (v == "gin") return {true, false};
  if (v == "gin_emulated") return {true, true};
  Fail("transport=" + choice +
       " is not understood: use 'auto' (the default: NVLink inside NCCL's LSA team, GIN "
       "beyond it), 'gin' (every remote peer over GIN, to test that path) or 'gin_emulated' "
       "(every remote peer through the GIN code path, carried over NVLink, to test it "
       "without a NIC)");
}

// Asked only when some peer needs GIN. NCCL answers for the whole
// communicator (every rank gets the same answer), so no rank goes on to a
// collective GIN setup that another rank skips.
GinSupport QueryGinSupport(const DeviceResources& d) {
#if !JAX_EP_HAVE_GIN
  (void)d;
  return GinSupport::kNotBuilt;
#elif NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 2)
  ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
  CheckNccl(ncclCommQueryProperties(d.comm, &props), "ncclCommQueryProperties", d.comm);
  if (props.ginType != NCCL_GIN_TYPE_NONE) return GinSupport::kAvailable;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
  if (props.railedGinType != NCCL_GIN_TYPE_NONE) return GinSupport::kRailOnly;
#endif
  return GinSupport::kNoDevice;
#else
  (void)d;
  return GinSupport::kUntested;
#endif
}

TransportInputs DescribePeers(const DeviceResources& d, bool force_gin, bool emulate_gin) {
  TransportInputs in;
  in.rank = d.rank;
  in.device_ordinal = d.device_ordinal;
  in.force_gin = force_gin;
  in.emulate_gin = emulate_gin;
  in.nccl_version = NCCL_VERSION_CODE;
  const ncclTeam_t world = ncclTeamWorld(d.comm);
  const ncclTeam_t lsa = ncclTeamLsa(d.comm);
  in.lsa_member.resize(d.nranks);
  bool needs_gin = false;
  for (int peer = 0; peer < d.nranks; ++peer) {
    in.lsa_member[peer] = ncclTeamRankIsMember(lsa, world, peer);
    needs_gin |= peer != d.rank && (force_gin || !in.lsa_member[peer]);
  }
  // Emulated GIN asks nothing of NCCL's GIN.
  in.gin = needs_gin && !emulate_gin ? QueryGinSupport(d) : GinSupport::kNotBuilt;
  return in;
}

void AddGinRequirements(ncclDevCommRequirements& reqs) {
#if JAX_EP_HAVE_GIN
  reqs.ginSignalCount = kGinSignalCount;
  reqs.ginContextCount = kGinContextCount;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
  reqs.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#else
  reqs.ginForceEnable = true;
#endif
#else
  (void)reqs;
#endif
}

// "" when the device communicator holds the GIN that the kernels will use.
std::string CheckGinDevComm(const DeviceResources& d) {
#if JAX_EP_HAVE_GIN
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
  const int connections = d.devcomm.ginConnectionCount;
#else
  const int connections = d.devcomm.ginContextCount;
#endif
  if (connections < 1) {
    return "NCCL " + NcclVersionString(NCCL_VERSION_CODE) +
           " created the device communicator without GIN connections";
  }
  if (d.devcomm.ginSignalCount < kGinSignalCount) {
    return "NCCL " + NcclVersionString(NCCL_VERSION_CODE) + " gave " +
           std::to_string(d.devcomm.ginSignalCount) + " GIN signals of the " +
           std::to_string(kGinSignalCount) + " asked for";
  }
  return "";
#else
  (void)d;
  return "this jax_ep was built without NCCL's GIN device API";
#endif
}

void UploadGinComm(DeviceResources& d) {
#if JAX_EP_HAVE_GIN
  GinComm g{};
  g.devcomm = d.devcomm;
  g.window = d.window;
  g.signal_base = 0;
  g.signal_count = kGinSignalCount;
  CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
  CheckCuda(cudaMalloc(&d.gin_dev, sizeof(g)), "cudaMalloc(GIN state)", d.device_ordinal);
  CheckCuda(cudaMemcpy(d.gin_dev, &g, sizeof(g), cudaMemcpyHostToDevice), "cudaMemcpy(GIN state)",
            d.device_ordinal);
#else
  (void)d;
  Fail("GIN state requested in a build without GIN");
#endif
}

void FetchPeerPointers(DeviceResources& d) {
  uint32_t want = 0;
  for (int r = 0; r < d.nranks; ++r)
    if (d.gin_emulated || ((d.gin_mask >> r) & 1u) == 0u) want |= 1u << r;
  CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
  char** dev_out = nullptr;
  CheckCuda(cudaMalloc(reinterpret_cast<void**>(&dev_out), kMaxRanks * sizeof(char*)),
            "cudaMalloc(lsa pointers)", d.device_ordinal);
  LsaPointersKernel<<<1, 32>>>(d.window, d.nranks, want, dev_out);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess)
    err = cudaMemcpy(d.peer_base, dev_out, d.nranks * sizeof(char*), cudaMemcpyDeviceToHost);
  cudaFree(dev_out);
  CheckCuda(err, "reading LSA window pointers", d.device_ordinal);
  for (int r = 0; r < d.nranks; ++r) {
    if (((want >> r) & 1u) && d.peer_base[r] == nullptr) {
      Fail("NCCL returned no LSA address for rank " + std::to_string(r) + "'s window");
    }
  }
  // Emulated GIN: only gin.cuh's helpers get a GIN peer's address; the
  // kernels see a null base[j] for it, as with a real GIN.
  for (int r = 0; r < d.nranks; ++r) {
    if (d.gin_emulated && ((d.gin_mask >> r) & 1u)) {
      d.gin_emu_base[r] = d.peer_base[r];
      d.peer_base[r] = nullptr;
    }
  }
}

// e.what() of a Fail() without its "jax_ep: " prefix, to quote inside another.
std::string Unprefixed(const std::exception& e) {
  std::string m = e.what();
  const std::string prefix = "jax_ep: ";
  return m.compare(0, prefix.size(), prefix) == 0 ? m.substr(prefix.size()) : m;
}

}  // namespace

EpPeers DeviceResources::peers() const {
  EpPeers p{};
  for (int r = 0; r < kMaxRanks; ++r) p.base[r] = peer_base[r];
  p.rank = rank;
  p.nranks = nranks;
  p.window_bytes = window_bytes;
  p.status = status_dev;
  p.call = calls;
  p.epoch = counters;
  p.timeout_ns = timeout_ns;
  p.gin_mask = gin_mask;
  p.gin = gin_dev;
  for (int r = 0; r < kMaxRanks; ++r) p.gin_emu[r] = gin_emu_base[r];
  p.gin_emulated = gin_emulated;
  p.gin_snapshot = gin_mask != 0 && counters != nullptr ? counters + kGinSnapshotCounter : nullptr;
  return p;
}

DeviceResources* CommResources::ForOrdinal(int device_ordinal) {
  for (auto& d : devices)
    if (d.device_ordinal == device_ordinal) return &d;
  return nullptr;
}

std::string CommResources::TakeStatusMessage(DeviceResources& dev) {
  if (dev.status_host == nullptr) return "";
  uint32_t code = 0;
  std::string msg = TakeStatusWord(dev.status_host, dev.rank, dev.device_ordinal, timeout_s, &code);
  if (IsLostPeerStatus(code)) MarkBroken();
  return msg;
}

namespace {
// "a; b", or whichever is not empty.
void AppendReport(std::string& to, const std::string& m) {
  if (!m.empty()) to += (to.empty() ? "" : "; ") + m;
}
}  // namespace

void CommResources::HoldStatus(DeviceResources& dev) {
  AppendReport(dev.held_report, TakeStatusMessage(dev));
}

std::string CommResources::TakeReport(DeviceResources& dev) {
  std::string m = std::move(dev.held_report);
  dev.held_report.clear();
  AppendReport(m, TakeStatusMessage(dev));
  return m;
}

uint32_t CommResources::PeekStatus(const DeviceResources& dev) const {
  if (dev.status_host == nullptr) return 0;
  return *static_cast<volatile uint32_t*>(dev.status_host);
}

std::string CommResources::TakeStatusMessage() {
  std::string all;
  for (auto& d : devices) {
    std::string m = TakeReport(d);
    AppendReport(all, m);
  }
  return all;
}

CommResources::~CommResources() { Close(); }

// Close() after a peer was lost: nothing collective. ncclCommAbort tears
// down each communicator (its registrations and device communicator with
// it) without waiting for the peers; then this process's own allocations.
void CommResources::AbortAfterLostPeer() {
  for (auto& d : devices) {
    cudaSetDevice(d.device_ordinal);
    if (d.comm != nullptr) WarnNccl(ncclCommAbort(d.comm), "ncclCommAbort");
    d.comm = nullptr;
    d.devcomm_created = false;
    d.window = nullptr;
  }
  FreeLocal();
}

// This process's allocations of every device (after its NCCL objects are gone).
void CommResources::FreeLocal() {
  for (auto& d : devices) {
    cudaSetDevice(d.device_ordinal);
    if (d.window_ptr != nullptr) WarnNccl(ncclMemFree(d.window_ptr), "ncclMemFree");
    if (d.status_host != nullptr) WarnCuda(cudaFreeHost(d.status_host), "cudaFreeHost");
    if (d.counters != nullptr) WarnCuda(cudaFree(d.counters), "cudaFree");
    if (d.gin_dev != nullptr) WarnCuda(cudaFree(d.gin_dev), "cudaFree(GIN state)");
    DestroySideLane(d.side);
    d.gin_dev = nullptr;
    d.window_ptr = nullptr;
    d.status_host = nullptr;
    d.status_dev = nullptr;
    d.counters = nullptr;
    for (auto& b : d.peer_base) b = nullptr;
  }
}

void CommResources::Close() {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (closed_.exchange(true, std::memory_order_acq_rel)) return;
  DeviceGuard guard;
  // Kernels already enqueued may still read the window or spin on a peer
  // (bounded by the timeout): let them finish before anything is freed.
  for (auto& d : devices) {
    if (cudaSetDevice(d.device_ordinal) == cudaSuccess) WarnCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (IsLostPeerStatus(PeekStatus(d))) MarkBroken();
  }
  if (broken_.load(std::memory_order_acquire)) {
    AbortAfterLostPeer();
    return;
  }
  // The NCCL calls below are collective over each group; one process driving
  // several ranks must issue them inside one group.
  ncclGroupStart();
  for (auto& d : devices) {
    if (d.devcomm_created) {
      cudaSetDevice(d.device_ordinal);
      WarnNccl(ncclDevCommDestroy(d.comm, &d.devcomm), "ncclDevCommDestroy");
      d.devcomm_created = false;
    }
  }
  WarnNccl(ncclGroupEnd(), "ncclGroupEnd(ncclDevCommDestroy)");
  ncclGroupStart();
  for (auto& d : devices) {
    if (d.window != nullptr) {
      cudaSetDevice(d.device_ordinal);
      WarnNccl(ncclCommWindowDeregister(d.comm, d.window), "ncclCommWindowDeregister");
      d.window = nullptr;
    }
  }
  WarnNccl(ncclGroupEnd(), "ncclGroupEnd(ncclCommWindowDeregister)");
  FreeLocal();
  ncclGroupStart();
  for (auto& d : devices) {
    if (d.comm != nullptr) {
      cudaSetDevice(d.device_ordinal);
      WarnNccl(ncclCommFinalize(d.comm), "ncclCommFinalize");
    }
  }
  WarnNccl(ncclGroupEnd(), "ncclGroupEnd(ncclCommFinalize)");
  for (auto& d : devices) {
    if (d.comm != nullptr) {
      cudaSetDevice(d.device_ordinal);
      WarnNccl(ncclCommDestroy(d.comm), "ncclCommDestroy");
      d.comm = nullptr;
    }
  }
}

int64_t CreateComm(const std::vector<GroupSpec>& groups, size_t num_bytes, double timeout_s,
                   bool checked, const std::string& transport_choice) {
  CheckVersion();
  const TransportChoice transport = TransportFrom(transport_choice);
  if (groups.empty()) Fail("comm_create needs at least one EP group");
  if (!(timeout_s > 0)) Fail("timeout_s must be > 0");
  if (num_bytes <= kWindowHeaderBytes) {
    Fail("num_bytes must exceed the " + std::to_string(kWindowHeaderBytes) +
         "-byte window header");
  }
  // Symmetric registration needs whole allocation granules; round up to the
  // 2 MiB that ncclMemAlloc uses on Hopper so every rank registers one size.
  constexpr size_t kGranule = size_t(2) << 20;
  const size_t window_bytes = (num_bytes + kGranule - 1) / kGranule * kGranule;

  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess) device_count = 0;

  auto res = std::make_shared<CommResources>();
  res->timeout_s = timeout_s;
  res->checked = checked;
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupSpec& spec = groups[g];
    if (spec.nranks < 1 || spec.nranks > kMaxRanks) {
      Fail("an EP group has " + std::to_string(spec.nranks) + " ranks; jax_ep supports 1.." +
           std::to_string(kMaxRanks));
    }
    if (spec.ranks.size() != spec.device_ordinals.size() || spec.ranks.empty()) {
      Fail("ranks and device_ordinals must be non-empty lists of the same length");
    }
    for (size_t i = 0; i < spec.ranks.size(); ++i) {
      DeviceResources d;
      d.group = static_cast<int>(g);
      d.rank = spec.ranks[i];
      d.nranks = spec.nranks;
      d.device_ordinal = spec.device_ordinals[i];
      d.window_bytes = window_bytes;
      d.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
      if (d.rank < 0 || d.rank >= spec.nranks) Fail("rank " + std::to_string(d.rank) + " out of range");
      if (d.device_ordinal < 0 || d.device_ordinal >= device_count) {
        Fail("device ordinal " + std::to_string(d.device_ordinal) + " not visible (" +
             std::to_string(device_count) + " CUDA devices)");
      }
      if (res->ForOrdinal(d.device_ordinal) != nullptr) {
        Fail("device ordinal " + std::to_string(d.device_ordinal) + " given twice");
      }
      res->devices.push_back(d);
    }
  }

  DeviceGuard guard;
  // Any throw below leaves `res` to its destructor, which releases whatever
  // was created so far (Close() skips what is still null).
  {
    NcclGroup group;
    for (auto& d : res->devices) {
      CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
      CheckNccl(ncclCommInitRank(&d.comm, d.nranks, groups[d.group].id, d.rank), "ncclCommInitRank");
    }
    group.End("ncclCommInitRank (group)");
  }
  for (auto& d : res->devices) SetupOneDevice(d);
  {
    NcclGroup group;
    for (auto& d : res->devices) {
      CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
      CheckNccl(ncclCommWindowRegister(d.comm, d.window_ptr, d.window_bytes, &d.window,
                                       NCCL_WIN_COLL_SYMMETRIC),
                "ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)", d.comm);
    }
    group.End("ncclCommWindowRegister (group)");
  }
  // Per peer: LSA or GIN, or a message saying why neither, before any GIN
  // resource is asked of NCCL.
  std::vector<TransportInputs> inputs;
  for (auto& d : res->devices) {
    if (d.window == nullptr) Fail("ncclCommWindowRegister returned no window");
    inputs.push_back(DescribePeers(d, transport.force_gin, transport.emulate_gin));
    const TransportPlan plan = PlanTransports(inputs.back());
    if (!plan.error.empty()) throw std::runtime_error(plan.error);
    d.gin_mask = plan.gin_mask;
    d.gin_emulated = plan.gin_emulated;
    d.lsa_team_size = 0;
    for (bool member : inputs.back().lsa_member) d.lsa_team_size += member ? 1 : 0;
  }
  // The first device that needs GIN speaks for the message when NCCL cannot
  // set it up (every rank of a group needs it or none does: LSA teams are
  // symmetric, and every rank passes the same transport).
  int gin_dev_index = -1;
  for (size_t i = 0; i < res->devices.size() && gin_dev_index < 0; ++i)
    if (res->devices[i].gin_mask != 0 && !res->devices[i].gin_emulated) gin_dev_index = static_cast<int>(i);
  auto no_gin = [&](const std::string& why) {
    const DeviceResources& d = res->devices[gin_dev_index];
    return std::runtime_error(NoTransportMessage(inputs[gin_dev_index], FirstBit(d.gin_mask), why));
  };
  try {
    NcclGroup group;
    for (auto& d : res->devices) {
      CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
      ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
      ncclDevCommRequirements reqs;
      std::memset(&reqs, 0, sizeof(reqs));
#endif
      reqs.lsaBarrierCount = kLsaBarrierCount;
      if (d.gin_mask != 0 && !d.gin_emulated) AddGinRequirements(reqs);
      CheckNccl(ncclDevCommCreate(d.comm, &reqs, &d.devcomm), "ncclDevCommCreate", d.comm);
    }
    group.End("ncclDevCommCreate (group)");
  } catch (const std::runtime_error& e) {
    // NCCL 2.28 can only say whether GIN works by trying; its refusal is
    // the answer to "why no GIN".
    if (gin_dev_index < 0) throw;
    throw no_gin("NCCL " + NcclVersionString(NCCL_VERSION_CODE) + " could not set up GIN (" +
                 Unprefixed(e) + ")");
  }
  // Only now: inside a group the creation happens at ncclGroupEnd, and the
  // struct of a failed one may name resources NCCL has already freed, so
  // destroying it could free them twice. (Should a group ever fail on one
  // device and succeed on another, the latter's few MiB stay with NCCL.)
  for (auto& d : res->devices) d.devcomm_created = true;
  for (auto& d : res->devices) {
    if (d.devcomm.nRanks != d.nranks || d.devcomm.rank != d.rank) {
      Fail("ncclDevComm reports rank " + std::to_string(d.devcomm.rank) + " of " +
           std::to_string(d.devcomm.nRanks) + ", expected " + std::to_string(d.rank) + " of " +
           std::to_string(d.nranks));
    }
    if (d.devcomm.lsaSize != d.lsa_team_size) {
      Fail("ncclDevComm LSA team has " + std::to_string(d.devcomm.lsaSize) + " ranks but NCCL's "
           "host-side LSA team has " + std::to_string(d.lsa_team_size));
    }
    if (d.gin_mask != 0 && !d.gin_emulated) {
      const std::string why = CheckGinDevComm(d);
      if (!why.empty()) throw no_gin(why);
      UploadGinComm(d);
    }
    FetchPeerPointers(d);
    CheckCuda(CreateSideLane(d.side), "creating the stream of the *_start ops", d.device_ordinal);
  }
  for (auto& d : res->devices) {
    CheckCuda(cudaSetDevice(d.device_ordinal), "cudaSetDevice", d.device_ordinal);
    // Before any op can wait on a peer (kernels/kernel_load.h).
    CheckCuda(LoadCommKernels(), "loading the jax_ep kernels", d.device_ordinal);
    // The memsets above ran on the legacy stream; XLA's streams do not wait
    // for it.
    CheckCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", d.device_ordinal);
  }

  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  res->comm_id = reg.next_id++;
  reg.comms[res->comm_id] = res;
  return res->comm_id;
}

void DestroyComm(int64_t comm_id) {
  std::shared_ptr<CommResources> res;
  {
    Registry& reg = GetRegistry();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.comms.find(comm_id);
    if (it == reg.comms.end()) return;
    res = std::move(it->second);
    reg.comms.erase(it);
  }
  // Outside the registry lock: Close() may wait for kernels and peers.
  res->Close();
}

std::shared_ptr<CommResources> LookupComm(int64_t comm_id) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.comms.find(comm_id);
  return it == reg.comms.end() ? nullptr : it->second;
}

ncclUniqueId NewUniqueId() {
  ncclUniqueId id;
  CheckNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

std::pair<int, int> NcclVersions() {
  int runtime = 0;
  if (ncclGetVersion(&runtime) != ncclSuccess) runtime = -1;
  return {NCCL_VERSION_CODE, runtime};
}

}  // namespace jax_ep
