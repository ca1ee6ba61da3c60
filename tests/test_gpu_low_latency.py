"""Low-latency dispatch / combine with backend="cuda" (the low-latency ops
over the normal CUDA kernels, jax_ep/ops/_low_latency_normal) against the
low-latency reference, on 2 GPUs: bitwise, fused and split."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep import _native
from oracle import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep built with CUDA and 2 GPUs"),
]

if _native.cuda_available():
  import gpu_helpers as h

COMM_BYTES = 1 << 30


@pytest.fixture(scope="module")
def comm(gpu_comm):
  return gpu_comm


@pytest.mark.parametrize("T,H,K,E,mt,fp8,split", [
    (128, 7168, 8, 256, 128, True, False),   # docs/design.md §6 low-latency shape
    (128, 7168, 8, 256, 128, False, True),
    (37, 2048, 6, 64, 64, True, True),
    (1, 128, 1, 8, 4, False, False),
    (0, 128, 2, 8, 4, False, False),
])
def test_low_latency_cuda_bitwise_equal_reference(comm, T, H, K, E, mt, fp8, split):
  R = comm.num_ranks
  rng = np.random.default_rng(T + H + K + E + mt + fp8 + 2 * split)
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
  w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
  x = (rng.standard_normal((R, T, H)) * 3).astype(jnp.bfloat16)
  y = (rng.standard_normal((R, E // R, R * mt, H))).astype(jnp.bfloat16)

  def per_rank(x, i, w, y):
    outs = []
    for backend in ("cuda", "reference"):
      kw = dict(num_experts=E, max_tokens=mt, fp8=fp8, backend=backend)
      if split:
        o = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(x, i, **kw))
        out = jax_ep.low_latency_combine_done(
            jax_ep.low_latency_combine_start(y, i, w, o.handle, backend=backend))
      else:
        o = jax_ep.low_latency_dispatch(x, i, **kw)
        out = jax_ep.low_latency_combine(y, i, w, o.handle, backend=backend)
      outs.append((o.recv_x, o.recv_count, o.handle.src_entry, out))
    return outs

  f = h.per_rank_jit(comm.mesh, per_rank)
  got, want = jax.block_until_ready(f(*(h.put(comm.mesh, np.asarray(v)) for v in (x, idx, w, y))))
  comm.check()
  lg, lw = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(lg) == len(lw)
  for i, (a, b) in enumerate(zip(lg, lw)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i}")
