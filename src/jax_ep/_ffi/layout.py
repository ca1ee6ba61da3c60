"""Wrapper of ffi/handlers/layout.cc ("jax_ep_dispatch_layout")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._ffi import call


def layout(topk_idx: jax.Array, *, num_experts: int, num_ranks: int, comm_id: int,
           num_sms: int = 0) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """get_dispatch_layout on the GPU.

  Args:
    topk_idx: [T, K] int32 expert ids in [-1, E).
    num_sms: at most this many SMs (0: the kernel's own, one CTA).
  Returns:
    num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32,
    is_token_in_rank [T, R] bool, pos_in_rank [T, R] i32 (index of the token
    among this rank's tokens bound for rank j, ascending t; -1 if not going).
  """
  if topk_idx.ndim != 2:
    raise ValueError(f"topk_idx must be [T, K], got shape {list(topk_idx.shape)}")
  if topk_idx.dtype != jnp.int32:
    raise ValueError(f"topk_idx must be int32, got {topk_idx.dtype}")
  if num_experts % num_ranks:
    raise ValueError(f"num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
  t = topk_idx.shape[0]
  results = (
      jax.ShapeDtypeStruct((num_ranks,), jnp.int32),
      jax.ShapeDtypeStruct((num_experts,), jnp.int32),
      jax.ShapeDtypeStruct((t, num_ranks), jnp.bool_),
      jax.ShapeDtypeStruct((t, num_ranks), jnp.int32),
  )
  # vmap: each batch element is an independent layout -> sequential calls.
  return tuple(call("jax_ep_dispatch_layout", results)(
      topk_idx, comm_id=np.int64(comm_id), num_experts=np.int32(num_experts),
      num_ranks=np.int32(num_ranks), num_sms=np.int32(num_sms)))
