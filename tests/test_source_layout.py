"""The source tree keeps its cut by concern (docs/design.md §1, §7): no file
of the package or of the native code grows past 800 lines, and device code
depends on nothing host-side (no handler, no communicator registry). Source
checks, so they run without a GPU."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FFI = ROOT / "ffi"
MAX_LINES = 800


def _sources() -> list[pathlib.Path]:
  files = [p for p in FFI.rglob("*") if p.suffix in {".cc", ".cu", ".cuh", ".h"}]
  files += list((ROOT / "src" / "jax_ep").rglob("*.py"))
  return sorted(files)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_file_is_over_800_lines(path):
  n = len(path.read_text().splitlines())
  assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines: split it by concern"


def test_kernels_include_no_host_side_header():
  """ffi/kernels/ sits below the handlers and the runtime: what a kernel file
  needs of them belongs in a kernel-side header."""
  bad = []
  for path in sorted((FFI / "kernels").iterdir()):
    for m in re.finditer(r'#include\s+"([^"]+)"', path.read_text()):
      if m.group(1).startswith(("handlers/", "runtime/", "testing/")):
        bad.append(f"{path.name}: {m.group(1)}")
  for path in sorted((FFI / "testing").glob("*.cu")):
    for m in re.finditer(r'#include\s+"([^"]+)"', path.read_text()):
      if m.group(1).startswith(("handlers/", "runtime/")):
        bad.append(f"testing/{path.name}: {m.group(1)}")
  assert not bad, bad


def test_the_native_code_reads_no_environment_variable():
  """Tuning is configuration (FFI attributes, Communicator.create arguments),
  debugging switches are build options (docs/design.md §7)."""
  hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in _sources() if p.suffix != ".py"
          for i, line in enumerate(p.read_text().splitlines())
          if re.search(r"\b(std::)?(getenv|secure_getenv)\s*\(", line)]
  assert not hits, hits


# The peer interface (ffi/kernels/peer.cuh lists its verbs) and the files it
# is built from; only they touch EpPeers' window table and GIN mask.
PEER_INTERFACE = {"common.cuh", "peer.cuh", "transport.cuh", "gin.cuh", "gin_stage.cuh"}


def test_kernels_reach_peers_only_through_the_peer_interface():
  """No `p.base[j]` window arithmetic and no gin_mask branch in an op's own
  device code (docs/design.md §7): a new transport then changes the
  interface, not every kernel."""
  files = [p for p in (FFI / "kernels").iterdir() if p.suffix in {".cu", ".cuh", ".h"}]
  files += list((FFI / "testing").glob("*.cu")) + list((FFI / "testing").glob("*.cuh"))
  # The GIN primitives (puts, waits, signal reads, flushes) are called only
  # by the interface and the rank barrier built on it; an op uses the verbs.
  gin_calls = r"\bGin(Put|Wait|Flush|ReadSignal)\w*\s*\("
  bad = []
  for path in sorted(files):
    interface = path.parent.name == "kernels" and path.name in PEER_INTERFACE
    barrier = path.parent.name == "kernels" and path.name == "barrier.cuh"
    for i, line in enumerate(path.read_text().splitlines()):
      code = line.split("//")[0]
      if ((not interface and re.search(r"\.base\s*\[|\bgin_mask\b", code))
          or (not (interface or barrier) and re.search(gin_calls, code))):
        bad.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
  assert not bad, "\n".join(bad)
