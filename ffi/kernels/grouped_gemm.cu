// Grouped GEMM: picks the instance for the product asked for
// (grouped_gemm.h). No CUTLASS here.
#include "kernels/grouped_gemm.h"

namespace jax_ep {

namespace {
bool Swapped(const GroupedGemmArgs& a) {
  return a.kind == GgKind::kForward && a.tile_rows == 64 && a.out_dtype == GgOut::kBF16;
}
}  // namespace

size_t GroupedGemmScratchBytes(const GroupedGemmArgs& args, int sms) {
  if (Swapped(args)) return GgScratchForwardSwapped(args, sms);
  switch (args.kind) {
    case GgKind::kForwardSwapped: return GgScratchForwardSwapped(args, sms);
    case GgKind::kForward: return GgScratchForward(args, sms);
    case GgKind::kTransW: return GgScratchTransW(args, sms);
    case GgKind::kWeightGrad: return GgScratchWeightGrad(args, sms);
    case GgKind::kForwardFp8: return GgScratchForwardFp8(args, sms);
  }
  return 0;
}

const char* LaunchGroupedGemm(const GroupedGemmArgs& args, void* scratch, int sms,
                              cudaStream_t stream) {
  if (Swapped(args)) return GgRunForwardSwapped(args, scratch, sms, stream);
  switch (args.kind) {
    case GgKind::kForwardSwapped:
      return GgRunForwardSwapped(args, scratch, sms, stream);
    case GgKind::kForward: return GgRunForward(args, scratch, sms, stream);
    case GgKind::kTransW: return GgRunTransW(args, scratch, sms, stream);
    case GgKind::kWeightGrad: return GgRunWeightGrad(args, scratch, sms, stream);
    case GgKind::kForwardFp8: return GgRunForwardFp8(args, scratch, sms, stream);
  }
  return "unknown grouped GEMM kind";
}

}  // namespace jax_ep
