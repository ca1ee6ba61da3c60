"""Run by test_gpu_low_latency.py in a fresh process (XLA reads XLA_FLAGS
once): a jitted decode loop of low-latency dispatch -> expert stand-in ->
combine on the kernels (backend="cuda"), against the same loop on the reference; prints one line
"LL_CMDBUF equal=<bool> us_per_step=<float>"."""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_helpers as h  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep.comm import Communicator  # noqa: E402
from oracle import bits  # noqa: E402


def main() -> int:
  n = int(os.environ.get("JAX_EP_TEST_GPUS", "2"))
  devs = jax.devices("cuda")[:n]
  mesh = jax.sharding.Mesh(np.array(devs), (h.AXIS,))
  R, T, H, K, E, M, STEPS = n, 64, 1024, 4, 32, 64, 8
  rng = np.random.default_rng(5)
  x0 = (rng.standard_normal((R, T, H))).astype(jnp.bfloat16)
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
  w = rng.uniform(0.25, 0.5, size=(R, T, K)).astype(np.float32)

  def loop(kernels):
    def per_rank(x, i, wt):
      def step(_, x):
        backend = "cuda" if kernels else "reference"
        if os.environ.get("LL_SPLIT") == "1":
          o = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(
              x, i, num_experts=E, max_tokens=M, backend=backend))
          return jax_ep.low_latency_combine_done(jax_ep.low_latency_combine_start(
              o.recv_x * 2, i, wt, o.handle, backend=backend))
        o = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=M, backend=backend)
        return jax_ep.low_latency_combine(o.recv_x * 2, i, wt, o.handle, backend=backend)
      return lax.fori_loop(0, STEPS, step, x)
    return h.per_rank_jit(mesh, per_rank)

  with Communicator.create(mesh, h.AXIS, 256 << 20) as comm:
    args = [h.put(mesh, v) for v in (x0, idx, w)]
    got = np.asarray(jax.block_until_ready(loop(True)(*args)))
    want = np.asarray(jax.block_until_ready(loop(False)(*args)))
    comm.check()
    f = loop(True)
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(20):
      jax.block_until_ready(f(*args))
    us = (time.perf_counter() - t0) / 20 / STEPS * 1e6
  print(f"LL_CMDBUF equal={bool(np.array_equal(bits(got), bits(want)))} us_per_step={us:.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
