// Virtual ranks on one GPU, for tests (docs/design.md §8): R windows in one
// device's memory, each rank's EpPeers pointing at all of them, and each
// rank's kernels on a stream of its own, so that the ranks run side by side
// and wait on each other as peers across NVLink do. That runs the multi-rank
// paths of the normal and low-latency kernels (counts exchange, barriers,
// stores into a peer's window, chunk signals, emulated GIN) when only one
// GPU is lent. The kernels are the ones the FFI handlers launch, through the
// same Validate*/Launch* calls; what is not exercised is NCCL (windows are
// plain cudaMalloc) and XLA. Host arrays in, host arrays out.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/comm.h"
#include "kernels/abort.h"
#include "kernels/engram.cuh"
#include "kernels/engram_layout.h"
#include "kernels/ep_kernels.h"
#include "kernels/kernel_load.h"
#include "kernels/low_latency.cuh"

namespace nb = nanobind;

namespace jax_ep {
namespace {

void Check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("jax_ep loopback: " + what + ": " + cudaGetErrorString(e));
  }
}

struct Loopback {
  int device = 0;
  int nranks = 0;
  int sms = 0;
  size_t window_bytes = 0;
  double timeout_s = 0;
  bool gin_emulated = false;
  unsigned long long calls = 0;
  std::vector<char*> windows;
  std::vector<unsigned long long*> counters;
  std::vector<uint32_t*> status_host;
  std::vector<uint32_t*> status_dev;
  std::vector<cudaStream_t> streams;

  void Init() {
    Check(cudaSetDevice(device), "cudaSetDevice");
    Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    for (int r = 0; r < nranks; ++r) {
      char* w = nullptr;
      Check(cudaMalloc(&w, window_bytes), "cudaMalloc(window of " + std::to_string(window_bytes) + " bytes)");
      windows.push_back(w);
      Check(cudaMemset(w, 0, window_bytes), "cudaMemset(window)");
      unsigned long long* c = nullptr;
      Check(cudaMalloc(&c, kNumDeviceCounters * sizeof(unsigned long long)), "cudaMalloc(counters)");
      counters.push_back(c);
      Check(cudaMemset(c, 0, kNumDeviceCounters * sizeof(unsigned long long)), "cudaMemset(counters)");
      uint32_t* h = nullptr;
      Check(cudaHostAlloc(reinterpret_cast<void**>(&h), kStatusBytes, cudaHostAllocMapped), "cudaHostAlloc(status)");
      status_host.push_back(h);
      std::memset(h, 0, kStatusBytes);
      uint32_t* d = nullptr;
      Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d), h, 0), "cudaHostGetDevicePointer(status)");
      status_dev.push_back(d);
      cudaStream_t s = nullptr;
      Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      streams.push_back(s);
    }
    Check(LoadCommKernels(), "loading the kernels (kernels/kernel_load.h)");
    Check(cudaDeviceSynchronize(), "zeroing the windows");
  }

  ~Loopback() {
    cudaSetDevice(device);
    for (cudaStream_t s : streams) cudaStreamSynchronize(s), cudaStreamDestroy(s);
    for (char* w : windows) cudaFree(w);
    for (auto* c : counters) cudaFree(c);
    for (auto* h : status_host) cudaFreeHost(h);
  }

  // What rank r's kernels see: every window by address, or with emulated
  // GIN its own by address and the others only through gin.cuh (as
  // comm.cc's FetchPeerPointers leaves them).
  EpPeers Peers(int r) const {
    EpPeers p{};
    const bool emu = gin_emulated && nranks > 1;
    for (int j = 0; j < nranks; ++j) {
      if (emu && j != r) {
        p.gin_emu[j] = windows[j];
        p.gin_mask |= 1u << j;
      } else {
        p.base[j] = windows[j];
      }
    }
    p.rank = r;
    p.nranks = nranks;
    p.window_bytes = window_bytes;
    p.status = status_dev[r];
    p.call = calls;
    p.epoch = counters[r];
    p.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
    p.gin_emulated = emu;
    p.gin_snapshot = emu ? counters[r] + kGinSnapshotCounter : nullptr;
    return p;
  }
};

std::mutex g_mu;
std::map<int64_t, std::unique_ptr<Loopback>> g_loopbacks;
int64_t g_next_id = 1;

// One call's device arrays, freed when the call returns.
class Buffers {
 public:
  Buffers() = default;
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (void* p : ptrs_) cudaFree(p);
  }
  // At least 16 bytes, so that a named array is never a null pointer (null
  // means "absent" to some launchers, e.g. combine's weights).
  void* Alloc(size_t n) {
    void* p = nullptr;
    Check(cudaMalloc(&p, std::max<size_t>(n, 16)), "cudaMalloc(" + std::to_string(n) + " bytes)");
    ptrs_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> ptrs_;
};

// One rank's named inputs, outputs and scalars; every name the Python side
// passed must be used by the op, so that a misspelt one is an error rather
// than a silently absent array.
class Named {
 public:
  Named(nb::dict scalars, nb::dict inputs, nb::dict outputs, Buffers& bufs)
      : scalars_(scalars), inputs_(inputs), outputs_(outputs), bufs_(bufs) {}

  int64_t Int(const char* name, int64_t dflt = 0) {
    used_.insert(name);
    return scalars_.contains(name) ? nb::cast<int64_t>(scalars_[name]) : dflt;
  }
  // nullptr when absent.
  const void* In(const char* name) {
    used_.insert(name);
    if (!inputs_.contains(name)) return nullptr;
    nb::bytes b = nb::cast<nb::bytes>(inputs_[name]);
    void* p = bufs_.Alloc(b.size());
    Check(cudaMemcpy(p, b.c_str(), b.size(), cudaMemcpyHostToDevice), std::string("upload of ") + name);
    return p;
  }
  template <class T>
  const T* InAs(const char* name) { return static_cast<const T*>(In(name)); }
  // A fresh array of the byte size the caller named, filled with 0xA5 so
  // that an element the kernels fail to write shows as a mismatch.
  void* Out(const char* name) {
    used_.insert(name);
    if (!outputs_.contains(name)) return nullptr;
    const size_t n = nb::cast<size_t>(outputs_[name]);
    void* p = bufs_.Alloc(n);
    Check(cudaMemset(p, 0xA5, n), std::string("fill of ") + name);
    outs_.emplace_back(name, p, n);
    return p;
  }
  template <class T>
  T* OutAs(const char* name) { return static_cast<T*>(Out(name)); }

  void CheckAllUsed() const {
    for (const nb::dict& d : {scalars_, inputs_, outputs_})
      for (auto item : d) {
        const std::string k = nb::cast<std::string>(item.first);
        if (!used_.count(k)) throw std::invalid_argument("jax_ep loopback: unknown name '" + k + "' for this op");
      }
  }

  nb::dict Download() const {
    nb::dict d;
    for (const auto& [name, p, n] : outs_) {
      std::string host(n, '\0');
      Check(cudaMemcpy(host.data(), p, n, cudaMemcpyDeviceToHost), "download of " + name);
      d[name.c_str()] = nb::bytes(host.data(), n);
    }
    return d;
  }

 private:
  nb::dict scalars_, inputs_, outputs_;
  Buffers& bufs_;
  std::set<std::string> used_;
  std::vector<std::tuple<std::string, void*, size_t>> outs_;
};

void FillDispatch(Named& n, DispatchArgs& a) {
  a.x = n.In("x");
  a.x_scales = n.InAs<float>("x_scales");
  a.topk_idx = n.InAs<int32_t>("topk_idx");
  a.topk_weights = n.InAs<float>("topk_weights");
  a.x_dtype = static_cast<EpDtype>(n.Int("x_dtype"));
  a.cast_fp8 = n.Int("cast_fp8") != 0;
  a.ue8m0 = n.Int("ue8m0") != 0;
  a.num_tokens = static_cast<int>(n.Int("num_tokens"));
  a.hidden = static_cast<int>(n.Int("hidden"));
  a.topk = static_cast<int>(n.Int("topk"));
  a.num_experts = static_cast<int>(n.Int("num_experts"));
  a.capacity = static_cast<int>(n.Int("capacity"));
  a.expert_alignment = static_cast<int>(n.Int("expert_alignment", 1));
  a.layout = n.Int("layout") == 1 ? EpLayout::kExpert : EpLayout::kRank;
  a.num_sms = static_cast<int>(n.Int("num_sms"));
  a.recv_sms = static_cast<int>(n.Int("recv_sms"));
  a.recv_x = n.Out("recv_x");
  a.recv_scales = n.OutAs<float>("recv_scales");
  a.recv_topk_idx = n.OutAs<int32_t>("recv_topk_idx");
  a.recv_topk_weights = n.OutAs<float>("recv_topk_weights");
  a.counts = n.OutAs<int32_t>("counts");
  a.pos_in_rank = n.OutAs<int32_t>("pos_in_rank");
  a.recv_src_rank = n.OutAs<int32_t>("recv_src_rank");
  a.recv_src_token = n.OutAs<int32_t>("recv_src_token");
  a.recv_src_k = n.OutAs<int32_t>("recv_src_k");
  a.recv_counts = n.OutAs<int32_t>("recv_counts");
}

void FillCombine(Named& n, CombineArgs& a) {
  a.y = n.In("y");
  a.weights = n.InAs<float>("weights");
  a.topk_idx = n.InAs<int32_t>("topk_idx");
  a.pos_in_rank = n.InAs<int32_t>("pos_in_rank");
  a.recv_src_rank = n.InAs<int32_t>("recv_src_rank");
  a.recv_src_token = n.InAs<int32_t>("recv_src_token");
  a.recv_src_k = n.InAs<int32_t>("recv_src_k");
  a.recv_counts = n.InAs<int32_t>("recv_counts");
  a.y_dtype = static_cast<EpDtype>(n.Int("y_dtype"));
  a.num_tokens = static_cast<int>(n.Int("num_tokens"));
  a.hidden = static_cast<int>(n.Int("hidden"));
  a.topk = static_cast<int>(n.Int("topk"));
  a.num_experts = static_cast<int>(n.Int("num_experts"));
  a.capacity = static_cast<int>(n.Int("capacity"));
  a.layout = n.Int("layout") == 1 ? EpLayout::kExpert : EpLayout::kRank;
  a.num_sms = static_cast<int>(n.Int("num_sms"));
  a.recv_sms = static_cast<int>(n.Int("recv_sms"));
  a.out = n.Out("out");
}

void FillLlDispatch(Named& n, LlDispatchArgs& a, unsigned long long* counters) {
  a.x = n.In("x");
  a.topk_idx = n.InAs<int32_t>("topk_idx");
  a.num_tokens = static_cast<int>(n.Int("num_tokens"));
  a.max_tokens = static_cast<int>(n.Int("max_tokens"));
  a.hidden = static_cast<int>(n.Int("hidden"));
  a.topk = static_cast<int>(n.Int("topk"));
  a.num_experts = static_cast<int>(n.Int("num_experts"));
  a.fp8 = n.Int("fp8") != 0;
  a.ue8m0 = n.Int("ue8m0") != 0;
  a.reserved_bytes = static_cast<size_t>(n.Int("reserved_bytes"));
  a.num_blocks = static_cast<int>(n.Int("num_blocks"));
  a.recv_x = n.Out("recv_x");
  a.recv_scales = n.OutAs<float>("recv_scales");
  a.recv_count = n.OutAs<int32_t>("recv_count");
  a.src_entry = n.OutAs<int32_t>("src_entry");
  a.counters = counters;
}

void FillLlCombine(Named& n, LlCombineArgs& a, unsigned long long* counters) {
  a.y = n.In("y");
  a.src_entry = n.InAs<int32_t>("src_entry");
  a.recv_count = n.InAs<int32_t>("recv_count");
  a.topk_idx = n.InAs<int32_t>("topk_idx");
  a.topk_weights = n.InAs<float>("topk_weights");
  a.num_tokens = static_cast<int>(n.Int("num_tokens"));
  a.max_tokens = static_cast<int>(n.Int("max_tokens"));
  a.hidden = static_cast<int>(n.Int("hidden"));
  a.topk = static_cast<int>(n.Int("topk"));
  a.num_experts = static_cast<int>(n.Int("num_experts"));
  a.reserved_bytes = static_cast<size_t>(n.Int("reserved_bytes"));
  a.num_blocks = static_cast<int>(n.Int("num_blocks"));
  a.out = n.Out("out");
  a.counters = counters;
}

// Engram: publish this rank's shard (slot 0 of the version words, as the
// first placement of a Communicator gets), then fetch from every shard with
// the publish's token. Returns "" or why the arguments cannot run.
// With emulated GIN the fetch goes through the request / answer exchange,
// whose scratch sits below the table (engram_layout.h EngramGinArea).
std::string FillEngram(Named& n, EngramPublishArgs& pub, EngramFetchArgs& fetch, EngramGinFetchArgs& gin,
                       const Loopback& lb, int r) {
  const int64_t rows_per_rank = n.Int("rows_per_rank");
  const size_t row_bytes = static_cast<size_t>(n.Int("row_bytes"));
  if (rows_per_rank < 1 || row_bytes == 0 || row_bytes % 16) return "rows_per_rank >= 1 and row_bytes a multiple of 16";
  const int64_t num_rows = n.Int("num_rows");
  const bool emu = lb.gin_emulated && lb.nranks > 1;
  const size_t gin_bytes = emu ? EngramGinArea::Bytes(lb.nranks, num_rows, row_bytes) : 0;
  const EngramWindow w(lb.window_bytes, rows_per_rank, row_bytes, 0, 0, gin_bytes);
  if (!w.fits) return "the window is too small for the table: needs " + std::to_string(w.need) + " bytes";
  if (emu) {
    gin.counters = lb.counters[r];
    gin.area = EngramGinArea(w.gin_off, lb.nranks, num_rows, row_bytes);
  }
  unsigned long long* versions = lb.counters[r] + kEngramVersionCounter;
  pub.table = n.In("table");
  pub.table_bytes = w.table_bytes;
  pub.table_off = w.table_off;
  pub.rows_per_rank = rows_per_rank;
  pub.row_bytes = row_bytes;
  pub.token = n.OutAs<int32_t>("token");
  pub.versions = versions;
  pub.slot = 0;
  pub.clear.Set(0);
  fetch.indices = n.InAs<int32_t>("indices");
  fetch.num_rows = num_rows;
  fetch.rows_per_rank = rows_per_rank;
  fetch.row_bytes = row_bytes;
  fetch.table_off = w.table_off;
  fetch.out = n.Out("rows");
  fetch.num_sms = static_cast<int>(n.Int("num_sms"));
  fetch.token = pub.token;
  fetch.version = versions + 1 + pub.slot;
  return pub.table && pub.token && fetch.out && (fetch.indices || fetch.num_rows == 0)
             ? "" : "table, indices, rows and token are required";
}

// Validates every rank's call before any is launched (a rank that refused
// alone would leave its peers waiting out the timeout), then launches each
// rank on its own stream and waits for all.
// `scalars`: per rank (a rank may be given another configuration than its
// peers, as a misconfigured process would); `skip`: ranks that do not call
// the op at all (their peers must report them, not hang); `refuse`: ranks
// whose handler refuses the call, launching what a refusing handler
// launches instead (kernels/abort.h; their peers must fail at once).
std::pair<std::vector<nb::dict>, std::vector<std::string>> Run(Loopback& lb, const std::string& op,
                                                               const std::vector<nb::dict>& scalars,
                                                               const std::vector<nb::dict>& inputs,
                                                               const nb::dict& outputs,
                                                               const std::vector<int>& skip,
                                                               const std::vector<int>& refuse) {
  const int R = lb.nranks;
  if (static_cast<int>(inputs.size()) != R || static_cast<int>(scalars.size()) != R)
    throw std::invalid_argument("jax_ep loopback: " + std::to_string(inputs.size()) + " ranks' inputs and " +
                                std::to_string(scalars.size()) + " ranks' scalars for " + std::to_string(R) + " ranks");
  std::vector<bool> runs(R, true), refuses(R, false);
  for (int r : skip) {
    if (r < 0 || r >= R) throw std::invalid_argument("jax_ep loopback: no rank " + std::to_string(r) + " to skip");
    runs[r] = false;
  }
  for (int r : refuse) {
    if (r < 0 || r >= R) throw std::invalid_argument("jax_ep loopback: no rank " + std::to_string(r) + " to refuse");
    runs[r] = false;
    refuses[r] = true;
  }
  Check(cudaSetDevice(lb.device), "cudaSetDevice");
  ++lb.calls;
  Buffers bufs;
  std::vector<std::unique_ptr<Named>> named;
  std::vector<DispatchArgs> da(R);
  std::vector<CombineArgs> ca(R);
  std::vector<LlDispatchArgs> lda(R);
  std::vector<LlCombineArgs> lca(R);
  std::vector<EngramPublishArgs> epa(R);
  std::vector<EngramFetchArgs> efa(R);
  std::vector<EngramGinFetchArgs> ega(R);
  // Every rank's CTAs must be resident at once (they wait on each other).
  const int sms_per_rank = std::max(1, lb.sms / R);
  for (int r = 0; r < R; ++r) {
    named.push_back(std::make_unique<Named>(scalars[r], inputs[r], outputs, bufs));
    if (!runs[r]) continue;
    Named& n = *named.back();
    const EpPeers p = lb.Peers(r);
    std::string msg;
    if (op == "dispatch") {
      FillDispatch(n, da[r]);
      msg = ValidateDispatch(da[r], p);
    } else if (op == "combine") {
      FillCombine(n, ca[r]);
      msg = ValidateCombine(ca[r], p);
    } else if (op == "ll_dispatch") {
      FillLlDispatch(n, lda[r], lb.counters[r]);
      msg = ValidateLlDispatch(lda[r], p);
    } else if (op == "ll_combine") {
      FillLlCombine(n, lca[r], lb.counters[r]);
      msg = ValidateLlCombine(lca[r], p);
    } else if (op == "engram") {
      msg = FillEngram(n, epa[r], efa[r], ega[r], lb, r);
    } else {
      throw std::invalid_argument("jax_ep loopback: unknown op '" + op +
                                  "' (dispatch, combine, ll_dispatch, ll_combine, engram)");
    }
    n.CheckAllUsed();
    if (!msg.empty()) throw std::invalid_argument("jax_ep loopback " + op + " on rank " + std::to_string(r) + ": " + msg);
  }
  // The uploads (a pageable cudaMemcpy may return before its copy lands) and
  // the 0xA5 output fills (cudaMemset returns at once) went to the legacy
  // default stream, which the ranks' non-blocking streams do not wait for:
  // a fill landing after the prep kernel wrote pos_in_rank made that rank
  // send its peers nothing (seen with three test processes on one GPU).
  Check(cudaDeviceSynchronize(), "uploads and output fills before the launches");
  // Rank by rank, each op whole (an Engram publish and then its fetch, as
  // the fused handler does): every kernel was loaded in Init, so rank 0's
  // waiting kernels never hold up the launch of rank 1's.
  for (int r = 0; r < R; ++r) {
    const EpPeers p = lb.Peers(r);
    cudaError_t err = cudaSuccess;
    if (refuses[r]) {
      if (op == "dispatch") err = LaunchRefusedBarriers(p, kDispatchBarriers, lb.streams[r]);
      else if (op == "combine") err = LaunchRefusedBarriers(p, kCombineBarriers, lb.streams[r]);
      else if (op == "engram") {
        err = LaunchRefusedBarriers(p, kEngramPublishBarriers, lb.streams[r]);
        // The fetch's exchange with GIN peers (nothing is launched without).
        if (err == cudaSuccess) err = LaunchEngramGinRefusal(p, lb.counters[r], lb.streams[r]);
      } else err = LaunchLlRefusal(p, op == "ll_combine", lb.counters[r], lb.streams[r]);
      Check(err, op + " refusal on rank " + std::to_string(r));
      continue;
    }
    if (!runs[r]) continue;
    if (op == "dispatch") err = LaunchDispatch(da[r], p, lb.streams[r]);
    else if (op == "combine") err = LaunchCombine(ca[r], p, lb.streams[r]);
    else if (op == "ll_dispatch") err = LaunchLlDispatch(lda[r], p, sms_per_rank, lb.streams[r]);
    else if (op == "ll_combine") err = LaunchLlCombine(lca[r], p, sms_per_rank, lb.streams[r]);
    else if ((err = LaunchEngramPublish(epa[r], p, lb.streams[r])) == cudaSuccess)
      err = LaunchEngramFetch(efa[r], p, lb.streams[r], ega[r]);
    Check(err, op + " launch on rank " + std::to_string(r));
  }
  std::vector<std::string> reports(R);
  for (int r = 0; r < R; ++r) Check(cudaStreamSynchronize(lb.streams[r]), op + " on rank " + std::to_string(r));
  std::vector<nb::dict> outs;
  for (int r = 0; r < R; ++r) {
    reports[r] = TakeStatusWord(lb.status_host[r], r, lb.device, lb.timeout_s);
    outs.push_back(named[r]->Download());
  }
  return {std::move(outs), std::move(reports)};
}

Loopback& Find(int64_t id) {
  auto it = g_loopbacks.find(id);
  if (it == g_loopbacks.end()) throw std::invalid_argument("jax_ep loopback " + std::to_string(id) + " is not open");
  return *it->second;
}

}  // namespace
}  // namespace jax_ep

void RegisterLoopbackBindings(nb::module_& m) {
  m.def(
      "loopback_create",
      [](int device_ordinal, int nranks, size_t window_bytes, double timeout_s, bool gin_emulated) {
        if (nranks < 1 || nranks > jax_ep::kMaxRanks)
          throw std::invalid_argument("jax_ep loopback: nranks must be in [1, 8]");
        if (window_bytes < jax_ep::kWindowHeaderBytes)
          throw std::invalid_argument("jax_ep loopback: window_bytes below the header");
        auto lb = std::make_unique<jax_ep::Loopback>();
        lb->device = device_ordinal;
        lb->nranks = nranks;
        lb->window_bytes = window_bytes;
        lb->timeout_s = timeout_s;
        lb->gin_emulated = gin_emulated;
        lb->Init();  // on a throw, lb's destructor frees what Init made
        std::lock_guard<std::mutex> g(jax_ep::g_mu);
        const int64_t id = jax_ep::g_next_id++;
        jax_ep::g_loopbacks[id] = std::move(lb);
        return id;
      },
      nb::arg("device_ordinal"), nb::arg("nranks"), nb::arg("window_bytes"), nb::arg("timeout_s") = 10.0,
      nb::arg("gin_emulated") = false,
      "Test harness: `nranks` virtual EP ranks on one GPU (ffi/testing/loopback.cc); returns an id.");
  m.def(
      "loopback_run",
      [](int64_t id, const std::string& op, std::vector<nb::dict> scalars, std::vector<nb::dict> inputs,
         nb::dict outputs, std::vector<int> skip, std::vector<int> refuse) {
        std::lock_guard<std::mutex> g(jax_ep::g_mu);
        return jax_ep::Run(jax_ep::Find(id), op, scalars, inputs, outputs, skip, refuse);
      },
      nb::arg("id"), nb::arg("op"), nb::arg("scalars"), nb::arg("inputs"), nb::arg("outputs"),
      nb::arg("skip") = std::vector<int>{}, nb::arg("refuse") = std::vector<int>{},
      "Runs one op on every virtual rank but those in `skip` and `refuse` (whose handler refuses "
      "it, kernels/abort.h): scalars [per rank {name: int}], inputs "
      "[per rank {name: bytes}], outputs {name: bytes per rank}; returns ([per rank {name: bytes}], "
      "[per rank status message or '']).");
  m.def(
      "loopback_peek",
      [](int64_t id, int rank, const std::string& what, size_t offset, size_t nbytes) {
        std::lock_guard<std::mutex> g(jax_ep::g_mu);
        jax_ep::Loopback& lb = jax_ep::Find(id);
        if (rank < 0 || rank >= lb.nranks) throw std::invalid_argument("jax_ep loopback: no rank " + std::to_string(rank));
        const bool win = what == "window";
        if (!win && what != "counters") throw std::invalid_argument("jax_ep loopback: peek 'window' or 'counters'");
        const size_t size = win ? lb.window_bytes : jax_ep::kNumDeviceCounters * sizeof(unsigned long long);
        if (offset > size || nbytes > size - offset) throw std::invalid_argument("jax_ep loopback: peek past the end");
        const char* base = win ? lb.windows[rank] : reinterpret_cast<const char*>(lb.counters[rank]);
        std::string host(nbytes, '\0');
        jax_ep::Check(cudaSetDevice(lb.device), "cudaSetDevice");
        jax_ep::Check(cudaMemcpy(host.data(), base + offset, nbytes, cudaMemcpyDeviceToHost), "peek");
        return nb::bytes(host.data(), nbytes);
      },
      nb::arg("id"), nb::arg("rank"), nb::arg("what"), nb::arg("offset"), nb::arg("nbytes"),
      "Bytes of a virtual rank's window or device counters (after a failure: barrier flags, chunk counters).");
  m.def(
      "loopback_destroy",
      [](int64_t id) {
        std::lock_guard<std::mutex> g(jax_ep::g_mu);
        jax_ep::g_loopbacks.erase(id);
      },
      nb::arg("id"), "Frees a loopback group (unknown ids are ignored).");
}
