// Communicator registry: per EP group an NCCL communicator, per local device a
// symmetric window, a device communicator (LSA barriers), the LSA pointers of
// every rank's window, a host-visible status word and device counters.
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

#include "kernels/common.cuh"

namespace jax_ep {

// Number of LSA barriers (one per CTA that synchronises with its peers CTAs
// through the device communicator). Kernels launching more CTAs than this must
// not use ncclLsaBarrierSession with blockIdx.x as the index.
constexpr int kLsaBarrierCount = 64;

// Device-local counters, zeroed at create. Slots 0 and 1 back EpPeers.epoch and
// EpPeers.grid_sync; the rest are free for kernels that need scratch counters.
constexpr int kNumDeviceCounters = 64;

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
  char* peer_base[kMaxRanks] = {};  // LSA-mapped window of every rank
  uint32_t* status_host = nullptr;  // cudaHostAlloc(mapped)
  uint32_t* status_dev = nullptr;   // the same word as the device sees it
  unsigned long long* counters = nullptr;  // cudaMalloc, kNumDeviceCounters
  unsigned long long timeout_ns = 0;

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

  // Reads (and clears) every local device's status word; "" when all are 0.
  std::string TakeStatusMessage();
  // Same for one device; used by handlers before they enqueue work.
  std::string TakeStatusMessage(DeviceResources& dev);

  // Releases all GPU/NCCL resources (collective over the group's ranks).
  // Idempotent. Waits for work already enqueued on the devices.
  void Close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  // Handlers hold this shared while they enqueue; Close() takes it exclusive,
  // so a close racing with an execute waits rather than freeing under it.
  std::shared_mutex& mutex() { return mu_; }

  int64_t comm_id = 0;
  double timeout_s = 0;
  std::vector<DeviceResources> devices;

 private:
  std::atomic<bool> closed_{false};
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
int64_t CreateComm(const std::vector<GroupSpec>& groups, size_t num_bytes,
                   double timeout_s);
// Closes and unregisters; unknown ids are ignored (close() is idempotent).
void DestroyComm(int64_t comm_id);
// nullptr when unknown or already destroyed.
std::shared_ptr<CommResources> LookupComm(int64_t comm_id);

// "jax_ep <op> on rank r (device d): <cause>" for a non-zero status code.
std::string DescribeStatus(uint32_t code, int rank, int device_ordinal,
                           double timeout_s);

ncclUniqueId NewUniqueId();
// (compiled NCCL_VERSION_CODE, ncclGetVersion() of the loaded library)
std::pair<int, int> NcclVersions();

}  // namespace jax_ep
