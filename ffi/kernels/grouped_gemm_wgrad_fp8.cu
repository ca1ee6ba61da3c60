// Grouped GEMM instance: the FP8 weight gradient,
// out[g][H, F] = (xT * xs)[H, K_g] @ ((dyT * dys)[F, K_g])^T, bf16 out.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {

size_t GgScratchWeightGradFp8(const GroupedGemmArgs& a, int sms) {
  return gg::ScratchBytes<gg::Fp8WgradConfig>(a, sms);
}

const char* GgRunWeightGradFp8(const GroupedGemmArgs& a, void* s, int sms, cudaStream_t st) {
  return gg::Run<gg::Fp8WgradConfig, GgKind::kWeightGradFp8>(a, s, sms, st);
}

}  // namespace jax_ep
