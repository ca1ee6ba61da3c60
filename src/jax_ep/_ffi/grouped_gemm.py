"""Wrappers of ffi/handlers/grouped_gemm.cc: "jax_ep_grouped_gemm" and
"jax_ep_grouped_gemm_fp8" (stateless: no communicator)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native
from jax_ep._ffi import call

Array = jax.Array

# Must match GgKind in ffi/kernels/grouped_gemm.h.
FORWARD, TRANS_W, WEIGHT_GRAD, FORWARD_FP8, WEIGHT_GRAD_FP8 = 0, 1, 2, 3, 4


def grouped_gemm(a: Array, b: Array, group_sizes: Array, *, kind: int,
                 out_shape: tuple[int, ...], out_dtype, group_stride: int = 0,
                 num_sms: int = 0) -> Array:
  """One grouped product on the tensor cores (ffi/kernels/grouped_gemm.h).

  kind FORWARD: a = x [M, H], b = w [G, H, F] -> [M, F];
  TRANS_W: a = dy [M, F], b = w [G, H, F] -> [M, H];
  WEIGHT_GRAD: a = x [M, H], b = dy [M, F] -> [G, H, F].
  With group_stride S > 0, a (and a row output) is [G, S, .] and group g
  is its first min(group_sizes[g], S) rows of slot g (the masked form).
  group_sizes [G] int32 stays on the device. num_sms: at most this many SMs
  (0: all of the device's).
  """
  ws = workspace_bytes(kind, jnp.dtype(out_dtype) == jnp.float32, group_sizes.shape[0])
  # Each batch element is an independent product -> sequential calls.
  out, _ = call("jax_ep_grouped_gemm", (jax.ShapeDtypeStruct(out_shape, out_dtype),
                                        jax.ShapeDtypeStruct((ws,), jnp.uint8)))(
      a, b, group_sizes, kind=np.int32(kind), group_stride=np.int64(group_stride),
      num_sms=np.int32(num_sms))
  return out


def grouped_gemm_fp8(a: Array, a_scales: Array, b: Array, b_scales: Array,
                     group_sizes: Array, *, kind: int = FORWARD_FP8, group_stride: int = 0,
                     num_sms: int = 0, schedule: int = 0) -> Array:
  """One FP8 grouped product (ffi/kernels/grouped_gemm.h); bf16 out.

  FORWARD_FP8: a = xq [M, H] (or [G, S, H]) e4m3, a_scales [M, H/128]
  (or [G, S, H/128]) f32, b = wq [G, F, H] e4m3 (K-major), b_scales
  [G, H/128, F/128] -> [M, F] (or [G, S, F]).
  WEIGHT_GRAD_FP8: a = xT [H, P], a_scales [P/128, H], b = dyT [F, P],
  b_scales [P/128, F], group_sizes padded to 128-token chunks -> [G, H, F].
  num_sms: at most this many SMs (0: all of the device's).
  """
  g = group_sizes.shape[0]
  if kind == WEIGHT_GRAD_FP8:
    out_shape = (g, a.shape[0], b.shape[0])
  else:
    out_shape = (*a.shape[:-1], b.shape[1])
  ws = workspace_bytes(kind, False, g, schedule=schedule)
  out, _ = call("jax_ep_grouped_gemm_fp8", (jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
                                            jax.ShapeDtypeStruct((ws,), jnp.uint8)))(
      a, a_scales, b, b_scales, group_sizes, kind=np.int32(kind), schedule=np.int32(schedule),
      group_stride=np.int64(group_stride), num_sms=np.int32(num_sms))
  return out


# CUTLASS keeps a few tensor maps per SM: sized for more SMs than any GPU
# has, the workspace fits whatever device and num_sms the call runs with.
_WORKSPACE_SMS = 1024


@functools.lru_cache(maxsize=None)
def workspace_bytes(kind: int, out_f32: bool, num_groups: int, schedule: int = 0) -> int:
  """The kernel's scratch bytes, as the native module computes them."""
  return int(_native.module().grouped_gemm_workspace_bytes(kind, bool(out_f32), num_groups,
                                                           _WORKSPACE_SMS, schedule))
