"""Thin `jax.ffi.ffi_call` wrappers, one per native op.

Each runs inside `shard_map` on one rank's shard (per-shard shapes) and
enqueues a CUDA kernel on the communicator `comm_id`. Validation of user
arguments happens in `jax_ep.ops`; here only what the kernels rely on.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _native

Array = jax.Array


def _call(target: str, results, *, vmap_method: "str | None" = "sequential",
          has_side_effect: bool = False, input_output_aliases: "dict[int, int] | None" = None):
  # Registration is only needed to compile, not to lower/export; skip it when
  # the CUDA build is absent so that jax.export(platforms=["cuda"]) still works.
  if _native.cuda_built():
    _native.ensure_registered()
  return jax.ffi.ffi_call(target, results, vmap_method=vmap_method,
                          has_side_effect=has_side_effect,
                          input_output_aliases=input_output_aliases)


def side_done_cuda(results: tuple, keep: tuple, *, comm_id: int) -> tuple:
  """`*_done` of a start/done pair (ffi/runtime/side_lane.h): XLA's stream waits for
  the start's kernels on the communicator's side stream. `results` (the
  start's outputs) come back aliased, so nothing reads them before the wait;
  `keep` (the start's inputs, the compute to overlap) are operands only, so
  XLA keeps them alive until here and computes them first."""
  shapes = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)
  out = _call("jax_ep_side_done", shapes, has_side_effect=True,
              input_output_aliases={i: i for i in range(len(results))})(
                  *results, *keep, comm_id=np.int64(comm_id))
  return tuple(out)


def layout_cuda(topk_idx: Array, *, num_experts: int, num_ranks: int,
                comm_id: int) -> tuple[Array, Array, Array, Array]:
  """get_dispatch_layout on the GPU.

  Args:
    topk_idx: [T, K] int32 expert ids in [-1, E).
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
  return tuple(_call("jax_ep_dispatch_layout", results)(
      topk_idx, comm_id=np.int64(comm_id), num_experts=np.int32(num_experts),
      num_ranks=np.int32(num_ranks)))


# Must match GgKind in ffi/kernels/grouped_gemm.h.
GG_FORWARD, GG_TRANS_W, GG_WEIGHT_GRAD, GG_FORWARD_FP8, GG_WEIGHT_GRAD_FP8 = 0, 1, 2, 3, 4


def grouped_gemm_cuda(a: Array, b: Array, group_sizes: Array, *, kind: int,
                      out_shape: tuple[int, ...], out_dtype, group_stride: int = 0,
                      num_sms: int = 0) -> Array:
  """One grouped product on the tensor cores (ffi/kernels/grouped_gemm.h).

  kind GG_FORWARD: a = x [M, H], b = w [G, H, F] -> [M, F];
  GG_TRANS_W: a = dy [M, F], b = w [G, H, F] -> [M, H];
  GG_WEIGHT_GRAD: a = x [M, H], b = dy [M, F] -> [G, H, F].
  With group_stride S > 0, a (and a row output) is [G, S, .] and group g
  is its first min(group_sizes[g], S) rows of slot g (the masked form).
  group_sizes [G] int32 stays on the device.
  """
  ws = _grouped_gemm_workspace_bytes(kind, jnp.dtype(out_dtype) == jnp.float32,
                                      group_sizes.shape[0])
  # Each batch element is an independent product -> sequential calls.
  out, _ = _call("jax_ep_grouped_gemm", (jax.ShapeDtypeStruct(out_shape, out_dtype),
                                         jax.ShapeDtypeStruct((ws,), jnp.uint8)))(
      a, b, group_sizes, kind=np.int32(kind), group_stride=np.int64(group_stride),
      num_sms=np.int32(num_sms))
  return out


def grouped_gemm_fp8_cuda(a: Array, a_scales: Array, b: Array, b_scales: Array,
                          group_sizes: Array, *, kind: int = GG_FORWARD_FP8,
                          group_stride: int = 0, num_sms: int = 0, schedule: int = 0) -> Array:
  """One FP8 grouped product (ffi/kernels/grouped_gemm.h); bf16 out.

  GG_FORWARD_FP8: a = xq [M, H] (or [G, S, H]) e4m3, a_scales [M, H/128]
  (or [G, S, H/128]) f32, b = wq [G, F, H] e4m3 (K-major), b_scales
  [G, H/128, F/128] -> [M, F] (or [G, S, F]).
  GG_WEIGHT_GRAD_FP8: a = xT [H, P], a_scales [P/128, H], b = dyT [F, P],
  b_scales [P/128, F], group_sizes padded to 128-token chunks -> [G, H, F].
  """
  g = group_sizes.shape[0]
  if kind == GG_WEIGHT_GRAD_FP8:
    out_shape = (g, a.shape[0], b.shape[0])
  else:
    out_shape = (*a.shape[:-1], b.shape[1])
  ws_bytes = _grouped_gemm_workspace_bytes(kind, False, g, schedule=schedule)
  out, _ = _call("jax_ep_grouped_gemm_fp8", (jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
                                             jax.ShapeDtypeStruct((ws_bytes,), jnp.uint8)))(
      a, a_scales, b, b_scales, group_sizes, kind=np.int32(kind), schedule=np.int32(schedule),
      group_stride=np.int64(group_stride), num_sms=np.int32(num_sms))
  return out


def fp8_cast_weights_cuda(w: Array) -> tuple[Array, Array, Array]:
  """w [G, H, F] bf16/f32 -> (q_nk [G, F, H], q_kn [G, H, F] e4m3, scales
  [G, H/128, F/128] f32): one pass, both orientations (kernels/fp8_cast.h)."""
  g, h, f = w.shape
  return _call("jax_ep_fp8_cast_weights", (
      jax.ShapeDtypeStruct((g, f, h), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((g, h, f), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((g, h // 128, f // 128), jnp.float32)))(w)


def fp8_cast_tokens_cuda(x: Array, chunk_src: Array, chunk_rows: Array) -> tuple[Array, Array]:
  """x [M, C] -> (qT [C, P] e4m3, scales [P/128, C] f32) with P = 128 *
  len(chunk_src): chunk k holds rows [chunk_src[k], + chunk_rows[k]) of x,
  then zeros (kernels/fp8_cast.h)."""
  c, p = x.shape[1], 128 * chunk_src.shape[0]
  return _call("jax_ep_fp8_cast_tokens", (
      jax.ShapeDtypeStruct((c, p), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((p // 128, c), jnp.float32)))(x, chunk_src, chunk_rows)


# CUTLASS keeps a few tensor maps per SM: sized for more SMs than any GPU
# has, the workspace fits whatever device and num_sms the call runs with.
_WORKSPACE_SMS = 1024


@functools.lru_cache(maxsize=None)
def _grouped_gemm_workspace_bytes(kind: int, out_f32: bool, num_groups: int,
                                  schedule: int = 0) -> int:
  return int(_native.module().grouped_gemm_workspace_bytes(kind, bool(out_f32), num_groups,
                                                           _WORKSPACE_SMS, schedule))
