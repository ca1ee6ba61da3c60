#!/usr/bin/env bash
# Compiles every native source (no link) against a given NCCL include folder,
# to check the version macros, e.g. against a newer NCCL than the one built:
#   pip download nvidia-nccl-cu13==2.30.7 --no-deps -d /tmp/n && unzip -q /tmp/n/*.whl -d /tmp/n
#   scripts/compile_check.sh /tmp/n/nvidia/nccl/include
set -euo pipefail
cd "$(dirname "$0")/.."
NCCL_INC=${1:?usage: compile_check.sh NCCL_INCLUDE_DIR}
XLA_INC=$(python3 -c "import jax; print(jax.ffi.include_dir())")
NB_INC=$(python3 -c "import nanobind, os; print(os.path.join(os.path.dirname(nanobind.__file__), 'include'))")
PY_INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
grep -E "define NCCL_(MAJOR|MINOR|PATCH) " "$NCCL_INC/nccl.h" | awk '{printf "%s ", $3} END {print "<- NCCL"}'
status=0
for f in ffi/runtime/*.cc ffi/handlers/*.cc ffi/kernels/*.cu ffi/testing/*.cc ffi/testing/*.cu; do
  if nvcc -x cu -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
       -DJAX_EP_WITH_CUDA=1 -DJAX_EP_TESTING=1 -diag-suppress 940 -I ffi -I "$NCCL_INC" -I "$XLA_INC" -I "$NB_INC" \
       -I "$PY_INC" -c "$f" -o /dev/null; then
    echo "ok   $f"
  else
    echo "FAIL $f"; status=1
  fi
done
# The GIN helpers are inline functions: instantiate every one (the kernels
# use most of them too), with the GIN device API and (JAX_EP_HAVE_GIN=0)
# without it, so both branches are known to compile against these headers.
GIN_TU=$(mktemp /tmp/jax_ep_gin_check.XXXXXX.cu)
trap 'rm -f "$GIN_TU"' EXIT
cat >"$GIN_TU" <<'CUEOF'
#include "kernels/barrier.cuh"
#include "kernels/gin_stage.cuh"
__global__ void GinCheckKernel(jax_ep::EpPeers p, size_t off, size_t n, uint64_t want) {
  const uint32_t s = jax_ep::GinSignalId(p.rank, blockIdx.x);
  const int j = (p.rank + 1) % p.nranks;
  if ((p.gin_mask >> j) & 1u) {
    if (threadIdx.x == 0) {
      jax_ep::GinPut(p, jax_ep::Op::kDispatch, j, off, off + n, n, s);
      jax_ep::GinPutQuiet(p, jax_ep::Op::kDispatch, j, off, off + n, n, s);
      jax_ep::rank_barrier(p, jax_ep::Op::kCombine);
    }
    if (threadIdx.x < 32) {
      jax_ep::GinPutWarp(p, jax_ep::Op::kCombine, j, off, off + n, n, s);
      jax_ep::GinWaitSignalWarp(p, jax_ep::Op::kCombine, s, want, j, 0);
      jax_ep::GinFlushWarp(p, 3u);
    }
  }
}
#if JAX_EP_HAVE_GIN
static_assert(sizeof(jax_ep::GinComm) >= sizeof(ncclDevComm), "GinComm holds the devcomm");
#endif
CUEOF
for gin in auto 0; do
  def=""; [ "$gin" = 0 ] && def="-DJAX_EP_HAVE_GIN=0"
  if nvcc -x cu -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
       $def -I ffi -I "$NCCL_INC" -c "$GIN_TU" -o /dev/null; then
    echo "ok   ffi/kernels/gin.cuh (JAX_EP_HAVE_GIN=$gin)"
  else
    echo "FAIL ffi/kernels/gin.cuh (JAX_EP_HAVE_GIN=$gin)"; status=1
  fi
done
exit $status
