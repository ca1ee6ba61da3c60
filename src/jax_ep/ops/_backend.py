"""The one choice between the reference (pure JAX) and the CUDA kernels, for
every op.

`choose` decides; `run` carries the decision out. backend=None ("auto"):
the kernels on the CUDA platform (through `lax.platform_dependent`, so one
program also lowers for CPU/TPU) where they can run — jax_ep built with
CUDA, a Communicator for the axis (ops that talk to peers), and whatever the
op says of this call (an input the kernels do not take, a window too small,
a peer they cannot reach) — the reference otherwise. "reference" forces the
reference; "cuda" forces the kernels, and raises ValueError where auto
would fall back.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
from jax import lax

BACKENDS = (None, "auto", "reference", "cuda")


def check_backend(backend: Optional[str]) -> None:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def cuda_built() -> bool:
  """Whether jax_ep holds its CUDA kernels (the stateless ops' condition)."""
  from jax_ep import _native
  return _native.cuda_built()


def cuda_comm(axis_name: str):
  """The Communicator the kernels would use for this axis, or None."""
  from jax_ep import comm  # imports without the native module
  if not cuda_built():
    return None
  return comm.current(axis_name)


def has_gin_peer(comm) -> bool:
  """Whether a local rank of `comm` (a Communicator, or None) reaches a peer
  by GIN: the kernels then need their GIN staging or scratch in the window.
  Every member of an EP group that spans NVLink domains has such a peer, so
  the ranks of a group decide alike."""
  info = getattr(comm, "info", None)
  return bool(info is not None and any(d.get("gin_mask", 0) for d in info()))


@dataclasses.dataclass(frozen=True)
class Choice:
  """What `choose` decided: `kind` "reference", "auto" (the kernels on the
  CUDA platform, the reference elsewhere) or "cuda"; the EP axis (None for
  ops without peers) and the Communicator's id the kernels get (-1: none).
  Hashable: ops keep it in static pytree fields, for their *_done halves."""
  kind: str
  axis_name: Optional[str] = None
  comm_id: int = -1

  @property
  def kernels(self) -> bool:
    """Whether the kernels run (on CUDA at least)."""
    return self.kind != "reference"


def choose(backend: Optional[str], *, op: str, axis_name: Optional[str] = None,
           refusal: Optional[str] = None, window_need: Optional[int] = None,
           window_what: str = "") -> Choice:
  """The backend of one call of `op`.

  Args:
    backend: the user's (None, "auto", "reference", "cuda").
    axis_name: the EP axis of an op that reaches peers (it needs a
      Communicator there); None for a local op (it needs the CUDA build).
    refusal: why the kernels cannot take this call's inputs, or None.
    window_need: window bytes per GPU the call needs (checked against the
      Communicator's), or None.
    window_what: what those bytes hold, for the message.
  """
  check_backend(backend)
  if backend == "reference":
    return Choice("reference", axis_name)
  comm = None if axis_name is None else cuda_comm(axis_name)
  available = cuda_built() if axis_name is None else comm is not None
  too_small = (comm is not None and window_need is not None and window_need > comm.num_bytes)
  if backend == "cuda":
    if refusal is not None:
      raise ValueError(f"backend='cuda': {refusal}")
    if not available:
      if axis_name is None:
        raise ValueError(f"backend='cuda': {op}: jax_ep was built without its CUDA kernels")
      raise ValueError(f"backend='cuda': {op} needs jax_ep built with CUDA and a Communicator "
                       f"for axis {axis_name!r} (jax_ep.Communicator.create(mesh, "
                       f"{axis_name!r}))")
    if too_small:
      raise ValueError(
          f"backend='cuda': {op}: the symmetric window is too small: the kernels need "
          f"{window_need} window bytes per GPU ({window_what}) but the Communicator has "
          f"{comm.num_bytes}; create it with num_bytes >= {window_need} "
          "(jax_ep.get_buffer_size_hint)")
    return Choice("cuda", axis_name, -1 if comm is None else comm.comm_id)
  if not available or refusal is not None or too_small:
    return Choice("reference", axis_name)
  return Choice("auto", axis_name, -1 if comm is None else comm.comm_id)


def run(choice: Choice, reference: Callable, kernel: Callable, *args):
  """reference(*args) or kernel(*args) as `choice` says; under "auto" both,
  one per platform. On an EP axis both results are marked varying over it,
  so the two branches have one type under check_vma."""
  if choice.kind == "reference":
    return reference(*args)
  if choice.axis_name is None:
    ref_fn, kernel_fn = reference, kernel
  else:
    ref_fn = lambda *a: vary(reference(*a), choice.axis_name)
    kernel_fn = lambda *a: vary(kernel(*a), choice.axis_name)
  if choice.kind == "cuda":
    return kernel_fn(*args)
  return lax.platform_dependent(*args, default=ref_fn, cuda=kernel_fn)


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
