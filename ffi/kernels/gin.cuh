// GIN (GPU-initiated RDMA through a network card): the device side of the
// transport that reaches EP peers outside this rank's NVLink (LSA) team.
//
// Emulation (EpPeers::gin_emulated, transport "gin_emulated"): the same
// helpers carry out puts and signals with NVLink loads/stores through
// EpPeers::gin_emu, with the ordering a real GIN gives (a signal is added
// only after its put's bytes, and every earlier put's, are visible at the
// peer). Machines without a NIC can so run the kernels' GIN branches, which
// see no difference; only these helpers know.
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
// so a receiver can wait for one source and one channel (e.g. one chunk of
// the rows) without counting anyone else's puts. The channel map, one owner
// per channel so that no op's signal counts another op's puts:
//   0 .. kGinDataChannels-1  the normal ops' row chunks,
//   Engram requests, Engram responses, low-latency dispatch, low-latency
//   combine (one channel each),
//   the last: control — rank barriers (one signal per barrier, so its count is
//   the barrier epoch) and the small control words put just before them.
constexpr int kGinChannels = 32;
constexpr int kGinSignalCount = kMaxRanks * kGinChannels;
constexpr int kGinControlChannel = kGinChannels - 1;
constexpr int kGinLlCombineChannel = kGinChannels - 2;
constexpr int kGinLlDispatchChannel = kGinChannels - 3;
constexpr int kGinEngramResponseChannel = kGinChannels - 4;
constexpr int kGinEngramRequestChannel = kGinChannels - 5;
constexpr int kGinDataChannels = kGinChannels - 5;
// A hint to NCCL (it may create fewer); contexts spread puts over queues.
constexpr int kGinContextCount = 4;
static_assert(kGinEmuSignalsOffset + 8 * static_cast<size_t>(kGinSignalCount) <= kWindowHeaderBytes,
              "emulated GIN signals fit the window header");

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
  const bool have = p.gin_emulated || p.gin != nullptr;
  if (peer < 0 || peer >= p.nranks || !have || ((p.gin_mask >> peer) & 1u) == 0u) {
    report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
    return false;
  }
  return true;
}

// ---- emulation over NVLink
__device__ __forceinline__ uint64_t* EmuSignal(char* window, uint32_t signal) {
  return reinterpret_cast<uint64_t*>(window + kGinEmuSignalsOffset) + signal;
}

// Source bytes were written by other warps of this kernel (or by this
// warp's bulk stores), which the caller has synchronised with: read from L2,
// never from a stale L1 line.
__device__ __forceinline__ uint4 EmuLoad(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

// `lanes` threads (1, or all 32 of a warp with `lane` its lane id) copy the
// bytes from this rank's window to the peer's; then the first one makes
// them visible system-wide before it adds the signal, so the signal vouches
// for this put and all earlier ones, as a real strong signal does.
__device__ inline void EmuPut(const EpPeers& p, int peer, size_t dst_off, size_t src_off,
                              size_t bytes, uint32_t signal, bool with_signal, int lane,
                              int lanes) {
  char* dst = p.gin_emu[peer] + dst_off;
  const char* src = p.base[p.rank] + src_off;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15u) == 0) {
    const size_t n = bytes / 16;
    for (size_t i = lane; i < n; i += lanes)
      reinterpret_cast<uint4*>(dst)[i] = EmuLoad(reinterpret_cast<const uint4*>(src) + i);
  } else {
    for (size_t i = lane; i < bytes; i += lanes)
      dst[i] = reinterpret_cast<const volatile char*>(src)[i];
  }
  if (lanes > 1) __syncwarp();
  if (lane == 0) {
    __threadfence_system();
    if (with_signal) {
      asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(EmuSignal(p.gin_emu[peer], signal))
                   : "memory");
    }
  }
  if (lanes > 1) __syncwarp();
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
__device__ __forceinline__ void Put(const GinComm& g, Coop coop, int peer, size_t dst_off,
                                    size_t src_off, size_t bytes, uint32_t signal,
                                    bool with_signal) {
  ncclGin gin(g.devcomm, GinContextOf(signal));
  const SignalInc inc{g.signal_base + signal};
  if (!with_signal) {
    if (bytes != 0)
      gin.put(ncclTeamWorld(g.devcomm), peer, g.window, dst_off, g.window, src_off, bytes,
              ncclGin_None{}, ncclGin_None{}, coop);
  } else if (bytes == 0) {
    gin.signal(ncclTeamWorld(g.devcomm), peer, inc, coop);
  } else {
    gin.put(ncclTeamWorld(g.devcomm), peer, g.window, dst_off, g.window, src_off, bytes, inc,
            ncclGin_None{}, coop);
  }
}
#endif

// The checks every put shares; the put itself by one thread or a warp.
template <bool kWarp>
__device__ inline bool CheckedPut(const EpPeers& p, Op op, int peer, size_t dst_off,
                                  size_t src_off, size_t bytes, uint32_t signal,
                                  bool with_signal) {
  if (!Usable(p, op, peer)) return false;
  if (dst_off > p.window_bytes || bytes > p.window_bytes - dst_off ||
      src_off > p.window_bytes || bytes > p.window_bytes - src_off) {
    report_error(p, op, Cause::kWindowTooSmall);
    return false;
  }
  if (signal >= static_cast<uint32_t>(kGinSignalCount)) {
    report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
    return false;
  }
  if (p.gin_emulated) {
    EmuPut(p, peer, dst_off, src_off, bytes, signal, with_signal, kWarp ? (threadIdx.x & 31) : 0,
           kWarp ? 32 : 1);
    return true;
  }
#if JAX_EP_HAVE_GIN
  const GinComm& g = Comm(p);
  if (signal >= g.signal_count) {
    report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
    return false;
  }
  if constexpr (kWarp) Put(g, ncclCoopWarp{}, peer, dst_off, src_off, bytes, signal, with_signal);
  else Put(g, ncclCoopThread{}, peer, dst_off, src_off, bytes, signal, with_signal);
  return true;
#else
  report_error(p, op, kGinUnavailable, static_cast<uint32_t>(peer));
  return false;
#endif
}
#if JAX_EP_HAVE_GIN
// The flush of every context behind `channels`, by the cooperation `Coop`
// (a warp or one thread) that issued the puts.
template <typename Coop>
__device__ inline void Flush(const EpPeers& p, uint32_t channels) {
  if (p.gin_emulated || p.gin == nullptr) return;
  const GinComm& g = Comm(p);
  for (uint32_t m = channels; m; m &= m - 1) {
    ncclGin gin(g.devcomm, GinContextOf(static_cast<uint32_t>(__ffs(m) - 1)));
    gin.flush(Coop{});
  }
}
#endif

}  // namespace gin_detail

// Copies bytes [src_off, src_off + bytes) of this rank's window to
// [dst_off, dst_off + bytes) of peer `peer`'s window and, once they (and the
// bytes of every earlier put of this rank to that peer on the same context,
// GinContextOf(signal)) have landed there, adds 1 to signal `signal` (a
// GinSignalId(p.rank, channel)) on that peer. bytes == 0 sends the signal
// alone.
//
// ONE thread calls it. The bytes must already be in this rank's window, and
// written by this thread or by threads that synchronised with it first
// (__syncthreads / a grid barrier): the put releases at device scope before
// the network card reads them. The put is asynchronous: the source bytes must
// not change until a flush (GinFlushWarp) says the card has read them (or
// until the peer has answered after its wait on the signal).
// Returns false, with the status word set, when GIN cannot be used for that
// peer, a range leaves the window or the signal is not one of jax_ep's.
__device__ inline bool GinPut(const EpPeers& p, Op op, int peer, size_t dst_off, size_t src_off,
                              size_t bytes, uint32_t signal) {
  return gin_detail::CheckedPut<false>(p, op, peer, dst_off, src_off, bytes, signal, true);
}

// The same put without a signal: it goes through signal's context and is
// vouched for by the next signal this rank sends to `peer` on that context
// (e.g. the control channel's barrier signal). One thread.
__device__ inline bool GinPutQuiet(const EpPeers& p, Op op, int peer, size_t dst_off,
                                   size_t src_off, size_t bytes, uint32_t signal) {
  return gin_detail::CheckedPut<false>(p, op, peer, dst_off, src_off, bytes, signal, false);
}

// GinPutQuiet by all 32 lanes of one warp with the same arguments.
__device__ inline bool GinPutQuietWarp(const EpPeers& p, Op op, int peer, size_t dst_off,
                                       size_t src_off, size_t bytes, uint32_t signal) {
  return gin_detail::CheckedPut<true>(p, op, peer, dst_off, src_off, bytes, signal, false);
}

// GinPut by all 32 lanes of one warp with the same arguments.
__device__ inline bool GinPutWarp(const EpPeers& p, Op op, int peer, size_t dst_off,
                                  size_t src_off, size_t bytes, uint32_t signal) {
  return gin_detail::CheckedPut<true>(p, op, peer, dst_off, src_off, bytes, signal, true);
}

// After it returns, the source bytes of every put the warp issued
// (GinPutWarp) on the channels in `channels` (bit c: channel c), and on any
// other channel of the same contexts, may be overwritten. It says nothing
// about their arrival at the peer: the peer's wait on the signal does.
// All 32 lanes. (Emulated puts are synchronous.)
__device__ inline void GinFlushWarp(const EpPeers& p, uint32_t channels) {
#if JAX_EP_HAVE_GIN
  gin_detail::Flush<ncclCoopWarp>(p, channels);
#else
  (void)p;
  (void)channels;
#endif
}

// GinFlushWarp by one thread, for a put issued by one thread (GinPut,
// GinPutQuiet) whose source word this rank overwrites soon after.
__device__ inline void GinFlush(const EpPeers& p, uint32_t channels) {
#if JAX_EP_HAVE_GIN
  gin_detail::Flush<ncclCoopThread>(p, channels);
#else
  (void)p;
  (void)channels;
#endif
}

// This rank's count of signal `signal` (acquire: the puts it vouches for are
// visible to this thread once it has seen their increments). 0, after
// reporting, where GIN cannot be had.
__device__ inline uint64_t GinReadSignal(const EpPeers& p, Op op, uint32_t signal) {
  if (signal >= static_cast<uint32_t>(kGinSignalCount)) {
    report_error(p, op, kGinUnavailable, signal / kGinChannels);
    return 0;
  }
  if (p.gin_emulated) return ld_acquire_sys(gin_detail::EmuSignal(p.base[p.rank], signal));
#if JAX_EP_HAVE_GIN
  if (p.gin != nullptr) {
    const GinComm& g = gin_detail::Comm(p);
    ncclGin gin(g.devcomm, GinContextOf(signal));
    return gin.readSignal(g.signal_base + signal);
  }
#endif
  report_error(p, op, kGinUnavailable, signal / kGinChannels);
  return 0;
}

// Signed difference: correct across a wrap of the 64-bit count too.
__device__ __forceinline__ bool GinReached(uint64_t value, uint64_t expected) {
  return static_cast<int64_t>(value - expected) >= 0;
}

// Waits until this rank's signal `signal` has reached `expected`, i.e. until
// the puts counted into it (by the peer `peer` that owns the signal, see
// GinSignalId) have landed in this rank's window; their bytes are then
// visible to the warp (acquire). Signals are never reset: they count every
// put since create, so the caller knows the running total it expects.
// For the data kernels' receivers: lane 0 polls with a back-off (hundreds of
// warps may wait at once), the status word is not looked at (a receiver
// drains what its peers send even after failing on its own, see ep_copy.cuh's
// WaitChunk), and the clock starts at t0. False after reporting kPeerTimeout
// for `peer`; never spins forever. All 32 lanes; the result is the same on
// every lane.
__device__ inline bool GinWaitSignalWarp(const EpPeers& p, Op op, uint32_t signal,
                                         uint64_t expected, int peer, unsigned long long t0) {
  int ok = 1;
  if ((threadIdx.x & 31) == 0) {
    if (!gin_detail::Usable(p, op, peer)) {
      ok = 0;
    } else {
      unsigned polls = 0;
      while (!GinReached(GinReadSignal(p, op, signal), expected)) {
        __nanosleep(128);
        if ((++polls & 63u) == 0u && globaltimer_ns() - t0 > p.timeout_ns) {
          report_error(p, op, Cause::kPeerTimeout, static_cast<uint32_t>(peer));
          ok = 0;
          break;
        }
      }
    }
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  __syncwarp();
  return ok != 0;
}

}  // namespace jax_ep
