// Communicator registry: per EP group an NCCL communicator, per local device a
// symmetric window, a device communicator (LSA barriers; GIN contexts and
// signals when a peer needs them), the LSA pointers of every rank's window, a
// host-visible status word and device counters.
//
// Transport: each peer is reached by LSA (NVLink loads/stores) when it is in
// NCCL's LSA team of this rank, otherwise by GIN (GPU-initiated RDMA through a
// network card, kernels/gin.cuh) when this build and the communicator can do
// GIN; when neither, CreateComm fails naming the peer and why. The argument
// transport="gin" (the default is "auto") puts every remote peer on GIN, to
// exercise the GIN branch on one host; every process of a group must pass
// the same, since the device communicator is created collectively with or
// without GIN. transport="gin_emulated" also puts every remote peer on GIN, but the kernels' GIN helpers carry
// the puts and signals over NVLink (gin.cuh), so the kernels' GIN branches
// run, and are tested, on machines without a NIC; every peer must then be
// in the LSA team.
//
// Lifetime: CreateComm puts a CommResources into a process-wide registry under
// a fresh comm_id. FFI states hold shared_ptrs to it, but the GPU resources are
// released by DestroyComm (Python's Communicator.close()), eagerly and
// collectively, at a point every rank reaches. A state that outlives close()
// then sees `closed()` and its handler returns an error instead of touching
// freed memory. Nothing is torn down at process exit: the collective NCCL
// teardown calls could block on a peer that has already gone.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "engram_versions.h"
#include "kernels/common.cuh"
#include "side_lane.h"
#include "status.h"
#include "transport_plan.h"

namespace jax_ep {

// Device-local counters, zeroed at create. Slot 0 backs EpPeers.epoch, slot
// 1 the dispatch prep blocks (kDispatchPrepCounter), 2..15 the low-latency
// kernels (low_latency.cuh), 16..25 the expert-layout combine's scanners
// (common.cuh), 26 the low-latency mismatch flag (low_latency.cuh), slots
// from kGinSnapshotCounter on EpPeers.gin_snapshot (kMaxRanks * 32 of them,
// gin.cuh's kGinSignalCount), then the Engram version words (engram.cuh);
// 60 the Engram GIN fetch sequence (engram.cuh kEngramGinSeqCounter);
// 27..59 and 61..63 are free for kernels that need scratch counters.
constexpr int kGinSnapshotCounter = 64;
static_assert(kCombineScanDoneCounter < kGinSnapshotCounter, "scanner counters overlap the GIN snapshot");
constexpr int kEngramVersionCounter = kGinSnapshotCounter + kMaxRanks * 32;
constexpr int kNumDeviceCounters = kEngramVersionCounter + 1 + kEngramSlots;

struct DeviceResources {
  int device_ordinal = -1;
  int rank = -1;       // rank inside the EP group
  int nranks = 0;
  int group = 0;       // index of the EP group this device belongs to
  ncclComm_t comm = nullptr;
  void* window_ptr = nullptr;  // ncclMemAlloc'ed, registered as `window`
  size_t window_bytes = 0;
  ncclWindow_t window = nullptr;
  ncclDevComm devcomm{};
  bool devcomm_created = false;
  char* peer_base[kMaxRanks] = {};  // LSA-mapped window of every LSA-reached rank
  uint32_t gin_mask = 0;            // bit j: rank j is reached by GIN
  bool gin_emulated = false;        // transport "gin_emulated" (gin.cuh)
  char* gin_emu_base[kMaxRanks] = {};  // emulated: every GIN peer's LSA-mapped window
  int lsa_team_size = 0;            // NCCL's LSA team of this rank, self included
  void* gin_dev = nullptr;          // cudaMalloc'ed GinComm when gin_mask != 0
  uint32_t* status_host = nullptr;  // cudaHostAlloc(mapped): u64 (call << 32 | code), EpPeers::status
  uint32_t* status_dev = nullptr;   // the same words as the device sees them
  // A non-fatal error AcquireDevice took from the status word (so that the
  // op's kernels start clean) and that EndCall, or check(), still reports.
  std::string held_report;
  // Ops executed on this device since create, this one included
  // (AcquireDevice counts; EpPeers::call carries it into the kernels; under
  // XLA command buffers a replay reuses the captured number). Plain, not
  // atomic: one device's handlers run one at a time.
  unsigned long long calls = 0;
  unsigned long long* counters = nullptr;  // cudaMalloc, kNumDeviceCounters
  unsigned long long timeout_ns = 0;
  SideLane side;                    // stream of dispatch_start / combine_start (side_lane.h)
  // Engram publications live in this device's window (engram_versions.h).
  std::shared_ptr<EngramVersions> engram_versions = std::make_shared<EngramVersions>();
  unsigned long long* engram_words() const { return counters + kEngramVersionCounter; }

  EpPeers peers() const;
};

class CommResources {
 public:
  CommResources() = default;
  ~CommResources();
  CommResources(const CommResources&) = delete;
  CommResources& operator=(const CommResources&) = delete;

  // nullptr when this process drives no device of that ordinal here.
  DeviceResources* ForOrdinal(int device_ordinal);

  // Every local device's report (TakeReport), cleared; "" when none.
  std::string TakeStatusMessage();
  // Same for one device; used by handlers after they enqueue work.
  std::string TakeStatusMessage(DeviceResources& dev);
  // The device's status code without clearing it (0: no error).
  uint32_t PeekStatus(const DeviceResources& dev) const;
  // Moves the status word's message (if any) to the device's held report.
  void HoldStatus(DeviceResources& dev);
  // The held report and then the status word's message, both cleared.
  std::string TakeReport(DeviceResources& dev);

  // Releases all GPU/NCCL resources (collective over the group's ranks).
  // Idempotent. Waits for work already enqueued on the devices. After a
  // peer that never arrived (IsLostPeerStatus on any local device, seen now
  // or earlier) the collective teardown could wait forever for a rank that
  // is gone: the NCCL communicators are aborted instead (ncclCommAbort,
  // local) and only this process's memory is freed.
  void Close();
  // A lost peer was seen on some device (IsLostPeerStatus): Close aborts.
  void MarkBroken() { broken_.store(true, std::memory_order_release); }
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  // Handlers hold this shared while they enqueue; Close() takes it exclusive,
  // so a close racing with an execute waits rather than freeing under it.
  std::shared_mutex& mutex() { return mu_; }

  int64_t comm_id = 0;
  double timeout_s = 0;
  // Checked mode (docs/errors.md): every op waits for its kernels and
  // returns their error itself, so the program that caused it fails.
  bool checked = false;
  std::vector<DeviceResources> devices;

 private:
  void AbortAfterLostPeer();
  void FreeLocal();

  std::atomic<bool> closed_{false};
  std::atomic<bool> broken_{false};
  std::shared_mutex mu_;
};

// One EP group as this process sees it: the group's unique id, its size and
// the (rank, device ordinal) pairs this process drives in it.
struct GroupSpec {
  ncclUniqueId id;
  int nranks = 0;
  std::vector<int> ranks;
  std::vector<int> device_ordinals;
};

// Throws std::runtime_error with a message naming the failing call/peer.
// `transport`: "auto" (also ""), "gin" or "gin_emulated" (docs/design.md §3).
int64_t CreateComm(const std::vector<GroupSpec>& groups, size_t num_bytes,
                   double timeout_s, bool checked = false, const std::string& transport = "");
// Closes and unregisters; unknown ids are ignored (close() is idempotent).
void DestroyComm(int64_t comm_id);
// nullptr when unknown or already destroyed.
std::shared_ptr<CommResources> LookupComm(int64_t comm_id);

ncclUniqueId NewUniqueId();
// (compiled NCCL_VERSION_CODE, ncclGetVersion() of the loaded library)
std::pair<int, int> NcclVersions();

}  // namespace jax_ep
