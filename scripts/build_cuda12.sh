#!/usr/bin/env bash
# Builds jax_ep's CUDA module with CUDA 12 on a machine that has no CUDA 12
# installed (and needs no GPU): the release wheel, sm_90a, against the
# nvidia-nccl-cu12 headers, and checks that build_info() says so. Fails
# loudly if the CUDA parts are not built. Nothing outside WORK is changed.
#
#   scripts/build_cuda12.sh            # WORK is a fresh temp dir, removed at the end
#   JAX_EP_CU12_WORK=/tmp/cu12 JAX_EP_CU12_KEEP=1 scripts/build_cuda12.sh
#
# Where nvcc 12 comes from: PyPI's nvidia-cuda-nvcc-cu12 wheels (every 12.x
# up to 12.9.86) ship ptxas, libnvvm and the crt headers but not the nvcc
# driver, cicc, cudafe++, fatbinary or nvlink, so they cannot compile .cu
# files. Debian's non-free nvidia-cuda-toolkit (trixie: CUDA 12.4.1) ships
# NVIDIA's binaries; its .debs are fetched with apt-get download into WORK
# (a private apt list, the system's sources untouched) and unpacked there,
# not installed. The headers and cudart_static of the same 12.4 release come
# from the pip wheels, and the pieces are laid out as a CUDA toolkit root.
# On a machine with CUDA 12 installed, set CUDA12_HOME to its root instead.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

NCCL_CU12=${JAX_EP_NCCL_CU12:-2.28.9}    # the pin of the cuda12 extra
CUDA12_DEB=12.4.131~12.4.1              # Debian trixie's nvidia-cuda-toolkit (any revision)
CUDA12_WHEELS=(nvidia-cuda-runtime-cu12==12.4.127 nvidia-cuda-cccl-cu12==12.4.127.post1
               nvidia-cuda-nvcc-cu12==12.4.131)
# The cu12 runtime wheels before 12.8 carry libcudart.so.12 only; the static
# runtime that the module links comes from this one (a newer 12.x runtime
# runs code compiled by an older 12.x nvcc).
CUDART_STATIC_WHEEL=nvidia-cuda-runtime-cu12==12.9.79

WORK=${JAX_EP_CU12_WORK:-$(mktemp -d /tmp/jax_ep_cu12.XXXXXX)}
mkdir -p "$WORK"
if [ -z "${JAX_EP_CU12_KEEP:-}" ] && [ -z "${JAX_EP_CU12_WORK:-}" ]; then
  trap 'rm -rf "$WORK"' EXIT
fi
t0=$(date +%s)
say() { echo "cuda12: $* ($(( $(date +%s) - t0 )) s)"; }
# A download that fails is not a CUDA 12 compile error: with
# JAX_EP_CU12_FETCH_SOFT=1 (CI) the script then says so and stops without
# failing; a compile error always fails.
fetch_failed() {
  echo "cuda12: could not fetch $1: the CUDA 12 build was NOT checked" >&2
  if [ -n "${JAX_EP_CU12_FETCH_SOFT:-}" ]; then exit 0; fi
  exit 1
}

# A venv for the tools: the CUDA 12 headers and runtime, and, to load the
# built module, the cu12 NCCL runtime it links.
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q --upgrade pip || fetch_failed pip
"$PY" -m pip install -q "${CUDA12_WHEELS[@]}" "nvidia-nccl-cu12==$NCCL_CU12" ||
  fetch_failed "the CUDA 12 header wheels"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
say "pip wheels in $WORK/venv"

if [ -n "${CUDA12_HOME:-}" ]; then
  CUDA_ROOT=$CUDA12_HOME
else
  APT="$WORK/apt"
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs" "$APT/x"
  echo "deb http://deb.debian.org/debian trixie non-free" >"$APT/sources.list"
  aopt=(-o "Dir::Etc::sourcelist=$APT/sources.list" -o "Dir::Etc::sourceparts=/nonexistent"
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache"
        -o "APT::Sandbox::User=root" -q)
  apt-get "${aopt[@]}" update >/dev/null || fetch_failed "Debian's package lists"
  (cd "$APT/debs" && apt-get "${aopt[@]}" download nvidia-cuda-toolkit libnvvm4 >/dev/null) ||
    fetch_failed "Debian's nvidia-cuda-toolkit"
  for d in "$APT"/debs/*.deb; do
    v=$(dpkg-deb -f "$d" Version)
    case "$v" in "$CUDA12_DEB"-*) ;;
      *) echo "cuda12: $(basename "$d") is $v, not $CUDA12_DEB (the 12.4 wheels above would not match)" >&2; exit 1;;
    esac
  done
  for d in "$APT"/debs/*.deb; do dpkg-deb -x "$d" "$APT/x"; done
  X="$APT/x/usr"
  CUDA_ROOT="$WORK/cuda-12"
  mkdir -p "$CUDA_ROOT/bin/crt" "$CUDA_ROOT/nvvm/bin" "$CUDA_ROOT/nvvm/lib64" \
           "$CUDA_ROOT/nvvm/libdevice" "$CUDA_ROOT/include" "$CUDA_ROOT/lib64"
  cp "$X/lib/nvidia-cuda-toolkit/bin/nvcc" "$X/lib/nvidia-cuda-toolkit/bin/crt/"*.stub \
     "$CUDA_ROOT/bin/" && mv "$CUDA_ROOT"/bin/*.stub "$CUDA_ROOT/bin/crt/"
  for b in cudafe++ fatbinary nvlink bin2c ptxas nvprune cuobjdump nvdisasm; do
    cp "$X/bin/$b" "$CUDA_ROOT/bin/"
  done
  cp "$X/lib/nvidia-cuda-toolkit/bin/cicc" "$CUDA_ROOT/nvvm/bin/"
  cp "$X/lib/nvidia-cuda-toolkit/libdevice/libdevice.10.bc" "$CUDA_ROOT/nvvm/libdevice/"
  cp -P "$X"/lib/x86_64-linux-gnu/libnvvm.so* "$CUDA_ROOT/nvvm/lib64/"
  # Debian's profile points at /usr; this is NVIDIA's own, relative to bin/.
  cat >"$CUDA_ROOT/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/$(_NVVM_BRANCH_)/libdevice
LD_LIBRARY_PATH += $(TOP)/lib:
PATH            += $(TOP)/$(_NVVM_BRANCH_)/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF
  # Headers: cudart, the crt headers that belong to nvcc, CCCL (cub, thrust,
  # libcu++), all of the 12.4 release.
  for w in cuda_runtime cuda_nvcc cuda_cccl; do
    cp -r "$SITE/nvidia/$w/include/." "$CUDA_ROOT/include/"
  done
  rm -f "$CUDA_ROOT/include/__init__.py"
  "$PY" -m pip download -q --no-deps -d "$WORK/cudart" "$CUDART_STATIC_WHEEL" ||
    fetch_failed "the CUDA 12 static runtime wheel"
  (cd "$WORK/cudart" && "$PY" -m zipfile -e ./*.whl x)
  cp "$WORK"/cudart/x/nvidia/cuda_runtime/lib/libcudart_static.a "$CUDA_ROOT/lib64/"
  # nvcc names libcudadevrt.a in every device link, and nvlink refuses the
  # 12.9 one (device code newer than the 12.4 toolkit). Nothing here is
  # compiled with -rdc, so no device-runtime symbol is ever taken from it:
  # an empty archive stands in.
  rm -f "$CUDA_ROOT/lib64/libcudadevrt.a" && ar rcs "$CUDA_ROOT/lib64/libcudadevrt.a"
  cp -P "$SITE"/nvidia/cuda_runtime/lib/libcudart.so* "$CUDA_ROOT/lib64/"
  ln -sf libcudart.so.12 "$CUDA_ROOT/lib64/libcudart.so"
fi
NVCC="$CUDA_ROOT/bin/nvcc"
"$NVCC" --version | tail -2
case "$("$NVCC" --version)" in *"release 12."*) ;; *) echo "cuda12: $NVCC is not CUDA 12" >&2; exit 1;; esac
say "CUDA 12 toolkit at $CUDA_ROOT"

# The release wheel as a user builds it for CUDA 12 (README): pip's isolated
# build, where JAX_EP_CUDA_MAJOR=12 makes pyproject.toml bring the cu12 NCCL
# headers instead of the cu13 ones. The harness stays out (JAX_EP_TESTING=OFF).
# One compile job at a time unless told otherwise: each CUTLASS unit is
# minutes of one core and a few GB of memory.
start=$(date +%s)
env -u CUDA_HOME -u CUDA_PATH \
  PATH="$WORK/venv/bin:/usr/bin:/bin" \
  JAX_EP_CUDA=ON JAX_EP_CUDA_MAJOR=12 JAX_EP_TESTING=OFF CUDACXX="$NVCC" \
  CMAKE_ARGS="-DCUDAToolkit_ROOT=$CUDA_ROOT" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}" \
  "$PY" -m pip wheel --no-deps -w "$WORK/wheels" \
    --config-settings=build-dir="$WORK/build" "$REPO" >"$WORK/wheel.log" 2>&1 \
  || { tail -60 "$WORK/wheel.log"; echo "cuda12: the CUDA 12 build FAILED (log: $WORK/wheel.log)" >&2; exit 1; }
grep -E "jax_ep: (building CUDA|CUTLASS)|Overrides" "$WORK/wheel.log" || true
WHEEL=$(ls "$WORK"/wheels/jax_ep-*.whl)
say "wheel built in $(( $(date +%s) - start )) s: $(basename "$WHEEL")"

# The wheel installs with no compiler on PATH; its module says what it is.
(PATH="$WORK/venv/bin:/usr/bin:/bin"; "$PY" -m pip install -q --no-deps "$WHEEL")
cd "$WORK"
JAX_PLATFORMS=cpu "$PY" - "$NCCL_CU12" <<'PYEOF'
import glob, importlib.util, os, sys, sysconfig
# The extension alone (the package's __init__ wants jax, not installed here).
so, = glob.glob(os.path.join(sysconfig.get_paths()["platlib"], "jax_ep", "_jax_ep*.so"))
spec = importlib.util.spec_from_file_location("_jax_ep", so)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
info = dict(m.build_info)
print("cuda12: build_info:", info)
assert info["cuda_built"], f"the CUDA parts were not built: {info.get('why_not_cuda')}"
assert info["cuda_toolkit"].startswith("12."), info["cuda_toolkit"]
assert info["cuda_archs"] == "90a", info["cuda_archs"]
assert info["nccl_headers"] == sys.argv[1], info["nccl_headers"]
assert info["nccl_wheel"] == "nvidia-nccl-cu12", info["nccl_wheel"]
assert info["cutlass_headers"].startswith("4.2"), info["cutlass_headers"]
assert not info["testing_built"]
PYEOF

# The test harness is not in the release wheel: its translation units, and
# the bindings with it switched on, compiled alone with the same nvcc 12
# (as .ci/run does for CUDA 13). jaxlib only for its XLA FFI headers.
"$PY" -m pip install -q --no-deps "jaxlib>=0.10,<0.13" "nanobind>=2.0"
inc=(-I"$REPO/ffi" "-I$("$PY" -c 'import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))')"
     "-I$SITE/nvidia/nccl/include"
     "-I$("$PY" -c 'import nanobind; print(nanobind.include_dir())')"
     "-I$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')")
for src in "$REPO"/ffi/testing/*.cc "$REPO"/ffi/testing/*.cu "$REPO/ffi/handlers/bindings.cc"; do
  "$NVCC" -x cu -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
    -DJAX_EP_WITH_CUDA=1 -DJAX_EP_TESTING=1 "${inc[@]}" -c "$src" -o "$WORK/harness.o" \
    || { echo "cuda12: $src does not compile with CUDA 12 (JAX_EP_TESTING=1)" >&2; exit 1; }
done
say "the test harness compiles with CUDA 12"

if [ -n "${JAX_EP_CU12_KEEP:-}" ]; then
  mkdir -p "$REPO/build" && cp "$WHEEL" "$REPO/build/"
  echo "cuda12: wheel kept at $REPO/build/$(basename "$WHEEL")"
fi
say "OK: the CUDA 12 build"
