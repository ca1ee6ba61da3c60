// What dispatch's two launches share: the setup kernel (dispatch_setup.cu:
// prep blocks and the control block) and the data kernel (dispatch.cu) read
// one config, one set of I/O pointers and the scratch words the setup leaves
// in this rank's window (window_layout.h's DispatchScratch).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common.cuh"
#include "ep_kernels.h"
#include "peer.cuh"
#include "window_layout.h"

namespace jax_ep {

constexpr int kControlThreads = 1024;   // one thread per local expert in the control block
constexpr int kMaxLocalExperts = kControlThreads;

struct DispatchCfg {
  int T, H, K, E, El, C, align;
  int expert;       // layout == expert
  int in_bytes;     // bytes per element of x
  int has_scales;   // payload is FP8 (input FP8 or cast)
  int ue8m0;
  int gin_rows;     // > 0: rows to GIN peers are staged and put in chunks of this many (gin_stage.cuh)
  int prep_experts; // expert layout: experts per prep block, 1..kPrepExperts (PrepExpertsPerBlock)
  unsigned long long* stamps;  // setup_stamps.h: the setup's phase times; null: none
};

struct PushIO {
  const void* x;
  const float* x_scales;
  const int32_t* topk;
  const float* topk_w;
  int32_t* pos_in_rank;  // written by the prep blocks, read by the data kernel
  void* recv_x;
  float* recv_scales;
  int32_t* recv_topk_idx;
  float* recv_topk_w;
  int32_t* src_rank;
  int32_t* src_token;
  int32_t* src_k;
  int32_t* counts;
  int32_t* recv_counts;
};

__device__ __forceinline__ int* ScratchOf(const EpPeers& p, const DispatchWindow& w) {
  return reinterpret_cast<int*>(MyWindow(p) + w.scratch_off);
}

// Enqueues the setup kernel (one control block, R rank prep blocks, the
// expert prep blocks) and, where the setup stamps are built, their report.
// Sets c.prep_experts and c.stamps, which the data kernel is passed too.
// `num_sms` > 0: at most that many CTAs (at least 2: the control block and
// one prep block); 0: as many as the prep spreads over, which for
// `beside_compute` (a dispatch_start) is about the data kernel's SM budget,
// else every SM. Launch errors are left for the caller's cudaGetLastError.
void LaunchDispatchSetup(DispatchCfg& c, const DispatchWindow& w, const EpPeers& p, const PushIO& io,
                         int num_sms, bool beside_compute, cudaStream_t stream);

}  // namespace jax_ep
