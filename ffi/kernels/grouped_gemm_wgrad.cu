// Grouped GEMM instance: dw, out[g][H, F] = x[rows_g, H]^T @ dy[rows_g, F]
// (A = x^T is M-major, CUTLASS's column-major A; B row-major), bf16 output.
// K is the group's row count, any value; empty groups are zero-filled.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using LA = cutlass::layout::ColumnMajor;
using LB = cutlass::layout::RowMajor;
using Cfg = gg::Config<LA, LB, cutlass::bfloat16_t>;
}  // namespace

size_t GgScratchWeightGrad(const GroupedGemmArgs& a, int sms) {
  return gg::ScratchBytes<Cfg>(a, sms);
}

const char* GgRunWeightGrad(const GroupedGemmArgs& a, void* s, int sms,
                            cudaStream_t st) {
  return gg::Run<Cfg, GgKind::kWeightGrad>(a, s, sms, st);
}

}  // namespace jax_ep
