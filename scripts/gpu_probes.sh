#!/usr/bin/env bash
# Runs the standalone CUDA probes built on the CPU machine and carried in
# .whl/probe/ (the device call's `carry: [".whl"]`), then, where ncu can read
# the card's counters, profiles the fused linear 1 and the CUTLASS GEMM it is
# measured against. Records under $OUT/results/ (copy them into
# benchmarks/results/ with cp -rn); the logs and ncu reports as one archive,
# $OUT/probes.tgz (the device call returns only a few files).
#
#   OUT=dir JAX_EP_COMMIT=<sha the binaries were built at> scripts/gpu_probes.sh
#   GPU_PROBES="mega_linear1 ggc15 ggc16 ggc17 ggc14" (default; a missing
#   binary is skipped with a line saying so), GPU_PROBE_NCU=0 skips ncu.
#
# Build them here first (nvcc 13.0, CUTLASS from the pinned wheel; ~90 s each):
#   C=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source
#   F="-std=c++17 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
#      -I ffi -I benchmarks -I $C/include -I $C/tools/util/include"
#   nvcc $F benchmarks/mega_linear1_probe.cu -o .whl/probe/mega_linear1
#   for n in 14 15 16 17; do nvcc $F -DCFG=$n benchmarks/grouped_gemm_configs.cu -o .whl/probe/ggc$n; done
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d /tmp/jax_ep_probes.XXXXXX)}
P="$OUT/probes"
mkdir -p "$P" "$OUT/results"
export NCCL_NVLS_ENABLE=0
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
machine="${ngpu}x ${gpu:-unknown GPU}"
echo "machine: $machine" | tee "$P/machine.txt"
probes=${GPU_PROBES:-mega_linear1 ggc15 ggc16 ggc17 ggc14}
logs=()
for p in $probes; do
  if [ ! -x ".whl/probe/$p" ]; then
    echo "$p: not built (.whl/probe/$p missing)"
    continue
  fi
  t0=$SECONDS
  timeout "${GPU_PROBE_TIMEOUT:-90}" ".whl/probe/$p" > "$P/$p.log" 2>&1
  echo "$p: rc $? in $((SECONDS - t0)) s"
  logs+=("$P/$p.log")
done
if [ ${#logs[@]} -gt 0 ]; then
  python3 benchmarks/probe_record.py --out "$OUT/results" --machine "$machine" \
    --command "scripts/gpu_probes.sh (GPU_PROBES=\"$probes\"), binaries built with nvcc 13.0 and the CUTLASS 4.2.0 wheel as in its header" \
    "${logs[@]}"
fi
# The probes' own lines, then ncu (the slowest part, last, so a cut call keeps
# the records).
grep -h "ms\|check\|schedule\|^fp8" "${logs[@]}" 2>/dev/null | cut -c1-160
if [ "${GPU_PROBE_NCU:-1}" != 0 ] && command -v ncu > /dev/null; then
  # One launch each: v0, v2 and the CUTLASS FP8 forward; --clock-control
  # none leaves the clocks as the timings saw them (device notes, METHOD.md).
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
--section Occupancy --section SchedulerStats"
  # Mangled names: v0 is FusedLinear1<0>, v2 FusedLinear1Tma<false, false>.
  for k in "mega_linear1 FusedLinear1ILi0E" "mega_linear1 FusedLinear1TmaILb0ELb0E" \
           "ggc15 GemmUniversal"; do
    set -- $k
    [ -x ".whl/probe/$1" ] || continue
    t0=$SECONDS
    PROBE_CHECK_ONLY=1 timeout 150 ncu --clock-control none --kernel-name-base mangled -k "regex:$2" -c 1 $sections ".whl/probe/$1" \
      > "$P/ncu_$2.txt" 2>&1
    echo "ncu $2: rc $? in $((SECONDS - t0)) s"
  done
fi
tar -czf "$OUT/probes.tgz" -C "$OUT" probes && rm -rf "$P"
