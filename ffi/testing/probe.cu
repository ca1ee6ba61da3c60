// Each CTA owns the same byte range of every rank's slot on every rank, so
// its LSA barrier (index = blockIdx.x) with the same CTA on the peers orders
// exactly the stores it later reads: no grid-wide barrier is needed.
// Two barriers per call: the first keeps us from overwriting a peer's slot
// that it is still reading from the previous call (in one process the GPUs'
// streams run independently, so a peer can be a whole call behind).
#include "probe.cuh"

#include <algorithm>

#include "kernels/peer.cuh"

namespace jax_ep {
namespace {

constexpr int kProbeThreads = 512;
constexpr size_t kVec = 16;

__host__ __device__ __forceinline__ size_t SlotBytes(size_t row_bytes) { return (row_bytes + kVec - 1) / kVec * kVec; }

// The NCCL 2.28 wait() spins without bound; docs/design.md §4 forbids endless
// spins, so the wait half is ours: it polls the same inbox words with the
// same epoch convention as the library's unicast path and gives up after the
// communicator's timeout. Newer NCCL releases may change that internal state,
// so they use the library's wait (unbounded) until this is revisited.
template <typename Coop>
__device__ bool BoundedLsaSync(ncclLsaBarrierSession<Coop>& bar, Coop coop, const EpPeers& p) {
  bar.arrive(coop, cuda::memory_order_release);
  bool timed_out = false;
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 30, 0)
  const int n = bar.team.nRanks;
  const int me = bar.team.rank;
  const uint32_t target = bar.epoch + 1;
  for (int i = coop.thread_rank(); i < n - 1; i += coop.size()) {
    const int peer = i + (me <= i ? 1 : 0);
    cuda::atomic_ref<uint32_t> inbox(*bar.ucInbox(me, peer));
    const unsigned long long t0 = globaltimer_ns();
    for (uint32_t spin = 0;; ++spin) {
      if (static_cast<int32_t>(inbox.load(cuda::memory_order_acquire) - target) >= 0) break;
      // Polling host-mapped memory costs a PCIe round trip: do it rarely.
      if ((spin & 63u) == 63u) {
        if (has_error(p)) {
          timed_out = true;
          break;
        }
        if (globaltimer_ns() - t0 > p.timeout_ns) {
          report_error(p, Op::kProbe, Cause::kPeerTimeout, static_cast<uint32_t>(peer));
          timed_out = true;
          break;
        }
      }
    }
  }
  bar.epoch += 1;
#else
  bar.wait(coop, cuda::memory_order_acquire);
#endif
  return __syncthreads_or(timed_out) == 0;
}

__device__ __forceinline__ void CopyRange(char* dst, const char* src, size_t lo, size_t hi,
                                          bool vec) {
  if (vec) {
    for (size_t i = lo + threadIdx.x * kVec; i < hi; i += blockDim.x * kVec) {
      *reinterpret_cast<int4*>(dst + i) = *reinterpret_cast<const int4*>(src + i);
    }
  } else {
    for (size_t i = lo + threadIdx.x; i < hi; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void __launch_bounds__(kProbeThreads)
    ProbeAllToAllKernel(ProbeArgs a, ncclDevComm devcomm, EpPeers p) {
  const size_t slot = SlotBytes(a.row_bytes);
  const size_t per_block = (slot / kVec + gridDim.x - 1) / gridDim.x * kVec;
  const size_t lo = min(a.row_bytes, blockIdx.x * per_block);
  const size_t hi = min(a.row_bytes, lo + per_block);
  const bool vec = (a.row_bytes % kVec) == 0 &&
                   (reinterpret_cast<uintptr_t>(a.x) % kVec) == 0 &&
                   (reinterpret_cast<uintptr_t>(a.out) % kVec) == 0;

  ncclCoopCta cta;
  ncclLsaBarrierSession<ncclCoopCta> bar(cta, devcomm, ncclTeamTagLsa(), blockIdx.x);
  if (!BoundedLsaSync(bar, cta, p)) return;
  for (int j = 0; j < p.nranks; ++j) {
    char* dst = PeerWindow(p, j) + kWindowHeaderBytes + static_cast<size_t>(p.rank) * slot;
    CopyRange(dst, a.x + static_cast<size_t>(j) * a.row_bytes, lo, hi, vec);
  }
  if (!BoundedLsaSync(bar, cta, p)) return;
  const char* mine = MyWindow(p) + kWindowHeaderBytes;
  for (int s = 0; s < p.nranks; ++s) {
    CopyRange(a.out + static_cast<size_t>(s) * a.row_bytes, mine + static_cast<size_t>(s) * slot,
              lo, hi, vec);
  }
}

}  // namespace

size_t ProbeWindowBytes(size_t row_bytes, int nranks) {
  return kWindowHeaderBytes + static_cast<size_t>(nranks) * SlotBytes(row_bytes);
}

int ProbeNumBlocks(size_t row_bytes) {
  // ~64 KiB of each slot per CTA, at most one CTA per LSA barrier.
  const size_t want = (SlotBytes(row_bytes) + (size_t(64) << 10) - 1) / (size_t(64) << 10);
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, kLsaBarrierCount)));
}

cudaError_t LaunchProbeAllToAll(const ProbeArgs& args, const ncclDevComm& devcomm,
                                const EpPeers& peers, cudaStream_t stream) {
  ProbeAllToAllKernel<<<ProbeNumBlocks(args.row_bytes), kProbeThreads, 0, stream>>>(args, devcomm,
                                                                                   peers);
  return cudaGetLastError();
}

}  // namespace jax_ep
