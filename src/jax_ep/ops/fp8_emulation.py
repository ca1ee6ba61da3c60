"""A differentiable FP8 grouped GEMM emulated in pure JAX (DeepSeek-V3's recipe).

`grouped_matmul_fp8_emulated(x, w, group_sizes)` computes what the FP8
training kernels are to compute, with every FP8 cast done by the package's
quantisers (jax_ep.fp8 for 1 x 128 activation tiles, quantize_weights_fp8 for
128 x 128 weight blocks) and every product a float32 `lax.ragged_dot` of the
dequantised operands:

  forward  out = Q(x, 1 x 128 along K) @ Q(w, 128 x 128 blocks)
  dgrad    dx  = Q(dy, 1 x 128 along N) @ Q(w)^T (the same blocks, transposed)
  wgrad    dw  = Q(x, 128 x 1 along tokens)^T @ Q(dy, 128 x 1 along tokens)

so that an FP8 training run can be judged on any backend before the kernels
exist (x given as FP8 rows, its 128 x 1 tiles are cast from their values). The weights are master copies (f32 or bf16) cast to FP8 inside the
call; their gradient is straight through that cast (dw in w's dtype), and the
activation gradient comes back in x's dtype (bf16 across dispatch/combine).

The wgrad's 128-token blocks run over the whole row buffer (padded to a
multiple of 128), so a block may straddle two groups and share their scale:
slightly coarser than a kernel that starts its blocks at each group.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import fp8
from jax_ep.ops.grouped_gemm import dequantize_weights_fp8, quantize_weights_fp8

Array = jax.Array


def fake_quantize_rows(x: Array) -> Array:
  """x [..., K] through e4m3 with a scale per row and 128 channels, in f32."""
  return fp8.dequantize(*fp8.quantize(x), jnp.float32)


def fake_quantize_columns(x: Array) -> Array:
  """x [M, K] through e4m3 with a scale per 128 rows and one channel, in f32
  (the tiles of a GEMM whose contraction runs over the rows)."""
  m = x.shape[0]
  pad = -m % fp8.BLOCK
  xt = jnp.pad(x.astype(jnp.float32), ((0, pad), (0, 0))).T
  return fake_quantize_rows(xt).T[:m]


def _ragged(x, w, sizes):
  return lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gemm(x, w, sizes, x_fp8, dtypes):
  return _gemm_fwd(x, w, sizes, x_fp8, dtypes)[0]


def _gemm_fwd(x, w, sizes, x_fp8, dtypes):
  out_dtype = dtypes[0]
  xq, xs = x_fp8 if x_fp8 is not None else fp8.quantize(x)
  wq, ws = quantize_weights_fp8(w)
  xd = fp8.dequantize(xq, xs, jnp.float32)
  out = _ragged(xd, dequantize_weights_fp8(wq, ws), sizes)
  # The wgrad's tiles run along the tokens, so x is cast a second way here,
  # from the values at hand: x itself, or the FP8 rows when only those
  # arrived (a second rounding a kernel on dispatched rows cannot avoid).
  # A kernel keeps these as e4m3 + scales; the emulation keeps their values.
  xt = fake_quantize_columns(xd if x_fp8 is not None else x)
  return out.astype(out_dtype), (xt, wq, ws, sizes, xq, xs)


def _gemm_bwd(dtypes, res, dy):
  _, x_dtype, w_dtype, had_x_fp8 = dtypes
  xt, wq, ws, sizes, xq, xs = res
  wd = dequantize_weights_fp8(wq, ws)
  dx = _ragged(fake_quantize_rows(dy), jnp.transpose(wd, (0, 2, 1)), sizes)
  dyt = fake_quantize_columns(dy)
  _, wgrad = jax.vjp(lambda w_: _ragged(xt, w_, sizes), wd)
  (dw,) = wgrad(dyt)
  ct_fp8 = (jnp.zeros_like(xq), jnp.zeros_like(xs)) if had_x_fp8 else None
  return dx.astype(x_dtype), dw.astype(w_dtype), None, ct_fp8


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


def grouped_matmul_fp8_emulated(x: Array, w: Array, group_sizes: Array, *,
                                x_fp8: Optional[tuple[Array, Array]] = None,
                                out_dtype=None) -> Array:
  """grouped_matmul through FP8 casts, forward and backward (module doc).

  Args:
    x: [M, K] rows (bf16/f32), groups contiguous as in grouped_matmul. It is
      what the gradient flows back to; with x_fp8 its values are not read.
    w: [G, K, N] master weights (f32 or bf16), K and N multiples of 128.
    group_sizes: [G] integers.
    x_fp8: (xq [M, K] e4m3, xs [M, K/128] f32), x already in FP8 (an FP8
      dispatch's rows): used as they are instead of quantising x. They get
      no gradient.
    out_dtype: default x's dtype.
  Returns:
    [M, N] in out_dtype; rows past the groups are zero.
  """
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"x must be [M, K] and w [G, K, N] with the same K; got x {list(x.shape)}, "
                     f"w {list(w.shape)}")
  k, n = w.shape[1:]
  if k % fp8.BLOCK or n % fp8.BLOCK:
    raise ValueError(f"w's K={k} and N={n} must be multiples of {fp8.BLOCK} for FP8")
  if w.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"w must be float32 or bfloat16 master weights, got {w.dtype}")
  dtypes = (jnp.dtype(out_dtype or x.dtype), jnp.dtype(x.dtype), jnp.dtype(w.dtype),
            x_fp8 is not None)
  if x_fp8 is not None:
    x_fp8 = tuple(lax.stop_gradient(a) for a in x_fp8)
  return _gemm(x, w, group_sizes.astype(jnp.int32), x_fp8, dtypes)
