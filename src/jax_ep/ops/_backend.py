"""Choosing between the reference (pure JAX) and the CUDA kernels.

backend=None ("auto"): the CUDA kernels when jax_ep was built with CUDA and a
Communicator exists for the axis, on the CUDA platform only (through
`lax.platform_dependent`, so one program also lowers for CPU/TPU); the
reference otherwise. "reference" and "cuda" force one.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
from jax import lax

BACKENDS = (None, "auto", "reference", "cuda")


def check_backend(backend: Optional[str]) -> None:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def cuda_comm(axis_name: str):
  """The Communicator the kernels would use for this axis, or None."""
  from jax_ep import _native, comm  # both import without the native module
  if not _native.cuda_built():
    return None
  return comm.current(axis_name)


def run(backend: Optional[str], axis_name: str, reference: Callable,
        cuda: Optional[Callable[[object], Callable]], *args):
  """Runs `reference(*args)` or `cuda(comm)(*args)` as the backend says."""
  check_backend(backend)
  if backend == "reference" or cuda is None:
    if backend == "cuda":
      raise ValueError("backend='cuda': this op has no CUDA kernel yet")
    return reference(*args)
  c = cuda_comm(axis_name)
  if backend == "cuda":
    if c is None:
      raise ValueError(f"backend='cuda' needs jax_ep built with CUDA and a Communicator for axis "
                       f"{axis_name!r} (jax_ep.Communicator.create(mesh, {axis_name!r}))")
    return vary(cuda(c)(*args), axis_name)
  if c is None:
    return reference(*args)
  # Both branches get one type under check_vma: a reference branch may
  # return values that do not vary over the axis (a constant token).
  return lax.platform_dependent(*args, default=lambda *a: vary(reference(*a), axis_name),
                                cuda=lambda *a: vary(cuda(c)(*a), axis_name))


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  m = getattr(aval, "manual_axis_type", None)
  if m is not None:
    return m.varying
  return getattr(aval, "vma", frozenset())


def vary(tree, axis_name: str):
  """Marks custom-call outputs as varying over the EP axis, as the reference's
  collective outputs are, so both backends have one type under shard_map's
  check_vma (a no-op when it is off)."""
  def f(x):
    if axis_name in _varying_axes(x):
      return x
    if hasattr(lax, "pcast"):
      return lax.pcast(x, axis_name, to="varying")
    return lax.pvary(x, (axis_name,))
  return jax.tree.map(f, tree)
