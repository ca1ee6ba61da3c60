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
is dequantised in memory. Forward only. Design notes: docs/grouped_gemm.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import _ffi, _native, fp8
from jax_ep._checks import same_origin
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


def _kernel_ok(x: Array, w: Array, out_dtype) -> bool:
  """Whether the CUDA kernel takes these operands (else the reference)."""
  h, f = w.shape[1], w.shape[2]
  return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and h % 8 == 0 and f % 8 == 0
          and jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))


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
  out = _ffi.grouped_gemm_cuda(x, w, sizes, kind=_ffi.GG_FORWARD,
                               out_shape=(*rows_shape, w.shape[2]), out_dtype=out_dtype,
                               group_stride=stride, num_sms=num_sms)
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
  dx = _ffi.grouped_gemm_cuda(dy, w, sizes, kind=_ffi.GG_TRANS_W, out_shape=x.shape,
                              out_dtype=jnp.bfloat16, group_stride=stride, num_sms=num_sms)
  dw = _ffi.grouped_gemm_cuda(x, dy, sizes, kind=_ffi.GG_WEIGHT_GRAD, out_shape=w.shape,
                              out_dtype=jnp.bfloat16, group_stride=stride, num_sms=num_sms)
  return _match_vma(dx, x), _match_vma(dw, w), None


_grouped_cuda.defvjp(_grouped_cuda_fwd, _grouped_cuda_bwd)


# --- the reference path ----------------------------------------------------


def _ragged_reference(x, w, sizes, out_dtype):
  return lax.ragged_dot(x, w, sizes.astype(jnp.int32),
                        preferred_element_type=out_dtype).astype(out_dtype)


def _masked_reference(x, w, counts, out_dtype):
  """Rows at or past counts[g] are zeros (and never reach the product)."""
  rows = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :, None]
  valid = rows < jnp.clip(counts.astype(jnp.int32), 0, x.shape[1])[:, None, None]
  xm = jnp.where(valid, x, jnp.zeros((), x.dtype))
  out = jnp.einsum("gsh,ghf->gsf", xm, w, preferred_element_type=jnp.float32)
  return jnp.where(valid, out, 0).astype(out_dtype)


def _run(x, w, sizes, *, out_dtype, stride, backend, num_sms, reference):
  if out_dtype is None:
    out_dtype = x.dtype
  out_dtype = jnp.dtype(out_dtype)
  sizes = sizes.astype(jnp.int32)
  ref = functools.partial(reference, out_dtype=out_dtype)
  use_kernel = _native.cuda_built() and _kernel_ok(x, w, out_dtype)
  if backend == "reference" or (backend in (None, "auto") and not use_kernel):
    return ref(x, w, sizes)
  if backend == "cuda":
    if not _native.cuda_built():
      raise ValueError("backend='cuda': jax_ep was built without its CUDA kernels")
    if not _kernel_ok(x, w, out_dtype):
      raise ValueError("backend='cuda': the grouped GEMM kernel takes bf16 x and w with H and F "
                       f"multiples of 8 and a bf16/f32 output; got x {x.dtype}, w {w.dtype} "
                       f"{list(w.shape)}, out {out_dtype}")
  kernel = lambda a, b, s: _grouped_cuda(a, b, s, out_dtype, stride, num_sms or 0)
  if backend == "cuda":
    return kernel(x, w, sizes)
  return lax.platform_dependent(x, w, sizes, default=ref, cuda=kernel)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, *, out_dtype=None,
                   backend: Optional[str] = None, num_sms: Optional[int] = None) -> Array:
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
    num_sms: SMs the kernel may use (default all), e.g. to leave room for
      communication running beside it.
  Returns:
    [M, F] in out_dtype.
  """
  _check(x, w, group_sizes, masked=False, out_dtype=out_dtype, backend=backend)
  out = _run(x, w, group_sizes, out_dtype=out_dtype, stride=0, backend=backend,
             num_sms=num_sms, reference=_ragged_reference)
  return same_origin(out, group_sizes)  # rows of the dispatch that counted them (combine checks)


def masked_grouped_matmul(x: Array, w: Array, counts: Array, *, out_dtype=None,
                          backend: Optional[str] = None,
                          num_sms: Optional[int] = None) -> Array:
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
  s = jnp.maximum(jnp.max(jnp.abs(b), axis=(2, 4)), jnp.float32(fp8.AMAX_FLOOR)) * fp8.INV_E4M3_MAX
  inv = fp8.reciprocal_rn(s)
  q = fp8.to_e4m3(jnp.clip(b * inv[:, :, None, :, None], -fp8.E4M3_MAX, fp8.E4M3_MAX))
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


def _run_fp8(x, w, sizes, *, masked: bool, backend, num_sms):
  (xq, xs), (wq, ws) = x, w
  sizes = sizes.astype(jnp.int32)

  def ref(xq, xs, wq, ws, sizes):
    xd = fp8.dequantize(xq, xs, jnp.float32)
    wd = dequantize_weights_fp8(wq, ws)
    if masked:
      return _masked_reference(xd, wd, sizes, out_dtype=jnp.dtype(jnp.bfloat16))
    return _ragged_reference(xd, wd, sizes, out_dtype=jnp.dtype(jnp.bfloat16))

  def kernel(xq, xs, wq, ws, sizes):
    out = _ffi.grouped_gemm_fp8_cuda(xq, xs, wq, ws, sizes,
                                     group_stride=xq.shape[1] if masked else 0,
                                     num_sms=num_sms or 0)
    return _match_vma(out, xq, wq, sizes)

  args = (xq, xs, wq, ws, sizes)
  # The kernel is the default on CUDA: its GPU tests (the oracle over the
  # group patterns, contiguous and masked) passed in device run 1 of
  # session 6 (benchmarks/RESULTS.md).
  if backend == "reference" or (backend in (None, "auto") and not _native.cuda_built()):
    return ref(*args)
  if backend == "cuda":
    if not _native.cuda_built():
      raise ValueError("backend='cuda': jax_ep was built without its CUDA kernels")
    return kernel(*args)
  return lax.platform_dependent(*args, default=ref, cuda=kernel)


def grouped_matmul_fp8(x: tuple[Array, Array], w: tuple[Array, Array], group_sizes: Array, *,
                       backend: Optional[str] = None, num_sms: Optional[int] = None) -> Array:
  """grouped_matmul on FP8 operands with fine-grained scales; bf16 out.

  Args:
    x: (xq [M, H] e4m3, xs [M, H/128] f32), as dispatch(fp8=True) returns them
      (x ≈ xq * xs per 128 channels).
    w: (wq [G, F, H] e4m3, ws [G, H/128, F/128] f32) from quantize_weights_fp8.
    group_sizes: [G] integers on the device; rows past the groups give zeros.
  Returns:
    [M, F] bf16: f32 accumulation, each 128-wide K slice scaled by its two
    scales before it is added. Not differentiable (forward/inference only).
    backend None runs the kernel on CUDA and the reference (dequantise +
    ragged_dot) elsewhere; "reference" / "cuda" force one.
  """
  _check_fp8(x, w, group_sizes, masked=False, backend=backend)
  return _run_fp8(x, w, group_sizes, masked=False, backend=backend, num_sms=num_sms)


def masked_grouped_matmul_fp8(x: tuple[Array, Array], w: tuple[Array, Array], counts: Array, *,
                              backend: Optional[str] = None,
                              num_sms: Optional[int] = None) -> Array:
  """masked_grouped_matmul on FP8 operands: x = (xq [G, S, H], xs [G, S, H/128])
  as low_latency_dispatch returns them; rows past counts[g] are unspecified."""
  _check_fp8(x, w, counts, masked=True, backend=backend)
  return _run_fp8(x, w, counts, masked=True, backend=backend, num_sms=num_sms)
