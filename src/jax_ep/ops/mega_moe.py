"""`mega_moe`: the routed SwiGLU experts of an FP8 MoE layer as one op.

Per rank (inside `shard_map` over the EP axis): every token's row goes to
its top-k experts, each expert computes swiglu(x @ w13[e]) @ w2[e] in FP8,
and the rows come back summed with the top-k weights. Its outputs are those
of the unfused FP8 path, op for op:

  dispatch(fp8=True, layout="expert")      x cast per token and 128 channels
  grouped_matmul_fp8(rows, w13)            -> bf16 [M, 2F]
  swiglu                                   -> bf16 [M, F]
  grouped_matmul_fp8(h, w2)                h cast per row and 128 channels -> bf16
  combine(y, weights)                      the fixed f32 top-k order

The fused form (docs/mega_moe.md: linear 1 pulls the rows from the source
ranks' windows into its tiles, linear 2 writes each result row into its
source token's slot) is not in this build yet: the automatic choice runs
the unfused path above (its kernels on CUDA, the reference elsewhere) and
backend="cuda" raises ValueError saying so. The gradient is the unfused
path's: FP8 dgrad and wgrad, bf16 cotangents across dispatch and combine,
a straight-through estimator for the rows' FP8 cast.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jax_ep import fp8 as _fp8
from jax_ep import reference as _ref
from jax_ep._checks import check_routing, check_sms
from jax_ep.ops import _backend
from jax_ep.ops.dispatch import combine, dispatch_fp8_rows
from jax_ep.ops.grouped_gemm import Fp8Weights, fp8_expert_matmul

KERNELS_MISSING = ("mega_moe: the fused kernels are not in this build yet; the automatic "
                   "choice runs the unfused FP8 path (dispatch(fp8=True) -> grouped_matmul_fp8 "
                   "-> swiglu -> grouped_matmul_fp8 -> combine), which has the same outputs")
MASTER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def swiglu(h13: jax.Array, dtype=None) -> jax.Array:
  """silu(gate) * up of a fused gate/up product h13 [..., 2F] (gate the first
  F columns, up the last F), in `dtype` (default h13's).

  The upcast, the f32 math and the downcast are one expression, so XLA fuses
  them into one elementwise pass that reads h13 and writes [..., F] in their
  own dtypes: the f32 values never reach memory.
  """
  f = h13.shape[-1] // 2
  gate = h13[..., :f].astype(jnp.float32)
  up = h13[..., f:].astype(jnp.float32)
  return (gate * jax.nn.sigmoid(gate) * up).astype(dtype or h13.dtype)


def _is_pair(w) -> bool:
  return isinstance(w, tuple) and len(w) == 2


def _weight_dims(name: str, w) -> tuple[int, int, int]:
  """(G, K, N) of a master weight [G, K, N] or a held FP8 pair (wq [G, N, K]
  e4m3, ws [G, K/128, N/128] f32); ValueError naming `name` otherwise."""
  if _is_pair(w):
    wq, ws = w
    if getattr(wq, "ndim", 0) != 3 or wq.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"{name}: held FP8 weights are (wq [G, N, K] float8_e4m3fn, ws f32); "
                       f"wq is {getattr(wq, 'dtype', type(wq).__name__)} "
                       f"{list(getattr(wq, 'shape', ()))}")
    g, n, k = wq.shape
    if k % _fp8.BLOCK or n % _fp8.BLOCK:
      raise ValueError(f"{name}: K={k} and N={n} must be multiples of {_fp8.BLOCK}")
    want = (g, k // _fp8.BLOCK, n // _fp8.BLOCK)
    if ws.shape != want or ws.dtype != jnp.float32:
      raise ValueError(f"{name}: the scales must be float32 {list(want)}, got {ws.dtype} "
                       f"{list(ws.shape)}")
    return g, k, n
  if getattr(w, "ndim", 0) != 3:
    raise ValueError(f"{name} must be [G, K, N] master weights or a held FP8 (wq, ws) pair, "
                     f"got {list(getattr(w, 'shape', ()))}")
  if w.dtype not in MASTER_DTYPES:
    raise ValueError(f"{name} must be bfloat16 or float32 master weights (cast to FP8 blocks "
                     f"in the step), got {w.dtype}")
  return tuple(w.shape)


def _check(x, topk_idx, topk_weights, w13, w2, w_fp8, *, num_experts: int,
           axis_name: str) -> None:
  """ValueErrors naming the bad argument."""
  if getattr(x, "ndim", 0) != 2 or x.dtype not in MASTER_DTYPES:
    raise ValueError(f"x must be bfloat16 or float32 [T, H], got "
                     f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', ()))}")
  t, h = x.shape
  if h % _fp8.BLOCK:
    raise ValueError(f"x: the hidden size H={h} must be a multiple of {_fp8.BLOCK} for FP8")
  if topk_weights is None:
    raise ValueError("topk_weights is required: the combine sums the experts' rows with them")
  ranks = _ref.axis_size(axis_name)
  check_routing(topk_idx, topk_weights, num_tokens=t, num_experts=num_experts, num_ranks=ranks)
  if _is_pair(w13) != _is_pair(w2):
    raise ValueError("w13 and w2 must both be master weights or both held FP8 (wq, ws) pairs")
  g, k1, n1 = _weight_dims("w13", w13)
  g2, k2, n2 = _weight_dims("w2", w2)
  if g * ranks != num_experts:
    raise ValueError(f"w13 holds {g} local experts; num_experts={num_experts} over {ranks} "
                     f"ranks needs {num_experts // ranks}")
  if k1 != h:
    raise ValueError(f"w13 [E_l, H, 2F]: its H={k1} must equal x's hidden size {h}")
  if n1 % 2 or (n1 // 2) % _fp8.BLOCK:
    raise ValueError(f"w13 [E_l, H, 2F]: its last axis {n1} must be 2F with F a multiple of "
                     f"{_fp8.BLOCK}")
  if (g2, k2, n2) != (g, n1 // 2, h):
    raise ValueError(f"w2 must be [E_l, F, H] = [{g}, {n1 // 2}, {h}] (F = half of w13's last "
                     f"axis), got [{g2}, {k2}, {n2}]")
  if w_fp8 is not None:
    if _is_pair(w13):
      raise ValueError("w_fp8 goes with master weights, not with held FP8 (wq, ws) pairs")
    if not (isinstance(w_fp8, tuple) and len(w_fp8) == 2
            and all(isinstance(w, Fp8Weights) for w in w_fp8)):
      raise ValueError("w_fp8 must be (fp8_weights(w13), fp8_weights(w2))")


def mega_moe(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, w13, w2, *,
             num_experts: int, axis_name: str = "ep",
             w_fp8: Optional[tuple[Fp8Weights, Fp8Weights]] = None,
             expert_alignment: int = 1, dtype=jnp.bfloat16, num_sms: Optional[int] = 0,
             backend: Optional[str] = None) -> jax.Array:
  """The routed experts of a SwiGLU FP8 MoE layer: sum over k of
  topk_weights[t, k] * (swiglu(x_t @ w13[e]) @ w2[e]) with e = topk_idx[t, k],
  every product on FP8 operands with f32 accumulation (module docstring).

  Args:
    x: [T, H] bfloat16 or float32, H a multiple of 128; cast to e4m3 per
      token and 128 channels.
    topk_idx: [T, K] int32 in [-1, E); -1 means none. topk_weights: [T, K].
    w13: [E_l, H, 2F] master weights (gate the first F columns, up the last
      F; bfloat16 or float32, cast per 128 x 128 block in the step), or held
      FP8 blocks (wq [E_l, 2F, H] e4m3, ws [E_l, H/128, 2F/128] f32) from
      quantize_weights_fp8 (inference: no gradient in the weights).
    w2: [E_l, F, H], or its held blocks (wq [E_l, H, F], ws), as w13.
    w_fp8: master weights only: (fp8_weights(w13), fp8_weights(w2)) cached
      since the last optimizer update; None casts them in the step.
    expert_alignment: the expert groups' padding in the dispatch.
    dtype: the rows' dtype between the GEMMs and of the output.
    num_sms: at most this many SMs for the fused kernels (0: their default).
    backend: None (auto), "reference" or "cuda" (the fused kernels; not in
      this build: ValueError).
  Returns:
    [T, H] in dtype.
  """
  check_sms(num_sms)
  _check(x, topk_idx, topk_weights, w13, w2, w_fp8, num_experts=num_experts,
         axis_name=axis_name)
  # The one choice: "cuda" raises the refusal; otherwise the unfused path,
  # whose ops make the same choice for themselves from the same `backend`.
  _backend.choose(backend, op="mega_moe", axis_name=axis_name, refusal=KERNELS_MISSING)
  out, rows_fp8 = dispatch_fp8_rows(x, topk_idx, topk_weights, num_experts=num_experts,
                                    axis_name=axis_name, layout="expert",
                                    expert_alignment=expert_alignment, dtype=dtype,
                                    backend=backend)
  c13, c2 = w_fp8 if w_fp8 is not None else (None, None)
  h13 = fp8_expert_matmul(out.recv_x, w13, out.counts, x_fp8=rows_fp8, w_fp8=c13,
                          backend=backend)
  h = swiglu(h13.astype(dtype), dtype)
  y = fp8_expert_matmul(h, w2, out.counts, w_fp8=c2, backend=backend)
  return combine(y.astype(dtype), out.handle, out.recv_topk_weights, axis_name=axis_name,
                 backend=backend)
