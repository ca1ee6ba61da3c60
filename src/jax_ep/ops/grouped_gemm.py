"""Grouped GEMM: the expert matmuls that consume dispatch's expert layout.

`grouped_matmul(x, w, group_sizes)` multiplies contiguous row groups of
`x [M, H]` by one weight matrix each, `w [G, H, F]`; `masked_grouped_matmul`
does the same over the low-latency grid `[G, S, H]` with per-group counts.
Group sizes stay on the device: shapes are static, nothing syncs with the
host, so both run under `jit` and inside `shard_map`.

On NVIDIA GPUs (jax_ep built with CUDA) bf16 operands run on a CUTLASS
Hopper grouped kernel (ffi/kernels/grouped_gemm.cuh); everywhere else, and
for other dtypes, the reference is `lax.ragged_dot` (contiguous) or a masked
batched einsum. Gradients are grouped GEMMs too: dx = dy @ w[g]^T per group,
dw[g] = x_g^T @ dy_g.

`grouped_matmul_fp8` / `masked_grouped_matmul_fp8` take dispatch's FP8 rows
(e4m3 + per-128-channel scales) and FP8 weights with 128 x 128 block scales
(`quantize_weights_fp8`), scaling the f32 accumulators on the fly: nothing
is dequantised in memory. Given bf16/f32 operands instead, it casts them
itself and is differentiable, the backward on FP8 tensor cores too (dgrad
against the weights' transposed blocks, wgrad with scales along the tokens).
Design notes: docs/grouped_gemm.md.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import fp8
from jax_ep._checks import check_sms, same_origin
from jax_ep._ffi import fp8_cast as cast_ffi
from jax_ep._ffi import grouped_gemm as ffi
from jax_ep.ops import _backend
from jax_ep.ops._backend import _varying_axes, check_backend

Array = jax.Array


def _check(x: Array, w: Array, group_sizes: Array, *, masked: bool, out_dtype,
           backend: Optional[str]) -> None:
  check_backend(backend)
  want = 3 if masked else 2
  if x.ndim != want:
    shape = "[G, S, H]" if masked else "[M, H]"
    raise ValueError(f"x must be {shape}, got shape {list(x.shape)}")
  if w.ndim != 3:
    raise ValueError(f"w must be [G, H, F], got shape {list(w.shape)}")
  g, h, _ = w.shape
  if x.shape[-1] != h:
    raise ValueError(f"x's last dim {x.shape[-1]} must equal w's H = {h}")
  if masked and x.shape[0] != g:
    raise ValueError(f"x has {x.shape[0]} groups but w has {g}")
  if group_sizes.shape != (g,):
    raise ValueError(f"group_sizes must be [G] = [{g}], got shape {list(group_sizes.shape)}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integer, got {group_sizes.dtype}")
  if out_dtype is not None and jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16),
                                                           jnp.dtype(jnp.float32),
                                                           jnp.dtype(x.dtype)):
    raise ValueError(f"out_dtype must be bf16, f32 or x's dtype, got {out_dtype}")


def _kernel_refusal(x: Array, w: Array, out_dtype) -> Optional[str]:
  """Why the bf16 kernel cannot take these operands (auto then runs the
  reference), or None."""
  h, f = w.shape[1], w.shape[2]
  if (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and h % 8 == 0 and f % 8 == 0
      and jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))):
    return None
  return ("the grouped GEMM kernel takes bf16 x and w with H and F multiples of 8 and a "
          f"bf16/f32 output; got x {x.dtype}, w {w.dtype} {list(w.shape)}, out "
          f"{jnp.dtype(out_dtype)}")


def _match_vma(out: Array, *ins: Array) -> Array:
  """Gives the custom call's output the varying axes of its inputs, as the
  reference's output has, so both backends type-check under check_vma."""
  axes = frozenset().union(*(_varying_axes(a) for a in ins)) - _varying_axes(out)
  if not axes:
    return out
  if hasattr(lax, "pcast"):
    return lax.pcast(out, tuple(axes), to="varying")
  return lax.pvary(out, tuple(axes))


# --- the CUDA path: three kernels tied together by custom_vjp -------------


def _fwd_kernel(x, w, sizes, out_dtype, stride, num_sms):
  rows_shape = x.shape[:-1]
  out = ffi.grouped_gemm(x, w, sizes, kind=ffi.FORWARD, out_shape=(*rows_shape, w.shape[2]),
                         out_dtype=out_dtype, group_stride=stride, num_sms=num_sms)
  return _match_vma(out, x, w, sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_cuda(x, w, sizes, out_dtype, stride, num_sms):
  return _fwd_kernel(x, w, sizes, out_dtype, stride, num_sms)


def _grouped_cuda_fwd(x, w, sizes, out_dtype, stride, num_sms):
  return _fwd_kernel(x, w, sizes, out_dtype, stride, num_sms), (x, w, sizes)


def _grouped_cuda_bwd(out_dtype, stride, num_sms, res, dy):
  x, w, sizes = res
  # The backward kernels take bf16 operands: an f32 cotangent is rounded to
  # bf16 (the precision of the forward's operands).
  dy = dy.astype(jnp.bfloat16)
  dx = ffi.grouped_gemm(dy, w, sizes, kind=ffi.TRANS_W, out_shape=x.shape,
                        out_dtype=jnp.bfloat16, group_stride=stride, num_sms=num_sms)
  dw = ffi.grouped_gemm(x, dy, sizes, kind=ffi.WEIGHT_GRAD, out_shape=w.shape,
                        out_dtype=jnp.bfloat16, group_stride=stride, num_sms=num_sms)
  return _match_vma(dx, x), _match_vma(dw, w), None


_grouped_cuda.defvjp(_grouped_cuda_fwd, _grouped_cuda_bwd)


# --- the reference path ----------------------------------------------------


# The reference's products are exact f32 products also on a GPU, where
# XLA's default precision would run f32 operands (the dequantised FP8 ones)
# on TF32 tensor cores: docs/grouped_gemm.md says what that moved.
_EXACT = lax.Precision.HIGHEST


def _ragged_reference(x, w, sizes, out_dtype):
  return lax.ragged_dot(x, w, sizes.astype(jnp.int32), precision=_EXACT,
                        preferred_element_type=out_dtype).astype(out_dtype)


def _masked_reference(x, w, counts, out_dtype):
  """Rows at or past counts[g] are zeros (and never reach the product)."""
  rows = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :, None]
  valid = rows < jnp.clip(counts.astype(jnp.int32), 0, x.shape[1])[:, None, None]
  xm = jnp.where(valid, x, jnp.zeros((), x.dtype))
  out = jnp.einsum("gsh,ghf->gsf", xm, w, precision=_EXACT, preferred_element_type=jnp.float32)
  return jnp.where(valid, out, 0).astype(out_dtype)


def _run(x, w, sizes, *, out_dtype, stride, backend, num_sms, reference):
  if out_dtype is None:
    out_dtype = x.dtype
  out_dtype = jnp.dtype(out_dtype)
  sizes = sizes.astype(jnp.int32)
  sms = check_sms(num_sms)
  choice = _backend.choose(backend, op="grouped_matmul",
                           refusal=_kernel_refusal(x, w, out_dtype))
  return _backend.run(choice, functools.partial(reference, out_dtype=out_dtype),
                      lambda a, b, s: _grouped_cuda(a, b, s, out_dtype, stride, sms), x, w, sizes)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, *, out_dtype=None,
                   backend: Optional[str] = None, num_sms: Optional[int] = 0) -> Array:
  """out[rows of group g] = x[rows of group g] @ w[g], groups contiguous.

  Args:
    x: [M, H]. Group g is rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])),
      as dispatch's expert layout lays them out; rows past the last group give
      zeros. Sizes must be >= 0 with sum <= M: the kernel clamps to that, so it
      never reads or writes outside the buffers.
    w: [G, H, F].
    group_sizes: [G] integers, read on the device (dispatch's `counts`).
    out_dtype: bf16 or f32 (default: x's dtype); f32 accumulation either way.
    backend: None (kernel on CUDA for bf16 operands, else `lax.ragged_dot`),
      "reference" or "cuda".
    num_sms: at most this many SMs (0 or None: all of them), e.g. to leave
      room for communication running beside it. The reference ignores it.
  Returns:
    [M, F] in out_dtype.
  """
  _check(x, w, group_sizes, masked=False, out_dtype=out_dtype, backend=backend)
  out = _run(x, w, group_sizes, out_dtype=out_dtype, stride=0, backend=backend,
             num_sms=num_sms, reference=_ragged_reference)
  return same_origin(out, group_sizes)  # rows of the dispatch that counted them (combine checks)


def masked_grouped_matmul(x: Array, w: Array, counts: Array, *, out_dtype=None,
                          backend: Optional[str] = None,
                          num_sms: Optional[int] = 0) -> Array:
  """out[g, :counts[g]] = x[g, :counts[g]] @ w[g] over the low-latency grid.

  Args:
    x: [G, S, H] (low_latency_dispatch's `recv_x`, S = R * max_tokens). Only
      the first counts[g] rows of group g are read: the rest may hold anything.
    w: [G, H, F].
    counts: [G] integers (low_latency_dispatch's `recv_count`), on the device.
  Returns:
    [G, S, F]; rows at or past counts[g] are unspecified on the kernel path
    (zeros on the reference), as the low-latency contract has it.
  """
  _check(x, w, counts, masked=True, out_dtype=out_dtype, backend=backend)
  return _run(x, w, counts, out_dtype=out_dtype, stride=x.shape[1], backend=backend,
              num_sms=num_sms, reference=_masked_reference)


# --- FP8 ---------------------------------------------------------------------

def quantize_weights_fp8(w: Array) -> tuple[Array, Array]:
  """w [G, H, F] -> (wq [G, F, H] e4m3, ws [G, H/128, F/128] f32).

  One scale per 128 x 128 block, s = max(amax, 1e-4) / 448 (as fp8.quantize
  does per row); wq is stored K-major ([G, F, H]), the layout FP8 tensor
  cores read. w ≈ transpose(wq) * s per block.
  """
  g, h, f = w.shape
  if h % fp8.BLOCK or f % fp8.BLOCK:
    raise ValueError(f"H={h} and F={f} must be multiples of {fp8.BLOCK} for FP8 weights")
  b = w.astype(jnp.float32).reshape(g, h // fp8.BLOCK, fp8.BLOCK, f // fp8.BLOCK, fp8.BLOCK)
  s = fp8.scale_of(jnp.max(jnp.abs(b), axis=(2, 4)))
  q = fp8.cast(b, s, (2, 4))
  return jnp.transpose(q.reshape(g, h, f), (0, 2, 1)), s


def dequantize_weights_fp8(wq: Array, ws: Array) -> Array:
  """The inverse view of quantize_weights_fp8: [G, H, F] float32."""
  g, f, h = wq.shape
  v = jnp.transpose(wq.astype(jnp.float32), (0, 2, 1)).reshape(
      g, h // fp8.BLOCK, fp8.BLOCK, f // fp8.BLOCK, fp8.BLOCK)
  return (v * ws[:, :, None, :, None]).reshape(g, h, f)


def _check_fp8(x, w, sizes, *, masked: bool, backend) -> None:
  check_backend(backend)
  if not (isinstance(x, tuple) and len(x) == 2 and isinstance(w, tuple) and len(w) == 2):
    raise ValueError("x and w must be (e4m3 values, f32 scales) pairs")
  (xq, xs), (wq, ws) = x, w
  want = 3 if masked else 2
  if xq.ndim != want or xq.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"x values must be float8_e4m3fn of rank {want}, got {xq.dtype} "
                     f"{list(xq.shape)}")
  if wq.ndim != 3 or wq.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"w values must be float8_e4m3fn [G, F, H], got {wq.dtype} {list(wq.shape)}")
  g, f, h = wq.shape
  if xq.shape[-1] != h or h % fp8.BLOCK or f % fp8.BLOCK:
    raise ValueError(f"x's H={xq.shape[-1]} must equal w's H={h}; H and F multiples of 128")
  if xs.shape != (*xq.shape[:-1], h // fp8.BLOCK) or xs.dtype != jnp.float32:
    raise ValueError(f"x scales must be f32 {[*xq.shape[:-1], h // fp8.BLOCK]}, got "
                     f"{xs.dtype} {list(xs.shape)}")
  if ws.shape != (g, h // fp8.BLOCK, f // fp8.BLOCK) or ws.dtype != jnp.float32:
    raise ValueError(f"w scales must be f32 [{g}, {h // fp8.BLOCK}, {f // fp8.BLOCK}], got "
                     f"{ws.dtype} {list(ws.shape)}")
  if masked and xq.shape[0] != g:
    raise ValueError(f"x has {xq.shape[0]} groups but w has {g}")
  if sizes.shape != (g,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
    raise ValueError(f"group sizes must be [G] = [{g}] integers, got {sizes.dtype} "
                     f"{list(sizes.shape)}")


def _fp8_product(xq, xs, wq, ws, sizes, *, masked: bool, backend, num_sms):
  """(xq * xs) @ (wq * ws)^T per group, bf16 out: the forward product, and
  with (dy, the weights as stored) the data gradient."""
  sizes = sizes.astype(jnp.int32)

  def ref(xq, xs, wq, ws, sizes):
    xd = fp8.dequantize(xq, xs, jnp.float32)
    wd = dequantize_weights_fp8(wq, ws)
    if masked:
      return _masked_reference(xd, wd, sizes, out_dtype=jnp.dtype(jnp.bfloat16))
    return _ragged_reference(xd, wd, sizes, out_dtype=jnp.dtype(jnp.bfloat16))

  def kernel(xq, xs, wq, ws, sizes):
    # The decode grid holds a few rows per group and is bound by reading the
    # weights: 64-row pingpong tiles (two per SM in flight) read them at
    # 3.8 TB/s against 2.9 for 128-row cooperative tiles, which win on the
    # contiguous layout's full groups (1.20 against 1.47 ms at the MoE
    # shape; benchmarks/results, 2026-12-04).
    out = ffi.grouped_gemm_fp8(xq, xs, wq, ws, sizes, group_stride=xq.shape[1] if masked else 0,
                               num_sms=num_sms, schedule=1 if masked else 0)
    return _match_vma(out, xq, wq, sizes)

  op = "masked_grouped_matmul_fp8" if masked else "grouped_matmul_fp8"
  return _backend.run(_backend.choose(backend, op=op), ref, kernel, xq, xs, wq, ws, sizes)


# --- FP8 training: both weight orientations, token-major operands ----------


class Fp8Weights(NamedTuple):
  """Weights [G, H, F] quantised once per 128 x 128 block, in the two
  orientations FP8 tensor cores read (both K-major): `q`/`s` for the forward
  product (K = H), `q_t`/`s_t` for the data gradient (K = F). The blocks are
  the same, so the gradient uses exactly the transpose of the forward's
  weights."""
  q: Array    # [G, F, H] e4m3
  s: Array    # [G, H/128, F/128] f32
  q_t: Array  # [G, H, F] e4m3
  s_t: Array  # [G, F/128, H/128] f32


def fp8_weights(w: Array, *, backend: Optional[str] = None,
                num_sms: Optional[int] = 0) -> Fp8Weights:
  """Quantise master weights w [G, H, F] (f32 or bf16) for FP8 training:
  one read of w, both orientations written. Make it inside the step, or
  once per optimizer update and pass it to grouped_matmul_fp8(w_fp8=...).
  num_sms: CUDA: at most this many SMs (0 or None: one CTA per 128 x 128
  block, all of them)."""
  sms = check_sms(num_sms)
  g, h, f = w.shape
  if h % fp8.BLOCK or f % fp8.BLOCK:
    raise ValueError(f"w: H={h} and F={f} must be multiples of {fp8.BLOCK} for FP8 weights")
  if w.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    w = w.astype(jnp.float32)

  def ref(w):
    q, s = quantize_weights_fp8(w)
    return q, jnp.transpose(q, (0, 2, 1)), s

  def kernel(w):
    return tuple(_match_vma(a, w) for a in cast_ffi.cast_weights(w, num_sms=sms))

  q, q_t, s = _backend.run(_backend.choose(backend, op="fp8_weights"), ref, kernel, w)
  return Fp8Weights(q=q, s=s, q_t=q_t, s_t=jnp.transpose(s, (0, 2, 1)))


def _effective_groups(sizes: Array, rows: int) -> tuple[Array, Array]:
  """(starts, sizes) as the kernels see them: negative sizes count as 0 and
  no group reaches past `rows`."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(sizes, 0)), rows)
  starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
  return starts, ends - starts


def padded_token_count(rows: int, groups: int) -> int:
  """Length of the token axis once every group starts on a 128-token chunk:
  enough for any sizes summing to at most `rows`."""
  return fp8.BLOCK * (-(-rows // fp8.BLOCK) + groups)


def quantize_token_major(x: Array, sizes: Array, *, backend: Optional[str] = None,
                         num_sms: Optional[int] = 0) -> tuple[Array, Array, Array]:
  """x [M, C] -> (qT [C, P] e4m3, s [P/128, C] f32, padded_sizes [G] i32).

  The weight gradient's operand layout: the token axis moved last (K-major
  for wgrad), each group padded to whole 128-token chunks with zeros and
  scaled per (channel, chunk of its own tokens): no scale block spans two
  groups. P = padded_token_count(M, G). num_sms: as for fp8_weights."""
  sms = check_sms(num_sms)
  m, c = x.shape
  g = sizes.shape[0]
  p = padded_token_count(m, g)
  if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    x = x.astype(jnp.float32)
  starts, eff = _effective_groups(sizes.astype(jnp.int32), m)
  chunks = (eff + fp8.BLOCK - 1) // fp8.BLOCK
  cstart = jnp.cumsum(chunks) - chunks
  # Per chunk of the padded axis: its group, first source row and rows.
  k = jnp.arange(p // fp8.BLOCK, dtype=jnp.int32)
  grp = jnp.clip(jnp.searchsorted(cstart, k, side="right") - 1, 0, g - 1)
  local = k - cstart[grp]
  live = local < chunks[grp]
  chunk_src = jnp.where(live, starts[grp] + fp8.BLOCK * local, 0).astype(jnp.int32)
  chunk_rows = jnp.where(live, jnp.clip(eff[grp] - fp8.BLOCK * local, 0, fp8.BLOCK),
                         0).astype(jnp.int32)
  psizes = (chunks * fp8.BLOCK).astype(jnp.int32)

  def ref(x, chunk_src, chunk_rows):
    t = jnp.arange(fp8.BLOCK, dtype=jnp.int32)
    valid = t[None, :] < chunk_rows[:, None]
    src = jnp.where(valid, chunk_src[:, None] + t[None, :], 0).reshape(p)
    xp = jnp.where(valid.reshape(p)[:, None], x[src].astype(jnp.float32), 0.0)
    xb = xp.reshape(p // fp8.BLOCK, fp8.BLOCK, c)
    s = fp8.scale_of(jnp.max(jnp.abs(xb), axis=1))
    q = fp8.cast(xb, s, 1)
    return jnp.transpose(q.reshape(p, c)), s

  def kernel(x, chunk_src, chunk_rows):
    return tuple(_match_vma(a, x) for a in cast_ffi.cast_tokens(x, chunk_src, chunk_rows,
                                                                num_sms=sms))

  qt, s = _backend.run(_backend.choose(backend, op="quantize_token_major"), ref, kernel, x,
                       chunk_src, chunk_rows)
  return qt, s, psizes


def _fp8_wgrad(x, dy, sizes, *, backend, num_sms):
  """dw[g] = x_g^T dy_g with both operands FP8 along the tokens, bf16 out."""
  xq, xs, psizes = quantize_token_major(x, sizes, backend=backend, num_sms=num_sms)
  dq, ds, _ = quantize_token_major(dy, sizes, backend=backend, num_sms=num_sms)

  def ref(xq, xs, dq, ds, psizes):
    def deq(q, s):  # [C, P], [P/128, C] -> [P, C] f32
      c, p = q.shape
      v = jnp.transpose(q.astype(jnp.float32)).reshape(p // fp8.BLOCK, fp8.BLOCK, c)
      return (v * s[:, None, :]).reshape(p, c)
    xd, dd = deq(xq, xs), deq(dq, ds)
    g = psizes.shape[0]
    zero = jnp.zeros((g, xd.shape[1], dd.shape[1]), jnp.float32)
    _, pull = jax.vjp(lambda w: lax.ragged_dot(xd, w, psizes, precision=_EXACT,
                                               preferred_element_type=jnp.float32), zero)
    return pull(dd)[0].astype(jnp.bfloat16)

  def kernel(xq, xs, dq, ds, psizes):
    out = ffi.grouped_gemm_fp8(xq, xs, dq, ds, psizes, kind=ffi.WEIGHT_GRAD_FP8,
                               num_sms=num_sms)
    return _match_vma(out, xq, dq, psizes)

  return _backend.run(_backend.choose(backend, op="grouped_matmul_fp8 (weight gradient)"), ref,
                      kernel, xq, xs, dq, ds, psizes)


def _fp8_train_forward(x, sizes, wf, x_fp8, backend, num_sms):
  xq, xs = fp8.quantize(x) if x_fp8 is None else x_fp8
  return _fp8_product(xq, xs, wf.q, wf.s, sizes, masked=False, backend=backend, num_sms=num_sms)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fp8_train(x, w, sizes, wf, x_fp8, backend, num_sms):
  return _fp8_train_forward(x, sizes, wf, x_fp8, backend, num_sms)


def _fp8_train_fwd(x, w, sizes, wf, x_fp8, backend, num_sms):
  out = _fp8_train_forward(x, sizes, wf, x_fp8, backend, num_sms)
  return out, (x, w, sizes, wf.q_t, wf.s_t, x_fp8)


def _fp8_train_bwd(backend, num_sms, res, dy):
  x, w, sizes, q_t, s_t, x_fp8 = res
  dy = dy.astype(jnp.bfloat16)
  dq, ds = fp8.quantize(dy)
  dx = _fp8_product(dq, ds, q_t, s_t, sizes, masked=False, backend=backend, num_sms=num_sms)
  # The weight gradient casts x along the tokens from the values at hand:
  # x itself, or the FP8 rows when only those arrived (dequantised here, not
  # kept as an f32 residual since the forward).
  xv = x if x_fp8 is None else fp8.dequantize(*x_fp8, jnp.float32)
  dw = _fp8_wgrad(xv, dy, sizes, backend=backend, num_sms=num_sms)
  ct_fp8 = None if x_fp8 is None else tuple(jnp.zeros_like(a) for a in x_fp8)
  return (_match_vma(dx.astype(x.dtype), x), _match_vma(dw.astype(w.dtype), w), None, None,
          ct_fp8)


_fp8_train.defvjp(_fp8_train_fwd, _fp8_train_bwd)


def _check_fp8_train(x, w, sizes, w_fp8, backend) -> None:
  check_backend(backend)
  if x.ndim != 2 or w.ndim != 3:
    raise ValueError(f"x must be [M, H] and w [G, H, F]; got {list(x.shape)} and {list(w.shape)}")
  g, h, f = w.shape
  if x.shape[1] != h:
    raise ValueError(f"x's last dim {x.shape[1]} must equal w's H = {h}")
  if h % fp8.BLOCK or f % fp8.BLOCK:
    raise ValueError(f"w: H={h} and F={f} must be multiples of {fp8.BLOCK} for FP8")
  for name, a in (("x", x), ("w", w)):
    if a.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
      raise ValueError(f"{name} must be bf16 or f32 for the FP8 training path, got {a.dtype}")
  if sizes.shape != (g,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
    raise ValueError(f"group sizes must be [G] = [{g}] integers, got {sizes.dtype} "
                     f"{list(sizes.shape)}")
  if w_fp8 is not None:
    if not isinstance(w_fp8, Fp8Weights):
      raise ValueError("w_fp8 must be the Fp8Weights that fp8_weights(w) returns")
    if w_fp8.q.shape != (g, f, h) or w_fp8.q_t.shape != (g, h, f):
      raise ValueError(f"w_fp8 holds weights of shape {list(w_fp8.q_t.shape)}, w is "
                       f"{list(w.shape)}")


def grouped_matmul_fp8(x, w, group_sizes: Array, *, w_fp8: Optional[Fp8Weights] = None,
                       x_fp8: Optional[tuple[Array, Array]] = None,
                       backend: Optional[str] = None, num_sms: Optional[int] = 0) -> Array:
  """grouped_matmul on FP8 tensor cores with fine-grained scales; bf16 out.

  Two forms:
  - inference, FP8 operands as they arrive: x = (xq [M, H] e4m3, xs
    [M, H/128] f32) as dispatch(fp8=True) returns them, w = (wq [G, F, H],
    ws [G, H/128, F/128]) from quantize_weights_fp8. Not differentiable.
  - training, high-precision operands: x [M, H] and master weights w
    [G, H, F] (bf16 or f32). x is cast per (row, 128 channels), w per
    128 x 128 block (or `w_fp8`, a cached fp8_weights(w) from the last
    optimizer update, is used as it is). Differentiable: the data gradient
    casts dy per (row, 128 of F) against the weights' transposed blocks; the
    weight gradient casts x and dy per (channel, 128 tokens of a group);
    both products run on FP8 tensor cores with f32 accumulation. The
    gradients come back in x's and w's dtypes.

  group_sizes: [G] integers on the device; rows past the groups give zeros.
  Each 128-wide K slice of the product is scaled by its two scales as it is
  added into the f32 accumulator: nothing is dequantised in memory.
  backend None runs the kernels on CUDA and the reference (dequantise +
  ragged_dot, in the same custom_vjp) elsewhere; "reference" / "cuda" force
  one. num_sms: at most this many SMs for every kernel of the op, its casts
  and backward included (0 or None: all of them).
  """
  num_sms = check_sms(num_sms)
  if isinstance(x, tuple) or isinstance(w, tuple):
    if w_fp8 is not None:
      raise ValueError("w_fp8 goes with master weights w [G, H, F], not with an FP8 (wq, ws) pair")
    _check_fp8(x, w, group_sizes, masked=False, backend=backend)
    return _fp8_product(*x, *w, group_sizes, masked=False, backend=backend, num_sms=num_sms)
  _check_fp8_train(x, w, group_sizes, w_fp8, backend)
  if x_fp8 is not None:
    xq, xs = x_fp8
    if (xq.shape != x.shape or xq.dtype != jnp.float8_e4m3fn
        or xs.shape != (*x.shape[:-1], x.shape[-1] // fp8.BLOCK)):
      raise ValueError(f"x_fp8 must be (e4m3 {list(x.shape)}, f32 "
                       f"{[*x.shape[:-1], x.shape[-1] // fp8.BLOCK]}) rows of x's shape, got "
                       f"{xq.dtype} {list(xq.shape)} and {list(xs.shape)}")
    x_fp8 = tuple(lax.stop_gradient(a) for a in x_fp8)
  # The weights' cast is not differentiated through: the custom_vjp below
  # returns the master weights' gradient itself.
  wf = (fp8_weights(lax.stop_gradient(w), backend=backend, num_sms=num_sms) if w_fp8 is None
        else jax.tree.map(lax.stop_gradient, w_fp8))
  return _fp8_train(x, w, group_sizes.astype(jnp.int32), wf, x_fp8, backend, num_sms)


def masked_grouped_matmul_fp8(x: tuple[Array, Array], w: tuple[Array, Array], counts: Array, *,
                              backend: Optional[str] = None,
                              num_sms: Optional[int] = 0) -> Array:
  """masked_grouped_matmul on FP8 operands: x = (xq [G, S, H], xs [G, S, H/128])
  as low_latency_dispatch returns them; rows past counts[g] are unspecified.
  num_sms: as for grouped_matmul_fp8."""
  _check_fp8(x, w, counts, masked=True, backend=backend)
  return _fp8_product(*x, *w, counts, masked=True, backend=backend, num_sms=check_sms(num_sms))


def fp8_expert_matmul(x: Array, w, group_sizes: Array, *,
                      x_fp8: Optional[tuple[Array, Array]] = None,
                      w_fp8: Optional[Fp8Weights] = None, masked: bool = False,
                      backend: Optional[str] = None) -> Array:
  """The FP8 expert product in the form its weights ask for; bf16 out.

  Held blocks w = (wq, ws), or the decode grid (masked; master weights are
  cast to blocks here): the forward product alone, of the FP8 rows x_fp8,
  or of x cast per row and 128 channels. Master weights w [G, H, F]:
  grouped_matmul_fp8's differentiable training form (x_fp8 the rows as
  they arrived, w_fp8 the cached blocks).
  """
  if masked or isinstance(w, tuple):
    w = w if isinstance(w, tuple) else quantize_weights_fp8(w)
    rows = x_fp8 if x_fp8 is not None else fp8.quantize(x)
    matmul = masked_grouped_matmul_fp8 if masked else grouped_matmul_fp8
    return matmul(rows, w, group_sizes, backend=backend)
  return grouped_matmul_fp8(x, w, group_sizes, x_fp8=x_fp8, w_fp8=w_fp8, backend=backend)
