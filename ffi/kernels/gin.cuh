// GIN (GPU-initiated RDMA through a network card): the device side of the
// transport that reaches EP peers outside this rank's NVLink (LSA) team.
//
// Kept apart from common.cuh so that only the code that talks to the network
// sees NCCL types; a kernel gets an opaque EpPeers::gin pointer and the
// EpPeers::gin_mask bits, and calls these helpers for peer j only when bit j
// is set. The helpers exist in every build: where the NCCL headers lack the
// GIN device API they report kGinUnavailable and return false, and the host
// never sets a gin_mask bit there (Communicator.create fails instead).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "common.cuh"

#if __has_include(<nccl.h>)
#include <nccl.h>
#endif

// JAX_EP_HAVE_GIN: 1 when the NCCL headers carry the GIN device API that
// these helpers use (ncclGin, put with a remote signal, readSignal, flush),
// which first shipped with NCCL 2.28.7. Define it to 0 on the command line to
// build without GIN against any headers.
#ifndef JAX_EP_HAVE_GIN
#if defined(NCCL_VERSION_CODE) && defined(NCCL_VERSION) && __has_include(<nccl_device/gin.h>)
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
#define JAX_EP_HAVE_GIN 1
#endif
#endif
#endif
#ifndef JAX_EP_HAVE_GIN
#define JAX_EP_HAVE_GIN 0
#endif

#if JAX_EP_HAVE_GIN
#include <nccl_device.h>
#endif

namespace jax_ep {

// Status cause for "GIN asked of a peer that has no GIN connection" (a kernel
// bug, or a build without GIN). Far above common.cuh's causes so that new
// ones added there do not collide with it.
constexpr Cause kGinUnavailable = static_cast<Cause>(64);

// Signals: each source rank owns kGinChannels of them on every destination,
// so a receiver can wait for one source and one channel (e.g. one CTA's share
// of the rows) without counting anyone else's puts.
constexpr int kGinChannels = 32;
constexpr int kGinSignalCount = kMaxRanks * kGinChannels;
// A hint to NCCL (it may create fewer); contexts spread puts over queues.
constexpr int kGinContextCount = 4;

__host__ __device__ constexpr uint32_t GinSignalId(int src_rank, int channel) {
  return static_cast<uint32_t>(src_rank * kGinChannels + channel);
}

// Each GIN context has its own signals, and a signal only vouches for the puts
// that went through its own context. So the context is a function of the
// signal: a put, the wait on its signal and the flush of its source always
// meet on the same context, and channels spread over the contexts.
__host__ __device__ constexpr int GinContextOf(uint32_t signal) {
  return static_cast<int>(signal % kGinChannels);
}

#if JAX_EP_HAVE_GIN
// What a kernel needs for GIN, copied once into device memory at create and
// reached through EpPeers::gin. Plain data: the device communicator is the
// one NCCL filled in on the host, the window is the symmetric window the LSA
// path uses too, so an offset means the same bytes on every rank.
struct GinComm {
  ncclDevComm devcomm;
  ncclWindow_t window;
  uint32_t signal_base;   // GinSignalId(...) + signal_base is NCCL's signal id
  uint32_t signal_count;  // signals jax_ep may use from signal_base on
};
#endif

namespace gin_detail {

__device__ __forceinline__ bool Usable(const EpPeers& p, Op op, int peer) {
  if (peer < 0 || peer >= p.nranks || p.gin == nullptr || ((p.gin_mask >> peer) & 1u) == 0u) {
    report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
    return false;
  }
  return true;
}

#if JAX_EP_HAVE_GIN
__device__ __forceinline__ const GinComm& Comm(const EpPeers& p) {
  return *static_cast<const GinComm*>(p.gin);
}

// 2.30.7 split the remote signal into strong and weak flavours; the strong one
// is what the older ncclGin_SignalInc always was: when the receiver sees the
// increment, this put and every earlier put on the same context to the same
// peer have landed. The receiver's wait relies on exactly that.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 7)
using SignalInc = ncclGin_StrongSignalInc;
#else
using SignalInc = ncclGin_SignalInc;
#endif

template <typename Coop>
__device__ __forceinline__ void Put(const GinComm& g, Coop coop, int peer, size_t off,
                                    size_t bytes, uint32_t signal) {
  ncclGin gin(g.devcomm, GinContextOf(signal));
  const SignalInc inc{g.signal_base + signal};
  if (bytes == 0) {
    gin.signal(ncclTeamWorld(g.devcomm), peer, inc, coop);
  } else {
    gin.put(ncclTeamWorld(g.devcomm), peer, g.window, off, g.window, off, bytes, inc,
            ncclGin_None{}, coop);
  }
}
#endif


// The checks both put flavours share; the put itself by one thread or a warp.
template <bool kWarp>
__device__ inline bool CheckedPut(const EpPeers& p, Op op, int peer, size_t off, size_t bytes,
                                  uint32_t signal) {
  if (!Usable(p, op, peer)) return false;
  if (off > p.window_bytes || bytes > p.window_bytes - off) {
    report_error(p, op, Cause::kWindowTooSmall);
    return false;
  }
#if JAX_EP_HAVE_GIN
  const GinComm& g = Comm(p);
  if (signal >= g.signal_count) {
    report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
    return false;
  }
  if constexpr (kWarp) Put(g, ncclCoopWarp{}, peer, off, bytes, signal);
  else Put(g, ncclCoopThread{}, peer, off, bytes, signal);
  return true;
#else
  (void)signal;
  report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
  return false;
#endif
}
}  // namespace gin_detail

// Copies bytes [off, off + bytes) of this rank's window to the same offsets of
// peer `peer`'s window and, once they have landed there, adds 1 to signal
// `signal` (a GinSignalId(p.rank, channel)) on that peer. bytes == 0 sends the
// signal alone.
//
// ONE thread calls it. The bytes must already be in this rank's window, and
// written by this thread or by threads that synchronised with it first
// (__syncthreads / a grid barrier): the put releases at device scope before
// the network card reads them. The put is asynchronous: the source bytes must
// not change until GinFlush(p, signal) by the same thread says the card has
// read them (or until the peer has answered after its GinWaitSignal).
// Returns false, with the status word set, when GIN cannot be used for that
// peer, the range leaves the window or the signal is not one of jax_ep's.
__device__ inline bool GinPutRange(const EpPeers& p, Op op, int peer, size_t off, size_t bytes,
                                   uint32_t signal) {
  return gin_detail::CheckedPut<false>(p, op, peer, off, bytes, signal);
}

// Same as GinPutRange, called by all 32 lanes of one warp with the same
// arguments (lane 0 issues; the lanes synchronise around it). For code that
// already runs a warp per chunk and would otherwise branch on the lane.
__device__ inline bool GinPutRangeWarp(const EpPeers& p, Op op, int peer, size_t off,
                                       size_t bytes, uint32_t signal) {
  return gin_detail::CheckedPut<true>(p, op, peer, off, bytes, signal);
}

// After it returns, the source bytes of every put this thread issued with
// signal `signal` (and with any other signal of the same context) may be
// overwritten. It says nothing about their arrival at the peer: the peer's
// GinWaitSignal does. One thread.
__device__ inline void GinFlush(const EpPeers& p, uint32_t signal) {
#if JAX_EP_HAVE_GIN
  if (p.gin == nullptr) return;
  const GinComm& g = gin_detail::Comm(p);
  ncclGin gin(g.devcomm, GinContextOf(signal));
  gin.flush(ncclCoopThread{});
#else
  (void)p;
  (void)signal;
#endif
}

// Waits until this rank's signal `signal` has reached `expected`, i.e. until
// the puts counted into it (by the peer `peer` that owns the signal, see
// GinSignalId) have landed in this rank's window; their bytes are then
// visible to this thread (acquire), and to the rest of the CTA after a
// __syncthreads. Signals are never reset: they count every put since create,
// so the caller keeps the running total it expects (in device memory that
// outlives the launch, like EpPeers::epoch).
//
// Same rules as rank_barrier: one thread; returns false after reporting
// kPeerTimeout for `peer` when the signal does not get there within
// p.timeout_ns, and false without reporting when another thread or rank has
// already set the status word. Never spins forever.
__device__ inline bool GinWaitSignal(const EpPeers& p, Op op, uint32_t signal, uint64_t expected,
                                     int peer) {
  if (!gin_detail::Usable(p, op, peer)) return false;
#if JAX_EP_HAVE_GIN
  const GinComm& g = gin_detail::Comm(p);
  if (signal >= g.signal_count) {
    report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
    return false;
  }
  ncclGin gin(g.devcomm, GinContextOf(signal));
  const uint32_t id = g.signal_base + signal;
  const unsigned long long t0 = globaltimer_ns();
  // Signed difference: correct across a wrap of the 64-bit count too.
  unsigned polls = 0;
  while (static_cast<int64_t>(gin.readSignal(id) - expected) < 0) {
    if ((++polls & 255u) == 0u && has_error(p)) return false;
    if (globaltimer_ns() - t0 > p.timeout_ns) {
      report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(peer));
      return false;
    }
  }
  return true;
#else
  (void)signal;
  (void)expected;
  report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
  return false;
#endif
}

}  // namespace jax_ep
