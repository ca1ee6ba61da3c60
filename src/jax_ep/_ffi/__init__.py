"""The Python ⇄ C++ boundary: one module per FFI handler file, same name as
ffi/handlers/X.cc, each wrapper one plain function around one
`jax.ffi.ffi_call`.

The wrappers run inside `shard_map` on one rank's shard (per-shard shapes)
and take every setting as a keyword (the handler's attributes). User-facing
checks, gradients and the backend choice live in `jax_ep.ops`; here only
the result shapes and what the kernels rely on.
"""
from __future__ import annotations

import jax

from jax_ep import _native


def call(target: str, results, *, vmap_method: "str | None" = "sequential",
         has_side_effect: bool = False, input_output_aliases: "dict[int, int] | None" = None):
  """jax.ffi.ffi_call of one of the module's targets."""
  # Registration is only needed to compile, not to lower/export; skip it when
  # the CUDA build is absent so that jax.export(platforms=["cuda"]) still works.
  if _native.cuda_built():
    _native.ensure_registered()
  return jax.ffi.ffi_call(target, results, vmap_method=vmap_method,
                          has_side_effect=has_side_effect,
                          input_output_aliases=input_output_aliases)
