// Grouped GEMM instance: dx, out[rows_g, H] = dy[rows_g, F] @ w[g][H, F]^T
// (A row-major; B = w^T is K-major, CUTLASS's column-major B), bf16 output.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using LA = cutlass::layout::RowMajor;
using LB = cutlass::layout::ColumnMajor;
using Cfg = gg::Config<LA, LB, cutlass::bfloat16_t>;
}  // namespace

size_t GgScratchTransW(const GroupedGemmArgs& a, int sms) { return gg::ScratchBytes<Cfg>(a, sms); }

const char* GgRunTransW(const GroupedGemmArgs& a, void* s, int sms, cudaStream_t st) {
  return gg::Run<Cfg, GgKind::kTransW>(a, s, sms, st);
}

}  // namespace jax_ep
