// Grouped GEMM instance: the FP8 forward (and dgrad) on pingpong 64-row
// tiles, same product as grouped_gemm_fp8.cu.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using Cfg = gg::Fp8Config<cutlass::bfloat16_t, gg::Fp8PingpongSchedule>;
}  // namespace

size_t GgScratchForwardFp8Pingpong(const GroupedGemmArgs& a, int sms) {
  return gg::ScratchBytes<Cfg>(a, sms);
}

const char* GgRunForwardFp8Pingpong(const GroupedGemmArgs& a, void* s, int sms,
                                    cudaStream_t st) {
  return gg::Run<Cfg, GgKind::kForwardFp8>(a, s, sms, st);
}

}  // namespace jax_ep
