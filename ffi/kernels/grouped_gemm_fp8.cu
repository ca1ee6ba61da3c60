// Grouped GEMM instance: FP8 forward with fine-grained scales,
// out[rows_g, F] = (xq * xs)[rows_g, H] @ ((wq * ws)[g][F, H])^T, bf16 out.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using Cfg = gg::Fp8Config<cutlass::bfloat16_t>;
}  // namespace

size_t GgScratchForwardFp8(const GroupedGemmArgs& a, int sms) {
  return gg::ScratchBytes<Cfg>(a, sms);
}

const char* GgRunForwardFp8(const GroupedGemmArgs& a, void* s, int sms,
                            cudaStream_t st) {
  return gg::Run<Cfg, GgKind::kForwardFp8>(a, s, sms, st);
}

}  // namespace jax_ep
