// Grouped GEMM instances: forward, out[rows_g, F] = x[rows_g, H] @ w[g][H, F]
// (A row-major, B row-major, i.e. N-major), bf16 or f32 output.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using RowMajor = cutlass::layout::RowMajor;
using F32Out = gg::V0<RowMajor, RowMajor, float>;
}  // namespace

size_t GgScratchForward(const GroupedGemmArgs& a, int sms) {
  return std::max(gg::ScratchBytes<F32Out>(a, sms),
                  gg::ScratchBytesAnyVariant<RowMajor, RowMajor, cutlass::bfloat16_t>(a, sms));
}

const char* GgRunForward(const GroupedGemmArgs& a, void* s, size_t n, int sms, cudaStream_t st) {
  return a.out_dtype == GgOut::kF32 ? gg::Run<F32Out, GgKind::kForward>(a, s, n, sms, st)
                                    : gg::RunVariant<RowMajor, RowMajor, cutlass::bfloat16_t,
                                                     GgKind::kForward>(a, s, n, sms, st);
}

}  // namespace jax_ep
