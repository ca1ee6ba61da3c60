// Grouped GEMM instance: the forward with 64-row tiles (tile_rows = 64),
// computed swapped: out_g^T[F, rows] = w[g]^T · x_g^T (A = w[g]^T is
// M-major, B = x_g^T is K-major, D column-major = out row-major), bf16 out.
#include "kernels/grouped_gemm.cuh"

namespace jax_ep {
namespace {
using ColumnMajor = cutlass::layout::ColumnMajor;
using Cfg = gg::Config<ColumnMajor, ColumnMajor, cutlass::bfloat16_t, gg::SwappedSchedule,
                       ColumnMajor>;
}  // namespace

size_t GgScratchForwardSwapped(const GroupedGemmArgs& a, int sms) {
  return gg::ScratchBytes<Cfg>(a, sms);
}

const char* GgRunForwardSwapped(const GroupedGemmArgs& a, void* s, int sms,
                                cudaStream_t st) {
  return gg::Run<Cfg, GgKind::kForwardSwapped>(a, s, sms, st);
}

}  // namespace jax_ep
