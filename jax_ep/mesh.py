"""Calling the ops from jit code outside shard_map."""
from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

try:
  _shard_map = jax.shard_map
except AttributeError:  # older jax
  from jax.experimental.shard_map import shard_map as _shard_map


def shard_map(f: Callable, mesh: Mesh, *, axis_name: str = "ep") -> Callable:
  """Wraps a per-rank function for global arrays whose leading dimension is
  split over `axis_name`.

  Every input and output leaf is sharded along its first dimension: a per-rank
  [T, H] is a global [R * T, H]; per-rank counts [R] become [R * R]. Static
  arguments go through `functools.partial`.

      dispatch = jax_ep.shard_map(
          functools.partial(jax_ep.dispatch, num_experts=64), mesh)
      out = jax.jit(dispatch)(x, topk_idx, topk_weights)
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")

  @functools.wraps(f)
  def wrapped(*args):
    kw = dict(mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name))
    try:
      g = _shard_map(f, check_vma=False, **kw)
    except TypeError:
      g = _shard_map(f, check_rep=False, **kw)
    return g(*args)

  return wrapped
