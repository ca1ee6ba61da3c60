"""Wrappers of ffi/handlers/low_latency.cc, the dedicated low-latency kernels.

  "jax_ep_ll_dispatch": (x [T, H] bf16, topk_idx [T, K]) -> recv_x
    [E_l, R*M, H] (bf16, or e4m3 + f32 scales [E_l, R*M, H/128] with fp8),
    recv_count [E_l], src_entry [E_l, R*M]; rows past a count are not written.
  "jax_ep_ll_combine": (y [E_l, R*M, H] bf16, src_entry, recv_count,
    topk_idx, topk_weights) -> out [T, H] bf16.
  "*_send" / "*_recv": each op in two calls for *_start / *_done; the send
    returns an s32 [1] token (no data) that its receive takes, so XLA keeps
    them in order and may place other work between.

Every call is marked side-effecting, so XLA keeps them in program order (the
kernels' sequence numbers assume every rank runs the same calls in the same
order, and the split halves of one op must alternate). num_sms: at most this
many SMs (0: one CTA per local expert or per 16 tokens, at most every SM).
Window layout: `jax_ep._window.low_latency_bytes`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._ffi import call

Array = jax.Array

# The kernels' count words hold a (expert, source) row count in 16 bits
# (kLlMaxTokens in ffi/kernels/low_latency.cuh).
MAX_TOKENS = 0xFFFF

_TOKEN = jax.ShapeDtypeStruct((1,), jnp.int32)


def _common(comm_id, num_experts, max_tokens, reserved_bytes, num_sms) -> dict:
  return dict(comm_id=np.int64(comm_id), num_experts=np.int32(num_experts),
              max_tokens=np.int32(max_tokens), reserved_bytes=np.int64(reserved_bytes),
              num_sms=np.int32(num_sms))


def _dispatch_results(h, *, num_experts, max_tokens, num_ranks, fp8):
  e_l = num_experts // num_ranks
  m_all = num_ranks * max_tokens
  return (jax.ShapeDtypeStruct((e_l, m_all, h), jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
          jax.ShapeDtypeStruct((e_l, m_all, h // 128) if fp8 else (0,), jnp.float32),
          jax.ShapeDtypeStruct((e_l,), jnp.int32), jax.ShapeDtypeStruct((e_l, m_all), jnp.int32))


def _dispatch_outputs(out, fp8):
  recv_x, recv_scales, recv_count, src_entry = out
  return ((recv_x, recv_scales) if fp8 else recv_x), recv_count, src_entry


def dispatch(x: Array, topk_idx: Array, *, num_experts: int, max_tokens: int, num_ranks: int,
             comm_id: int, fp8: bool = False, ue8m0: bool = False, reserved_bytes: int = 0,
             num_sms: int = 0):
  """(recv_x, recv_count, src_entry); recv_x is (e4m3, scales) with fp8."""
  res = _dispatch_results(x.shape[1], num_experts=num_experts, max_tokens=max_tokens,
                          num_ranks=num_ranks, fp8=fp8)
  out = call("jax_ep_ll_dispatch", res, vmap_method=None, has_side_effect=True)(
      x, topk_idx.astype(jnp.int32), fp8=np.int32(fp8), ue8m0=np.int32(ue8m0),
      **_common(comm_id, num_experts, max_tokens, reserved_bytes, num_sms))
  return _dispatch_outputs(out, fp8)


def dispatch_send(x: Array, topk_idx: Array, *, num_experts: int, max_tokens: int, comm_id: int,
                  fp8: bool = False, ue8m0: bool = False, reserved_bytes: int = 0,
                  num_sms: int = 0) -> Array:
  """The send half of dispatch; returns the token its receive takes."""
  return call("jax_ep_ll_dispatch_send", _TOKEN, vmap_method=None, has_side_effect=True)(
      x, topk_idx.astype(jnp.int32), fp8=np.int32(fp8), ue8m0=np.int32(ue8m0),
      **_common(comm_id, num_experts, max_tokens, reserved_bytes, num_sms))


def dispatch_recv(token: Array, *, num_tokens: int, topk: int, hidden: int, num_experts: int,
                  max_tokens: int, num_ranks: int, comm_id: int, fp8: bool = False,
                  reserved_bytes: int = 0, num_sms: int = 0):
  """The receive half: as dispatch's result."""
  res = _dispatch_results(hidden, num_experts=num_experts, max_tokens=max_tokens,
                          num_ranks=num_ranks, fp8=fp8)
  out = call("jax_ep_ll_dispatch_recv", res, vmap_method=None, has_side_effect=True)(
      token, fp8=np.int32(fp8), num_tokens=np.int32(num_tokens), topk=np.int32(topk),
      hidden=np.int32(hidden), **_common(comm_id, num_experts, max_tokens, reserved_bytes,
                                         num_sms))
  return _dispatch_outputs(out, fp8)


def combine(y: Array, src_entry: Array, recv_count: Array, topk_idx: Array, topk_weights: Array,
            *, num_experts: int, max_tokens: int, comm_id: int, reserved_bytes: int = 0,
            num_sms: int = 0) -> Array:
  """out [T, H] bf16."""
  t = topk_idx.shape[0]
  return call("jax_ep_ll_combine", jax.ShapeDtypeStruct((t, y.shape[-1]), jnp.bfloat16),
              vmap_method=None, has_side_effect=True)(
      y, src_entry.astype(jnp.int32), recv_count.astype(jnp.int32), topk_idx.astype(jnp.int32),
      topk_weights.astype(jnp.float32),
      **_common(comm_id, num_experts, max_tokens, reserved_bytes, num_sms))


def combine_send(y: Array, src_entry: Array, recv_count: Array, topk_idx: Array, *,
                 num_experts: int, max_tokens: int, comm_id: int, reserved_bytes: int = 0,
                 num_sms: int = 0) -> Array:
  """The send half of combine (rows back to their tokens); a token."""
  return call("jax_ep_ll_combine_send", _TOKEN, vmap_method=None, has_side_effect=True)(
      y, src_entry.astype(jnp.int32), recv_count.astype(jnp.int32), topk_idx.astype(jnp.int32),
      **_common(comm_id, num_experts, max_tokens, reserved_bytes, num_sms))


def combine_recv(token: Array, topk_idx: Array, topk_weights: Array, *, hidden: int,
                 num_experts: int, max_tokens: int, comm_id: int, reserved_bytes: int = 0,
                 num_sms: int = 0) -> Array:
  """The receive half: out [T, H] bf16."""
  t = topk_idx.shape[0]
  return call("jax_ep_ll_combine_recv", jax.ShapeDtypeStruct((t, hidden), jnp.bfloat16),
              vmap_method=None, has_side_effect=True)(
      token, topk_idx.astype(jnp.int32), topk_weights.astype(jnp.float32),
      hidden=np.int32(hidden), **_common(comm_id, num_experts, max_tokens, reserved_bytes,
                                         num_sms))
