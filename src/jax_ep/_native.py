"""The compiled extension, imported lazily, and the one-time registration of
its FFI targets and state type with JAX (platform "CUDA").

Everything here is safe to call on a machine without GPUs or without the
CUDA build: `cuda_built()` / `cuda_available()` just say False.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

_lock = threading.Lock()
_registered = False

# The first bytes of every rank's window belong to the runtime (barrier
# flags): the one Python copy of ffi/kernels/common.cuh kWindowHeaderBytes,
# tested against the built module's `window_header_bytes`.
WINDOW_HEADER_BYTES = 4096
# Ranks per EP group the kernels' per-peer arrays hold (common.cuh kMaxRanks)
# and chunk counters per source rank (window_layout.h kChunksPerSource): the
# one Python copies, tested against the module's `max_ranks` /
# `chunks_per_source` (tests/test_window_bytes.py). Written here, not read
# from the module, so the package imports and sizes windows without it.
MAX_RANKS = 8
CHUNKS_PER_SOURCE = 4096

# The FFI targets of a CUDA build (the module's `registrations()`), and those
# only a build with the test harness adds (JAX_EP_TESTING=ON, CMakeLists.txt);
# tests/test_window_bytes.py compares them with the module.
TARGETS = ("jax_ep_dispatch_layout", "jax_ep_dispatch", "jax_ep_combine", "jax_ep_side_done",
           "jax_ep_engram_publish", "jax_ep_engram_fetch", "jax_ep_engram_publish_fetch",
           "jax_ep_engram_grad", "jax_ep_grouped_gemm", "jax_ep_grouped_gemm_fp8",
           "jax_ep_fp8_cast_weights", "jax_ep_fp8_cast_tokens",
           "jax_ep_ll_dispatch", "jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv",
           "jax_ep_ll_combine", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")
TESTING_TARGETS = ("jax_ep_probe_all_to_all",)


COMMAND_BUFFER_TARGETS = frozenset({
    "jax_ep_ll_dispatch", "jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv",
    "jax_ep_ll_combine", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv",
    "jax_ep_engram_publish", "jax_ep_engram_fetch", "jax_ep_engram_publish_fetch",
    "jax_ep_engram_grad"})


def _traits(target: str) -> dict:
  """The low-latency and Engram kernels launch the same work on every call
  (what changes between calls is on the device: docs/low_latency.md,
  docs/design.md §2), so XLA may capture them into command buffers (CUDA
  graphs). Whether this jaxlib's XLA then captures them is not yet shown
  (benchmarks/RESULTS.md, 2026-12-01). {} where this jaxlib has no such
  trait."""
  if target not in COMMAND_BUFFER_TARGETS:
    return {}
  try:
    from jax._src.lib import xla_client
    return {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
  except (ImportError, AttributeError):
    return {}


@functools.lru_cache(maxsize=None)
def _module() -> Any | None:
  try:
    from jax_ep import _jax_ep
  except ImportError:
    return None
  return _jax_ep


def module() -> Any:
  """The extension module; raises ImportError with a hint when it is absent."""
  m = _module()
  if m is None:
    raise ImportError("jax_ep._jax_ep is not built (pip install -e . with a C++ toolchain)")
  return m


def cuda_built() -> bool:
  """jax_ep was compiled with its CUDA kernels (nvcc and NCCL were found)."""
  m = _module()
  return bool(m is not None and getattr(m, "cuda_built", False))


def testing_built() -> bool:
  """The module holds the test harness (virtual ranks, the probe, device
  timers): a CUDA build with JAX_EP_TESTING=ON, as CI and
  scripts/gpu_check.sh make; a plain pip install has none."""
  m = _module()
  return bool(cuda_built() and getattr(m, "testing_built", False))


def build_info() -> dict:
  """What this installation of jax_ep was built with: `cuda_built`, and if not
  `why_not_cuda`; the CUDA toolkit, architectures, NCCL and CUTLASS headers
  and the jaxlib it was compiled against. Without the native module at all,
  says that."""
  m = _module()
  if m is None:
    return {"cuda_built": False, "why_not_cuda": "the native module jax_ep._jax_ep is missing "
            "(install with pip so that it is compiled)"}
  info = dict(getattr(m, "build_info", {"cuda_built": cuda_built()}))
  if info.get("cuda_built"):
    info.pop("why_not_cuda", None)
  return info


_warned_cpu_build = False


def cuda_available() -> bool:
  """True when jax_ep was built with CUDA and JAX sees at least one CUDA GPU.

  On a machine with GPUs but a build without the kernels, warns once and says
  why (see build_info())."""
  import jax
  try:
    has_gpu = len(jax.devices("cuda")) > 0
  except RuntimeError:
    has_gpu = False
  if has_gpu and not cuda_built():
    global _warned_cpu_build
    if not _warned_cpu_build:
      _warned_cpu_build = True
      import warnings
      warnings.warn("jax_ep was built without its CUDA kernels: "
                    f"{build_info().get('why_not_cuda', 'unknown')}; the ops run the pure-JAX "
                    "reference. Rebuild with JAX_EP_CUDA=ON (README).", stacklevel=2)
    return False
  return has_gpu


def ensure_registered() -> None:
  """Registers the FFI state type and targets with JAX once per process.

  Lowering (and `jax.export`) does not need this; compiling for CUDA does.
  """
  global _registered
  if _registered:
    return
  with _lock:
    if _registered:
      return
    m = module()
    if not cuda_built():
      raise RuntimeError("jax_ep was built without CUDA: the native ops are unavailable")
    import jax
    name, type_registration = m.state_type()
    jax.ffi.register_ffi_type(name, type_registration, platform="CUDA")
    for target, bundle in m.registrations().items():
      jax.ffi.register_ffi_target(target, bundle, platform="CUDA", api_version=1,
                                  **_traits(target))
    _registered = True


def nccl_version() -> tuple[int, int]:
  """(NCCL_VERSION_CODE jax_ep was compiled against, version of the loaded libnccl)."""
  return tuple(module().nccl_version())


def shadow_message(package_dir: str, native_origin: str | None,
                   installed_native: str | None) -> str | None:
  """The warning for a jax_ep imported from `package_dir` (whose native
  module, if any, is `native_origin`) while an installed distribution's
  native module lies at `installed_native` elsewhere: a source tree ahead of
  the install on sys.path. None when nothing is shadowed."""
  import os
  if installed_native is None:
    return None
  if native_origin is not None and os.path.exists(native_origin) and \
      os.path.samefile(native_origin, installed_native):
    return None  # an installed or editable build: the module in use is the installed one
  installed_dir = os.path.dirname(os.path.abspath(installed_native))
  if native_origin is None and os.path.realpath(installed_dir) == os.path.realpath(package_dir):
    return None
  here = ("which has no native module" if native_origin is None else
          f"whose native module {native_origin} is not the installed one")
  return (f"jax_ep is imported from {package_dir}, {here}, while the installed jax_ep in "
          f"{installed_dir} has its own ({os.path.basename(installed_native)}): a source tree "
          "on sys.path (the current directory, PYTHONPATH) shadows the installed build, so "
          "what runs is not what was installed (without a native module: the pure-JAX "
          "reference, even where the CUDA kernels are built). Run from another directory or "
          "take that path off sys.path.")


def installed_native_path() -> str | None:
  """Where the installed jax_ep distribution's native module lies, from its
  record of files (no import), or None."""
  import importlib.metadata as md
  import os
  try:
    dist = md.distribution("jax_ep")
  except md.PackageNotFoundError:
    return None
  for f in dist.files or ():
    if f.parent.name == "jax_ep" and f.name.startswith("_jax_ep.") and f.suffix in (".so", ".pyd"):
      path = str(dist.locate_file(f))
      if os.path.exists(path):
        return path
  return None


def warn_if_shadowed(package_dir: str) -> None:
  """Called once at import. An installed package with its native module
  costs one module lookup (no load); a source tree also the lookup of the
  installed distribution's record."""
  import importlib.util
  import os
  try:
    spec = importlib.util.find_spec("jax_ep._jax_ep")
  except (ImportError, ValueError):
    spec = None
  origin = getattr(spec, "origin", None)
  parts = os.path.normpath(package_dir).split(os.sep)
  if origin is not None and ("site-packages" in parts or "dist-packages" in parts):
    return
  msg = shadow_message(package_dir, origin, installed_native_path())
  if msg:
    import warnings
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
