#!/usr/bin/env bash
# One-command check on the GPU machine: build with CUDA, show the topology and
# versions, run the GPU tests, run every benchmark, print a summary.
#
#   OUT=/some/dir scripts/gpu_check.sh      (PYTHON=python3 by default)
#   JAX_EP_COMMIT=<sha> labels the benchmark records (the tree copied to the
#   device machine has no .git; run it as JAX_EP_COMMIT=$(git rev-parse --short HEAD) ...)
#   GPU_CHECK_TESTS="tests/test_gpu_x.py ..." runs only those GPU test files
#   ("none": no tests; "a.py b.py | c.py" runs each group as its own pytest
#   process, the groups in parallel),
#   GPU_CHECK_DEMO=none skips the demo and the example training run;
#   GPU_CHECK_SOAK=SECONDS also runs benchmarks/soak.py for that long;
#   GPU_CHECK_BENCH="bench_a bench_b" only those benchmarks (default: all);
#   GPU_CHECK_PYTEST_ARGS replaces pytest's -x (e.g. "" to run every test
#   past a failure); GPU_CHECK_ARGS_<bench>="..." extra arguments for one
#   benchmark, e.g.
#   GPU_CHECK_ARGS_bench_moe="--sweep".
#   A device call is limited to 10 minutes: on a cold machine run the tests
#   and the benchmarks as separate calls (GPU_CHECK_BENCH=none, then
#   GPU_CHECK_TESTS=none GPU_CHECK_BENCH="..."), a few benchmarks per call.
#   On a one-GPU machine the suite runs at EP1 (JAX_EP_TEST_GPUS=1) and the
#   two-GPU benchmarks report "skipped" (they exit 2).
#   CUTLASS headers: the pinned nvidia-cutlass wheel, installed from .whl/
#   when the machine has no cutlass_library (the GPU machine is offline).
#
# $OUT receives summary.txt, junit.xml, logs.tar.gz (logs/ while running),
# bench.tar.gz, the
# profile's profile_normal.json and
# results/: each benchmark's run file (results/<bench>/<date>_<commit>_<n>.json,
# copied as each benchmark ends) and the test record made from junit.xml
# (results/tests/...), laid out as benchmarks/results/ is: copy results/
# into benchmarks/results/ to keep them (cp -rn: a run never replaces another).
# The device call's limit counts the machine's start and the build (~85 s
# on a cold machine): keep an outer `timeout` ~120 s under that limit, or a
# SIGKILL leaves only what was copied so far: logs/ is written in place (a
# line per test in logs/pytest_<group>.log as it ends), so even a run killed
# by the device's budget says which tests had passed. Exit status is non-zero if
# the build, the version check, any test or any benchmark failed.
set -u -o pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/jax_ep_gpu_check.XXXXXX)}
mkdir -p "$OUT"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
BENCH=$(mktemp -d /tmp/jax_ep_bench.XXXXXX)

# Never NVLink multicast (NVLS): not available / not wanted on these machines.
export NCCL_NVLS_ENABLE=0
export JAX_EP_CUDA=ON
export JAX_EP_TESTING=ON   # the virtual-rank harness and the probe the GPU tests use

status=0
build="FAIL"; build_ok=no; versions="FAIL"; tests="not run"; bench_failed=""; bench_ran=0

# Pack and summarise on every exit, also when the device call's time limit
# (timeout's TERM) cuts the run short: what ran still comes back.
finish() {
trap - EXIT TERM INT
# Pack the benchmark outputs; the run files also loose. The logs are in $OUT already.
if [ -n "$(ls -A "$BENCH")" ]; then
  tar -czf "$OUT/bench.tar.gz" -C "$BENCH" .
  keep_records
fi
if [ -s "$OUT/junit.xml" ]; then
  mkdir -p "$OUT/results"
  "$PY" scripts/junit_record.py "$OUT/junit.xml" --out "$OUT/results" --gpus "${JAX_EP_TEST_GPUS:-0}" \
      --command "$TEST_COMMAND" >/dev/null 2>&1 || echo "junit_record.py failed: no test record"
fi

{
  echo
  echo "==================== jax_ep GPU check ===================="
  printf '%-12s %s\n' "build" "$build"
  printf '%-12s %s\n' "versions" "$versions"
  printf '%-12s %s\n' "gpu tests" "$tests"
  printf '%-12s %s\n' "demo" "$demo"
  printf '%-12s %s\n' "train" "$train"
  printf '%-12s %s\n' "benchmarks" "$bench_ran run; failed:${bench_failed:- none}; skipped:${bench_skipped:- none}"
  printf '%-12s %s\n' "elapsed" "$(( $(date +%s) - ${T0:-$(date +%s)} )) s (steps: $(grep -o '+[0-9]*s\] [a-z_]*' "$LOGS/steps.log" 2>/dev/null | tr -d '[]' | tr '\n' ' '))"
  "$PY" - "$BENCH" <<'PYEOF'
import json, pathlib, sys
rows = []
for p in sorted(pathlib.Path(sys.argv[1]).rglob("*.json")):
    try:
        data = json.loads(p.read_text())
    except Exception:
        continue
    for r in data if isinstance(data, list) else [data]:
        if isinstance(r, dict) and "bench" in r:
            rows.append(r)
if rows:
    print(f"{'bench':<16}{'impl':<24}{'dtype':<8}{'time_us':>10}{'nvlink_gbps':>12}{'ratio_ce':>9}")
    for r in rows:
        def f(k, fmt):
            v = r.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        print(f"{str(r.get('bench')):<16}{str(r.get('impl')):<24}{str(r.get('dtype', '-')):<8}"
              f"{f('time_us', '10.1f'):>10}{f('nvlink_gbps', '12.1f'):>12}"
              f"{f('ratio_to_copy_engine', '9.2f'):>9}")
PYEOF
  echo "outputs in $OUT; exit status $status"
} | tee "$OUT/summary.txt"

# The device call returns only a few files (the rest are left out by count):
# on an end that reaches here the logs go back as one archive; a run killed
# outright still leaves them loose.
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
rm -rf "$BENCH"
exit $status
}
trap 'status=1; build="${build} (run cut short by a signal)"; finish' TERM INT
trap finish EXIT

# The run files of the benchmarks so far, into $OUT/results/<bench>/ (each
# named by date and commit, so nothing there is overwritten).
keep_records() {
  (cd "$BENCH" && find . -mindepth 2 -name '*.json' -exec cp -n --parents {} "$OUT/results/" \;) 2>/dev/null
  # Outputs that are not run files (profile_normal.json), loose as before.
  for j in "$BENCH"/*.json; do [ -e "$j" ] && cp "$j" "$OUT/"; done
}
mkdir -p "$OUT/results"
TEST_COMMAND="not run"

T0=$(date +%s)
# Each step with the seconds since the start: where a device call's time goes.
note() { echo "== [+$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOGS/steps.log"; }

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
export JAX_EP_TEST_GPUS=${JAX_EP_TEST_GPUS:-$(( NGPU < 2 ? 1 : 2 ))}
if ! "$PY" -c "import cutlass_library" 2>/dev/null; then
  for w in .whl/nvidia_cutlass-*.whl; do
    [ -e "$w" ] && "$PY" -m pip install -q --no-deps --no-index "$w" >>"$LOGS/build.log" 2>&1
  done
fi

# The editable build runs without isolation (the venv's jax, NCCL and CUTLASS
# headers are what it must build against), so pyproject's build requirements
# must be in this venv; the README's install (with isolation) leaves
# scikit-build-core and nanobind out. Install what is missing (from .whl/
# first: the GPU machine is offline); where that fails, an installed CUDA
# build of jax_ep is used as it is.
missing_build_requirements() {
  "$PY" - <<'PYEOF'
import importlib.metadata as md, re
text = open("pyproject.toml").read()
reqs = re.search(r"\[build-system\][^\[]*?requires\s*=\s*\[(.*?)\]", text, re.S).group(1)
for req in re.findall(r'"([^"]+)"', reqs):
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(req)
PYEOF
}
mapfile -t need < <(missing_build_requirements)
if [ "${#need[@]}" -gt 0 ]; then
  note "installing the build requirements this venv lacks: ${need[*]}"
  "$PY" -m pip install -q --no-index --find-links .whl "${need[@]}" >>"$LOGS/build.log" 2>&1 ||
    "$PY" -m pip install -q "${need[@]}" >>"$LOGS/build.log" 2>&1 || true
  mapfile -t need < <(missing_build_requirements)
fi

note "build (JAX_EP_CUDA=ON JAX_EP_TESTING=ON)"
if [ "${#need[@]}" -gt 0 ]; then
  if "$PY" -c "import sys, jax_ep; sys.exit(0 if jax_ep._native.cuda_built() else 1)" 2>/dev/null; then
    build="ok (not rebuilt: ${need[*]} missing and not installable; using the installed CUDA build)"
  else
    status=1
    build="FAIL (${need[*]} missing: $PY -m pip install ${need[*]})"
  fi
elif "$PY" -m pip install --no-build-isolation --no-deps -e . >>"$LOGS/build.log" 2>&1; then
  build="ok"
else
  status=1; tail -40 "$LOGS/build.log"
fi
case "$build" in ok*) build_ok=ok ;; *) build_ok=no ;; esac

note "topology"
{ nvidia-smi topo -m; echo; nvidia-smi; } >"$LOGS/topology.txt" 2>&1 || true
cat "$LOGS/topology.txt" | head -20

note "versions"
if "$PY" - >"$LOGS/versions.txt" 2>&1 <<'PYEOF'
import jax, jaxlib
import jax_ep
from jax_ep import _native
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("devices", jax.devices())
print("cuda_built", _native.cuda_built(), "cuda_available", _native.cuda_available(),
      "testing_built", _native.testing_built())
compiled, runtime = _native.nccl_version()
print("nccl compiled", compiled, "runtime", runtime)
assert _native.cuda_available(), "CUDA path not available"
assert compiled == runtime, "NCCL headers and runtime differ"
assert _native.testing_built(), "built without the test harness (JAX_EP_TESTING=ON)"
PYEOF
then
  versions="ok"
else
  status=1
fi
cat "$LOGS/versions.txt"

note "GPU tests"
if [ "${GPU_CHECK_TESTS:-}" = none ]; then
  tests="not run (GPU_CHECK_TESTS=none)"
elif [ "$build_ok" = ok ]; then
  TEST_COMMAND="JAX_EP_TEST_GPUS=$JAX_EP_TEST_GPUS python -m pytest -m gpu ${GPU_CHECK_PYTEST_ARGS--x} ${GPU_CHECK_TESTS:-}"
  # Groups split by "|" run as parallel pytest processes on the same GPUs
  # (the suite is mostly XLA compilation on the host's cores); their junit
  # files are merged into one.
  IFS='|' read -r -a groups <<<"${GPU_CHECK_TESTS:-}"
  [ "${#groups[@]}" -gt 0 ] || groups=("")
  pids=()
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -m gpu ${GPU_CHECK_PYTEST_ARGS--x} -v ${groups[$i]} \
        --junitxml="$LOGS/junit_$i.xml" >"$LOGS/pytest_$i.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  "$PY" - "$OUT/junit.xml" "$LOGS"/junit_*.xml <<'PYEOF'
import sys, xml.etree.ElementTree as ET
merged = ET.Element("testsuites")
for f in sys.argv[2:]:
    try:
        root = ET.parse(f).getroot()
    except Exception:
        continue
    merged.extend([root] if root.tag == "testsuite" else list(root))
ET.ElementTree(merged).write(sys.argv[1])
PYEOF
  for i in "${!groups[@]}"; do tail -12 "$LOGS/pytest_$i.log"; done
  tests=$(NGPU=$NGPU "$PY" - "$OUT/junit.xml" <<'PYEOF'
import os, re, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print(f"no junit ({e.__class__.__name__})"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
# A skip is expected only when the machine lacks what the test needs (more
# GPUs, or it has the GIN a test expects to be refused); anything else (a
# broken build, say) fails the check.
ngpu = int(os.environ.get("NGPU", "0"))
unexpected = []
for case in root.iter("testcase"):
    for sk in case.findall("skipped"):
        why = sk.get("message", "")
        if sk.get("type") == "pytest.xfail":  # an expected failure, not a skip
            continue
        m = re.search(r"needs (\d+) (?:GPUs|devices)", why)
        if (m and int(m.group(1)) > ngpu) or "has GIN" in why or "written for EP1 and EP2" in why:
            continue
        unexpected.append(f"{case.get('name')}: {why}")
print(f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"
      + (f" ({len(unexpected)} UNEXPECTED skips: {'; '.join(unexpected[:3])})" if unexpected else ""))
PYEOF
)
  # A broken build or too few GPUs makes the GPU tests skip, not fail.
  case "$tests" in
    "0 passed"*) status=1; tests="$tests (nothing ran: every GPU test skipped)";;
    *UNEXPECTED*) status=1;;
  esac
fi

note "demo on the GPUs"
demo="not run"
if [ "$build_ok" = ok ] && [ "${GPU_CHECK_DEMO:-}" != none ]; then
  if timeout 300 "$PY" -m jax_ep.demo --steps 5 >"$LOGS/demo.log" 2>&1; then
    demo="ok: $(tail -1 "$LOGS/demo.log")"
  else
    demo="FAIL"; status=1; tail -20 "$LOGS/demo.log"
  fi
fi

note "main job (python -m jax_ep.train, kernels against the reference)"
train="not run"
if [ "$build_ok" = ok ] && [ "${GPU_CHECK_DEMO:-}" != none ]; then
  if timeout 300 "$PY" -m jax_ep.train --steps 10 --compare-backends --no-plot \
      >"$LOGS/train.log" 2>&1; then
    train="ok: $(tail -1 "$LOGS/train.log")"
  else
    train="FAIL"; status=1; tail -20 "$LOGS/train.log"
  fi
fi

note "benchmarks"
bench_skipped=""
for b in benchmarks/bench_*.py; do
  [ -e "$b" ] || continue
  name=$(basename "$b" .py)
  if [ -n "${GPU_CHECK_BENCH:-}" ] && [[ " $GPU_CHECK_BENCH " != *" $name "* ]]; then continue; fi
  bench_ran=$((bench_ran + 1))
  extra_var="GPU_CHECK_ARGS_$name"
  read -r -a extra <<<"${!extra_var:-}"
  echo "-- [+$(( $(date +%s) - T0 ))s] $name ${extra[*]}" | tee -a "$LOGS/steps.log"
  # Live on stdout too, and each run file into $OUT as soon as it exists: a
  # run killed at the device call's limit (SIGKILL: no trap, no packing)
  # still returns what finished (one such run, at 3bcfd29 on 2026-12-02,
  # lost bench_engram's figures).
  timeout 900 "$PY" "$b" --out "$BENCH" "${extra[@]}" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  keep_records
  if [ $rc -eq 2 ]; then
    bench_skipped="$bench_skipped $name"; tail -2 "$LOGS/$name.log"
  elif [ $rc -ne 0 ]; then
    status=1; bench_failed="$bench_failed $name"; tail -15 "$LOGS/$name.log"
  fi
  grep -E "^  (up|down) " "$LOGS/$name.log" || true
done

if [ "$build_ok" = ok ] && [ -n "${GPU_CHECK_SOAK:-}" ]; then
  note "soak (${GPU_CHECK_SOAK} s of dispatch + combine pairs)"
  bench_ran=$((bench_ran + 1))
  timeout $(( GPU_CHECK_SOAK + 300 )) "$PY" benchmarks/soak.py --out "$BENCH" \
      --max-seconds "$GPU_CHECK_SOAK" >"$LOGS/soak.log" 2>&1 \
    || { status=1; bench_failed="$bench_failed soak"; }
  tail -2 "$LOGS/soak.log"
fi

note "profile (per-kernel GPU times of dispatch / combine)"
if [ "$build_ok" = ok ] && [ "$NGPU" -ge 2 ] && [ -z "${GPU_CHECK_BENCH:-}" ]; then
  timeout 300 "$PY" benchmarks/profile_normal.py --out "$BENCH" >"$LOGS/profile_normal.log" 2>&1 \
    || { status=1; bench_failed="$bench_failed profile_normal"; }
  grep -E "calls|Kernel " "$LOGS/profile_normal.log" | grep -v "host:CPU" | head -24
fi

