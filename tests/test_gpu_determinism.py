"""Same inputs, same bits: dispatch + combine, the low-latency kernels and an
Engram fetch, 100 runs each, every run bitwise equal to the first (across
processes: tests/test_gpu_dispatch.py's multi-process test
compares each process with the reference)."""
from __future__ import annotations

import numpy as np
import pytest

import jax

import jax_ep
from jax_ep import _native
import oracle
from oracle import BF16, bits, stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and GPUs"),
]

if _native.cuda_available():
  import gpu_helpers as h

COMM_BYTES = 512 << 20
RUNS = 100


@pytest.fixture(scope="module")
def comm(gpu_comm):
  return gpu_comm


def _same_every_run(fn, args, what):
  first = [bits(np.asarray(v)) for v in jax.tree.leaves(jax.block_until_ready(fn(*args)))]
  for n in range(1, RUNS):
    again = [bits(np.asarray(v)) for v in jax.tree.leaves(fn(*args))]
    for i, (a, b) in enumerate(zip(first, again)):
      assert np.array_equal(a, b), f"{what}: run {n}, output {i} differs from run 0"


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_dispatch_combine_are_deterministic(comm, layout):
  R = comm.num_ranks
  rng = np.random.default_rng(stable_seed("determinism", layout))
  T, H, K, E = 512, 1024, 8, 16 * R
  idx, w = oracle.make_topk(rng, R, T, K, E)
  x = oracle.make_x(rng, (R, T, H), BF16)

  def f(x, i, w):
    o = jax_ep.dispatch(x, i, w, num_experts=E, layout=layout, backend="cuda")
    return o, jax_ep.combine(o.recv_x, o.handle, o.recv_topk_weights if layout == "expert" else None,
                             backend="cuda")
  _same_every_run(h.per_rank_jit(comm.mesh, f), [h.put(comm.mesh, v) for v in (x, idx, w)],
                  f"dispatch/combine ({layout})")
  comm.check()


def test_low_latency_kernels_are_deterministic(comm):
  R = comm.num_ranks
  rng = np.random.default_rng(stable_seed("determinism-ll"))
  T, H, K, E, M = 128, 2048, 8, 8 * R, 128
  idx, w = oracle.make_topk(rng, R, T, K, E)
  x = oracle.make_x(rng, (R, T, H), BF16)

  def f(x, i, w):
    d = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=M, backend="cuda")
    y = jax_ep.low_latency_combine(d.recv_x, i, w, d.handle, backend="cuda")
    # Rows past each expert's count are not written: compare the counted ones.
    rows = jax.numpy.arange(d.recv_x.shape[1])[None, :, None] < d.recv_count[:, None, None]
    return jax.numpy.where(rows, d.recv_x, 0), d.recv_count, y
  _same_every_run(h.per_rank_jit(comm.mesh, f), [h.put(comm.mesh, v) for v in (x, idx, w)],
                  "low-latency kernels")
  comm.check()


def test_engram_fetch_is_deterministic(comm):
  R = comm.num_ranks
  rng = np.random.default_rng(stable_seed("determinism-engram"))
  V, D, T, e = 4096, 128, 256, 8
  table = oracle.make_x(rng, (R, V, D), BF16)
  ids = rng.integers(-1, R * V, size=(R, T, e)).astype(np.int32)
  publish = h.per_rank_jit(comm.mesh, lambda t: jax_ep.engram_publish(t, backend="cuda"))
  p = jax.block_until_ready(publish(h.put(comm.mesh, table)))
  fetch = h.per_rank_jit(comm.mesh, lambda p, i: jax_ep.engram_fetch(p, i))
  _same_every_run(fetch, [p, h.put(comm.mesh, ids)], "engram fetch")
  comm.check()
