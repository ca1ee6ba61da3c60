// Grouped GEMM instances: forward, out[rows_g, F] = x[rows_g, H] @ w[g][H, F]
// (A row-major, B row-major, i.e. N-major), bf16 or f32 output.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using RowMajor = cutlass::layout::RowMajor;
using Bf16Out = gg::Config<RowMajor, RowMajor, cutlass::bfloat16_t>;
using F32Out = gg::Config<RowMajor, RowMajor, float>;
}  // namespace

size_t GgScratchForward(const GroupedGemmArgs& a, int sms) {
  return a.out_dtype == GgOut::kF32 ? gg::ScratchBytes<F32Out>(a, sms)
                                    : gg::ScratchBytes<Bf16Out>(a, sms);
}

const char* GgRunForward(const GroupedGemmArgs& a, void* s, int sms, cudaStream_t st) {
  return a.out_dtype == GgOut::kF32 ? gg::Run<F32Out, GgKind::kForward>(a, s, sms, st)
                                    : gg::Run<Bf16Out, GgKind::kForward>(a, s, sms, st);
}

}  // namespace jax_ep
