"""Wrappers of ffi/handlers/fp8_cast.cc: "jax_ep_fp8_cast_weights" and
"jax_ep_fp8_cast_tokens" (stateless: no communicator)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._ffi import call

Array = jax.Array


def cast_weights(w: Array, *, num_sms: int = 0) -> tuple[Array, Array, Array]:
  """w [G, H, F] bf16/f32 -> (q_nk [G, F, H], q_kn [G, H, F] e4m3, scales
  [G, H/128, F/128] f32): one pass, both orientations (kernels/fp8_cast.h).
  num_sms: at most this many SMs (0: one CTA per 128 x 128 tile)."""
  g, h, f = w.shape
  return call("jax_ep_fp8_cast_weights", (
      jax.ShapeDtypeStruct((g, f, h), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((g, h, f), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((g, h // 128, f // 128), jnp.float32)))(w, num_sms=np.int32(num_sms))


def cast_tokens(x: Array, chunk_src: Array, chunk_rows: Array, *,
                num_sms: int = 0) -> tuple[Array, Array]:
  """x [M, C] -> (qT [C, P] e4m3, scales [P/128, C] f32) with P = 128 *
  len(chunk_src): chunk k holds rows [chunk_src[k], + chunk_rows[k]) of x,
  then zeros (kernels/fp8_cast.h). num_sms: as for cast_weights."""
  c, p = x.shape[1], 128 * chunk_src.shape[0]
  return call("jax_ep_fp8_cast_tokens", (
      jax.ShapeDtypeStruct((c, p), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((p // 128, c), jnp.float32)))(x, chunk_src, chunk_rows,
                                                         num_sms=np.int32(num_sms))
