"""Property-based GPU tests (hypothesis, derandomised so a failure repeats):
over random shapes, routings (−1 slots, skew, an empty rank), dtypes and
layouts, the CUDA dispatch equals the reference bit for bit (rows, ids,
weights, counts and the whole handle) and so does the combine of its rows.
The CPU variant is tests/test_properties.py."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import jax  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import _native  # noqa: E402
import oracle  # noqa: E402
from oracle import BF16, F32, bits  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and GPUs"),
]

if _native.cuda_available():
  import gpu_helpers as h

COMM_BYTES = 256 << 20
SETTINGS = dict(max_examples=12, deadline=None, derandomize=True, print_blob=True)


@pytest.fixture(scope="module")
def comm(gpu_comm):
  return gpu_comm


@st.composite
def cases(draw):
  e_per_rank = draw(st.integers(1, 8))
  k = draw(st.integers(1, 8))
  t = draw(st.integers(0, 300))
  h_ = draw(st.sampled_from([128, 256, 1024]))
  dtype = draw(st.sampled_from([BF16, F32]))
  layout = draw(st.sampled_from(["rank", "expert"]))
  mode = draw(st.sampled_from(["random", "random", "skewed", "empty_rank"]))
  drop = draw(st.sampled_from([0.0, 0.3]))
  seed = draw(st.integers(0, 2**31 - 1))
  return e_per_rank, k, t, h_, dtype, layout, mode, drop, seed


def _outputs(o):
  hd = o.handle
  return (o.recv_x, o.recv_topk_idx, o.recv_topk_weights, o.counts, hd.recv_src_rank,
          hd.recv_src_token, hd.recv_src_k, hd.recv_counts, hd.pos_in_rank)


@settings(**SETTINGS)
@given(cases())
def test_kernels_equal_the_reference_bitwise_over_random_cases(comm, case):
  e_per_rank, k, t, h_, dtype, layout, mode, drop, seed = case
  R = comm.num_ranks
  e = R * e_per_rank
  k = min(k, e)
  rng = np.random.default_rng(seed)
  idx, w = oracle.make_topk(rng, R, t, k, e, drop=drop, mode=mode)
  x = oracle.make_x(rng, (R, t, h_), dtype)

  def run(backend):
    def f(x, i, w):
      o = jax_ep.dispatch(x, i, w, num_experts=e, layout=layout, backend=backend)
      wts = o.recv_topk_weights if layout == "expert" else None
      y = jax_ep.combine(o.recv_x, o.handle, wts, backend=backend)
      return _outputs(o) + (y,)
    return h.per_rank_jit(comm.mesh, f)(*(h.put(comm.mesh, v) for v in (x, idx, w)))

  got, want = run("cuda"), run("reference")
  comm.check()
  names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "counts", "recv_src_rank",
           "recv_src_token", "recv_src_k", "recv_counts", "pos_in_rank", "combine")
  for name, a, b in zip(names, got, want):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape)
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"{name} {case}")
