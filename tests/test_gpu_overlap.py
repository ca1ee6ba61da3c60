"""dispatch_start/done and combine_start/done on the GPUs: the kernels run on
the communicator's side stream, a matmul runs on XLA's stream meanwhile, and
every result equals the fused ops' bit for bit (which the GPU suite checks
against the reference); misuse gives a clear error and the next call works."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep import _native
from oracle import stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and GPUs"),
]

if _native.cuda_available():
  import gpu_helpers as h

COMM_BYTES = 1 << 30


@pytest.fixture(scope="module")
def comm(gpu_comm):
  return gpu_comm


def _bits(a) -> np.ndarray:
  a = np.ascontiguousarray(np.asarray(a))
  return a.view(np.uint8)


def _step(split: bool, E: int, layout: str, fp8: bool):
  """dispatch -> rows * 1.5 -> combine, with a bf16 matmul (a 'shared expert')
  that the split form runs between each start and done."""
  def fn(x, idx, w, a, b):
    if split:
      p = jax_ep.dispatch_start(x, idx, w, num_experts=E, layout=layout, fp8=fp8,
                                backend="cuda")
      p, (a2, b2) = jax_ep.ordered_after(p, (a, b))
      shared = a2 @ b2
      o = jax_ep.dispatch_done(p, after=shared)
    else:
      o = jax_ep.dispatch(x, idx, w, num_experts=E, layout=layout, fp8=fp8, backend="cuda")
      shared = a @ b
    rows = jax_ep.dequantize(*o.recv_x) if fp8 else o.recv_x
    y = (rows.astype(jnp.float32) * 1.5).astype(jnp.bfloat16)
    cw = o.recv_topk_weights if layout == "expert" else None
    if split:
      pc = jax_ep.combine_start(y, o.handle, cw, backend="cuda")
      pc, s2 = jax_ep.ordered_after(pc, shared)
      shared2 = s2 @ b
      out = jax_ep.combine_done(pc, after=shared2)
    else:
      out = jax_ep.combine(y, o.handle, cw, backend="cuda")
      shared2 = shared @ b
    return out, shared2, o.recv_topk_idx, o.counts, o.handle.recv_src_token
  return fn


@pytest.mark.parametrize("layout,fp8,T", [("rank", False, 512), ("expert", False, 512),
                                          ("expert", True, 256), ("rank", False, 0)])
def test_split_ops_equal_the_fused_ops_with_a_matmul_between(comm, layout, fp8, T):
  R, H, K, E, M = comm.num_ranks, 1024, 4, 8 * comm.num_ranks, 1024
  rng = np.random.default_rng(stable_seed("overlap", layout, fp8, T, R))
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)]).astype(np.int32)
  x = rng.standard_normal((R, T, H)).astype(jnp.bfloat16)
  w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
  a = (rng.standard_normal((R, M, M)) / 32).astype(jnp.bfloat16)
  b = (rng.standard_normal((R, M, M)) / 32).astype(jnp.bfloat16)
  args = [h.put(comm.mesh, v) for v in (x, idx, w, a, b)]
  fused = h.per_rank_jit(comm.mesh, _step(False, E, layout, fp8))
  split = h.per_rank_jit(comm.mesh, _step(True, E, layout, fp8))
  want = jax.block_until_ready(fused(*args))
  for _ in range(3):  # again: the side lane is reusable, and nothing is left pending
    got = jax.block_until_ready(split(*args))
    for g, e in zip(got, want):
      np.testing.assert_array_equal(_bits(g), _bits(e))
  comm.check()


def test_split_ops_in_a_scan_of_many_steps(comm):
  R, T, H, K, E = comm.num_ranks, 256, 512, 4, 4 * comm.num_ranks
  rng = np.random.default_rng(stable_seed("overlap-scan", R))
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)]).astype(np.int32)
  x = rng.standard_normal((R, T, H)).astype(jnp.bfloat16)
  w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
  a = (rng.standard_normal((R, 512, 512)) / 16).astype(jnp.bfloat16)

  def loop(split):
    def fn(x, idx, w, a):
      def body(c, _):
        y, _, _, _, _ = _step(split, E, "expert", False)(c, idx, w, a, a)
        return y, None
      return jax.lax.scan(body, x, None, length=50)[0]
    return h.per_rank_jit(comm.mesh, fn)

  args = [h.put(comm.mesh, v) for v in (x, idx, w, a)]
  want = jax.block_until_ready(loop(False)(*args))
  got = jax.block_until_ready(loop(True)(*args))
  np.testing.assert_array_equal(_bits(got), _bits(want))
  comm.check()


def test_an_op_between_start_and_done_is_refused_and_the_next_pair_works(comm):
  R, T, H, K, E = comm.num_ranks, 64, 256, 2, 2 * comm.num_ranks
  rng = np.random.default_rng(stable_seed("overlap-misuse", R))
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)]).astype(np.int32)
  x = rng.standard_normal((R, T, H)).astype(jnp.bfloat16)

  def bad(x, idx):
    p = jax_ep.dispatch_start(x, idx, None, num_experts=E, backend="cuda")
    p, x2 = jax_ep.ordered_after(p, x)  # the second dispatch after the start
    o2 = jax_ep.dispatch(x2, idx, None, num_experts=E, backend="cuda")
    return jax_ep.dispatch_done(p, after=o2.recv_x).recv_x + o2.recv_x

  args = [h.put(comm.mesh, v) for v in (x, idx)]
  with pytest.raises(Exception, match="no matching \\*_done yet"):
    jax.block_until_ready(h.per_rank_jit(comm.mesh, bad)(*args))

  def good(x, idx):
    return jax_ep.dispatch_done(jax_ep.dispatch_start(x, idx, None, num_experts=E,
                                                      backend="cuda")).recv_x

  def fused(x, idx):
    return jax_ep.dispatch(x, idx, None, num_experts=E, backend="cuda").recv_x

  # The refusal ended that program before its done; it freed the lane, so
  # the next pair works.
  got = jax.block_until_ready(h.per_rank_jit(comm.mesh, good)(*args))
  want = jax.block_until_ready(h.per_rank_jit(comm.mesh, fused)(*args))
  np.testing.assert_array_equal(_bits(got), _bits(want))
  comm.check()
