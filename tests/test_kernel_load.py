"""Every kernel of the communicating ops is in its file's Load*Kernels list
(ffi/kernels/kernel_load.h): one left out would be loaded lazily at its first
launch, which can wait behind a kernel spinning on a peer (docs/design.md §8).
A source check, so it runs without a GPU: every kernel name, and every
template instance the file's launchers write out (`Kernel<...>`), must be
in the list."""
from __future__ import annotations

import pathlib
import re

import pytest

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "ffi" / "kernels"
FILES = {"layout.cu": "LoadLayoutKernels", "dispatch_setup.cu": "LoadDispatchSetupKernels",
         "dispatch.cu": "LoadDispatchKernels",
         "combine.cu": "LoadCombineKernels", "low_latency.cu": "LoadLowLatencyKernels",
         "engram.cu": "LoadEngramKernels", "engram_gin.cu": "LoadEngramGinKernels",
         "abort.cu": "LoadAbortKernels"}


def _kernel_names(src: str) -> set[str]:
  """Names of the __global__ functions (launch bounds and line breaks allowed)."""
  names = set()
  for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", src):
    names.add(m.group(1))
  return names


def _loader_text(src: str, loader: str) -> str:
  """The loader's body plus the bodies of the helpers it calls in the same file."""
  body = re.search(loader + r"\(\)\s*\{(.*?)\n\}", src, re.S)
  assert body, f"{loader} not defined"
  text = body.group(1)
  for helper in set(re.findall(r"(Load\w+Kernels)<", text)):
    text += "".join(m.group(1) for m in re.finditer(helper + r"\(\)\s*\{(.*?)\n\}", src, re.S))
  return text


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_kernel_of_a_communicating_file_is_loaded_at_set_up(name):
  src = (KERNELS / name).read_text()
  kernels = _kernel_names(src)
  assert kernels, f"no __global__ found in {name}: the pattern is stale"
  text = _loader_text(src, FILES[name])
  missing = sorted(k for k in kernels if not re.search(r"\b" + k + r"\b", text))
  assert not missing, f"{name}: {missing} not in {FILES[name]}"
  instances = lambda t: {" ".join(m.group(0).split())  # noqa: E731
                         for m in re.finditer(r"\b(?:" + "|".join(kernels) + r")<[^<>;{}]*>", t)}
  loaded = instances(text)
  unlisted = sorted(instances(src) - loaded)
  assert not unlisted, f"{name}: {unlisted} launched but not in {FILES[name]}"


def test_comm_loads_every_list():
  header = (KERNELS / "kernel_load.h").read_text()
  body = re.search(r"LoadCommKernels\(\)\s*\{(.*?)\n\}", header, re.S).group(1)
  assert sorted(re.findall(r"Load\w+Kernels", body)) == sorted(FILES.values())
  comm = (KERNELS.parent / "runtime" / "comm.cc").read_text()
  loopback = (KERNELS.parent / "testing" / "loopback.cc").read_text()
  assert "LoadCommKernels()" in comm and "LoadCommKernels()" in loopback
