"""`Communicator`: the NCCL communicators, symmetric windows and device
communicators that jax_ep's CUDA kernels use, for one EP mesh axis.

One EP group is the devices along `axis_name` with the other mesh coordinates
fixed; each group gets one NCCL communicator. All groups that touch this
process's devices live under one `comm_id`, the attribute the ops pass to
their custom calls.

    comm = jax_ep.Communicator.create(mesh, "ep")
    ...  # jit/shard_map code using jax_ep ops picks it up via current("ep")
    comm.close()

Creation and close() are collective: every process that owns devices of the
mesh must call them, in the same order relative to other Communicators.
"""
from __future__ import annotations

import base64
import itertools
import threading
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh

from jax_ep import _native
from jax_ep._checks import EpRuntimeError
from jax_ep._window import GRANULE as _GRANULE
from jax_ep._window import get_buffer_size_hint  # noqa: F401  (jax_ep.get_buffer_size_hint)
from jax_ep._window import round_up as _round_up

MIN_NUM_BYTES = _GRANULE
DEFAULT_NUM_BYTES = 1 << 30
MAX_RANKS = _native.MAX_RANKS
TRANSPORTS = ("auto", "gin", "gin_emulated")  # Communicator.create(transport=...)

_registry_lock = threading.Lock()
_defaults: dict[str, "Communicator"] = {}
_create_seq = itertools.count()


def current(axis_name: str) -> Optional["Communicator"]:
  """The open Communicator most recently created for `axis_name`, or None."""
  with _registry_lock:
    c = _defaults.get(axis_name)
  return c if c is not None and not c.closed else None


def _kv_client():
  try:
    from jax._src import distributed
  except ImportError:  # pragma: no cover
    return None
  return getattr(distributed.global_state, "client", None)


def _share_unique_ids(groups: list[tuple[int, list[jax.Device]]], seq: int,
                      timeout_s: float) -> list[bytes]:
  """One NCCL unique id per (mesh-wide group index, devices); across processes
  through jax.distributed's key-value store (the owner of a group's rank 0
  publishes it under the group's mesh-wide index, which every process agrees
  on)."""
  native = _native.module()
  me = jax.process_index()
  multi = any(d.process_index != me for _, g in groups for d in g)
  if not multi:
    return [native.get_unique_id() for _ in groups]
  client = _kv_client()
  if client is None:
    raise ValueError("the mesh spans several processes: call jax.distributed.initialize() "
                     "before Communicator.create")
  ids = []
  wait_ms = int(max(60.0, 6 * timeout_s) * 1000)
  for gi, g in groups:
    key = f"jax_ep/comm/{seq}/group/{gi}"
    if g[0].process_index == me:
      uid = native.get_unique_id()
      client.key_value_set(key, base64.b64encode(uid).decode("ascii"))
    else:
      uid = base64.b64decode(client.blocking_key_value_get(key, wait_ms))
    ids.append(uid)
  return ids


class Communicator:
  """NCCL resources for the EP axis `axis_name` of `mesh` (see module doc)."""

  def __init__(self, *, comm_id: int, mesh: Mesh, axis_name: str, num_bytes: int,
               timeout_s: float, checked: bool = False):
    self._comm_id = comm_id
    self._mesh = mesh
    self._axis_name = axis_name
    self._num_bytes = num_bytes
    self._timeout_s = timeout_s
    self._checked = checked
    self._closed = False

  @classmethod
  def create(cls, mesh: Mesh, axis_name: str = "ep", num_bytes: Optional[int] = None, *,
             timeout_s: float = 10.0, checked: bool = False,
             replace: bool = False, transport: str = "auto") -> "Communicator":
    """Creates the communicators for every EP group of `mesh` along
    `axis_name` that has a device in this process, and makes the result the
    one the ops of `axis_name` use (`current(axis_name)`).

    Args:
      mesh: a mesh of CUDA GPUs.
      axis_name: the EP axis; its size R is the number of ranks (<= 8).
      num_bytes: symmetric window bytes per GPU (rounded up to 2 MiB);
        default 1 GiB. See `get_buffer_size_hint`.
      timeout_s: how long a kernel waits for a peer before reporting an error.
      checked: checked mode (docs/errors.md): every op waits for its kernels
        and fails its own program with the error they found (bad expert id,
        overflow, ...), so fetching any result of that program raises.
        Default False, deferred: the error is raised by the next jax_ep call
        on the device or `check()`, naming the call that caused it. Checked
        mode costs a host wait per op (+8 % on a dispatch, +4 % on a
        combine at the Normal shape on one H200).
      replace: an open Communicator on `axis_name` is an error (ops would
        otherwise switch to the new one silently); replace=True closes it
        first (collective, like `close()`).
      transport: how peers are reached (docs/design.md §3): "auto" (NVLink
        load/store inside NCCL's LSA team, GIN RDMA beyond it), "gin" (every
        remote peer over GIN, to test that path; needs a NIC) or
        "gin_emulated" (the GIN code path carried over NVLink, to test it on
        one host). Every process of a group must pass the same.
    """
    if transport not in TRANSPORTS:
      raise ValueError(f"transport={transport!r} is not one of {TRANSPORTS}")
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    old = current(axis_name)
    if old is not None and not replace:
      raise ValueError(f"a Communicator on axis {axis_name!r} is already open ({old!r}); "
                       "close() it first, or pass replace=True to close it and create this one")
    devices = list(mesh.devices.flat)
    not_gpu = sorted({d.platform for d in devices if d.platform not in ("gpu", "cuda")})
    if not_gpu:
      raise ValueError(f"Communicator needs a mesh of CUDA GPUs; this mesh has {not_gpu} devices "
                       "(on CPU/TPU the ops use the reference backend and need no Communicator)")
    if not _native.cuda_built():
      raise RuntimeError("jax_ep was built without CUDA; rebuild with nvcc and NCCL available "
                         "(JAX_EP_CUDA=ON pip install -e .)")
    num_ranks = mesh.shape[axis_name]
    if num_ranks > MAX_RANKS:
      raise ValueError(f"axis {axis_name!r} has {num_ranks} devices; jax_ep supports at most "
                       f"{MAX_RANKS} ranks per EP group")
    if num_bytes is None:
      num_bytes = DEFAULT_NUM_BYTES
    if num_bytes < MIN_NUM_BYTES:
      raise ValueError(f"num_bytes={num_bytes} is below the minimum window of {MIN_NUM_BYTES} "
                       "bytes; see jax_ep.get_buffer_size_hint")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    num_bytes = _round_up(int(num_bytes), _GRANULE)

    ax = mesh.axis_names.index(axis_name)
    groups = np.moveaxis(mesh.devices, ax, -1).reshape(-1, num_ranks)
    me = jax.process_index()
    mine = [(gi, list(g)) for gi, g in enumerate(groups)
            if any(d.process_index == me for d in g)]
    if not mine:
      raise ValueError("no device of this mesh belongs to this process")
    with _registry_lock:
      seq = next(_create_seq)
    if old is not None:  # replace=True, and the new one's arguments are valid
      old.close()
    uids = _share_unique_ids(mine, seq, timeout_s)
    specs = []
    for uid, (_, g) in zip(uids, mine):
      ranks = [r for r, d in enumerate(g) if d.process_index == me]
      ordinals = [g[r].local_hardware_id for r in ranks]
      specs.append((uid, num_ranks, ranks, ordinals))
    _native.ensure_registered()
    comm_id = _native.module().comm_create_groups(specs, num_bytes, float(timeout_s),
                                                  bool(checked), transport)
    comm = cls(comm_id=comm_id, mesh=mesh, axis_name=axis_name, num_bytes=num_bytes,
               timeout_s=float(timeout_s), checked=bool(checked))
    with _registry_lock:
      _defaults[axis_name] = comm
    return comm

  # -- properties
  @property
  def comm_id(self) -> int:
    if self._closed:
      raise ValueError(f"Communicator {self._comm_id} is closed")
    return self._comm_id

  @property
  def axis_name(self) -> str:
    return self._axis_name

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def num_ranks(self) -> int:
    return self._mesh.shape[self._axis_name]

  @property
  def num_bytes(self) -> int:
    """Symmetric window bytes per GPU (after rounding)."""
    return self._num_bytes

  @property
  def timeout_s(self) -> float:
    return self._timeout_s

  @property
  def closed(self) -> bool:
    return self._closed

  @property
  def checked(self) -> bool:
    """Checked mode (see `create`)."""
    return self._checked

  def info(self) -> list[dict]:
    """Per local device: device_ordinal, rank, nranks, group, window_bytes,
    lsa_size, calls (jax_ep ops executed there so far: a deferred error names
    the number of the call that caused it)."""
    return list(_native.module().comm_info(self.comm_id))

  # -- checks
  def check_size(self, **config) -> None:
    """ValueError when the window is smaller than `get_buffer_size_hint(**config)`."""
    need = get_buffer_size_hint(**config)
    if self._num_bytes < need:
      raise ValueError(f"Communicator window has {self._num_bytes} bytes per GPU but this config "
                       f"needs {need} (get_buffer_size_hint({config})); create it with "
                       f"num_bytes>={need}")

  def status_message(self) -> str:
    """Errors kernels reported since the last check ('' if none); clears them.
    Reports only kernels that have finished: block on their outputs first."""
    if self._closed:
      return ""
    return _native.module().status_message(self._comm_id)

  def check(self) -> None:
    """Raises EpRuntimeError if a kernel on this communicator reported an error."""
    msg = self.status_message()
    if msg:
      raise EpRuntimeError(msg)

  # -- lifetime
  def close(self) -> None:
    """Releases the GPU/NCCL resources (collective; idempotent). Compiled
    programs that still refer to this communicator fail with an error."""
    if self._closed:
      return
    self._closed = True
    with _registry_lock:
      if _defaults.get(self._axis_name) is self:
        del _defaults[self._axis_name]
    _native.module().comm_destroy(self._comm_id)

  def __enter__(self) -> "Communicator":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    state = "closed" if self._closed else f"{self._num_bytes} B window"
    return (f"Communicator(comm_id={self._comm_id}, axis_name={self._axis_name!r}, "
            f"num_ranks={self.num_ranks}, {state})")
