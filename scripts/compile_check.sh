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
for f in ffi/comm.cc ffi/handlers/*.cc ffi/kernels/*.cu; do
  if nvcc -x cu -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
       -DJAX_EP_WITH_CUDA=1 -diag-suppress 940 -I ffi -I "$NCCL_INC" -I "$XLA_INC" -I "$NB_INC" \
       -I "$PY_INC" -c "$f" -o /dev/null; then
    echo "ok   $f"
  else
    echo "FAIL $f"; status=1
  fi
done
exit $status
