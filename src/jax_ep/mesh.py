"""Calling the ops from jit code outside shard_map."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:
  _shard_map = jax.shard_map
except AttributeError:  # older jax
  from jax.experimental.shard_map import shard_map as _shard_map


def shard_map(f: Callable, mesh: Mesh, *, axis_name: str = "ep", in_specs: Optional[Any] = None,
              out_specs: Optional[Any] = None) -> Callable:
  """Wraps a per-rank function for global arrays whose leading dimension is
  split over `axis_name`.

  Every input and output leaf is sharded along its first dimension: a per-rank
  [T, H] is a global [R * T, H]; per-rank counts [R] become [R * R]. Static
  arguments go through `functools.partial`.

      dispatch = jax_ep.shard_map(
          functools.partial(jax_ep.dispatch, num_experts=64), mesh)
      out = jax.jit(dispatch)(x, topk_idx, topk_weights)

  `in_specs` / `out_specs` (PartitionSpec prefixes of the arguments and the
  result, as `jax.shard_map` takes them) replace P(axis_name) where given,
  e.g. tokens split over a data axis and the EP axis together,
  P(("dp", "ep")), beside experts split over "ep" alone.
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  in_specs = P(axis_name) if in_specs is None else in_specs
  out_specs = P(axis_name) if out_specs is None else out_specs

  @functools.wraps(f)
  def wrapped(*args):
    kw = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    try:
      g = _shard_map(f, check_vma=False, **kw)
    except TypeError:
      g = _shard_map(f, check_rep=False, **kw)
    return g(*args)

  return wrapped


def place_replicated(tree: Any, mesh: Mesh) -> Any:
  """Replicates over `mesh` every array leaf of `tree` not yet placed by a
  NamedSharding; placed leaves stay as they are.

  For state made outside a layer (an optimizer's step count and moments):
  a jitted step gives its outputs mesh shardings, so inputs left on one
  device would make the second call compile again.

      nnx.update(opt, place_replicated(nnx.state(opt), mesh))
  """
  replicated = NamedSharding(mesh, P())

  def place(a):
    if not isinstance(a, jax.Array) or isinstance(a.sharding, NamedSharding):
      return a
    return jax.device_put(a, replicated)

  return jax.tree.map(place, tree)
