// Grouped GEMM: picks the instance for the product asked for
// (grouped_gemm.h). No CUTLASS here.
#include "kernels/grouped_gemm.h"

namespace jax_ep {

size_t GroupedGemmScratchBytes(const GroupedGemmArgs& args, int sms) {
  switch (args.kind) {
    case GgKind::kForward: return GgScratchForward(args, sms);
    case GgKind::kTransW: return GgScratchTransW(args, sms);
    case GgKind::kWeightGrad: return GgScratchWeightGrad(args, sms);
    case GgKind::kForwardFp8:
      return args.schedule ? GgScratchForwardFp8Pingpong(args, sms) : GgScratchForwardFp8(args, sms);
    case GgKind::kWeightGradFp8: return GgScratchWeightGradFp8(args, sms);
  }
  return 0;
}

const char* LaunchGroupedGemm(const GroupedGemmArgs& args, void* scratch, int sms,
                              cudaStream_t stream) {
  switch (args.kind) {
    case GgKind::kForward: return GgRunForward(args, scratch, sms, stream);
    case GgKind::kTransW: return GgRunTransW(args, scratch, sms, stream);
    case GgKind::kWeightGrad: return GgRunWeightGrad(args, scratch, sms, stream);
    case GgKind::kForwardFp8:
      return args.schedule ? GgRunForwardFp8Pingpong(args, scratch, sms, stream)
                           : GgRunForwardFp8(args, scratch, sms, stream);
    case GgKind::kWeightGradFp8: return GgRunWeightGradFp8(args, scratch, sms, stream);
  }
  return "unknown grouped GEMM kind";
}

}  // namespace jax_ep
