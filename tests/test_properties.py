"""Property-based tests (hypothesis): over random shapes, routings (with −1
slots, empty ranks, skew), dtypes, layouts and alignments, the reference's
dispatch equals the NumPy oracle bit for bit (rows and the whole handle:
pos_in_rank, recv_src_*, recv_counts) and its combine equals the
oracle's fixed-order f32 sum; the grouped matmul's reference equals the
float64 oracle over random group sizes. Each example compiles a new program,
so the example counts stay small; the seeds are derandomised so a failure
repeats."""
from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_ep  # noqa: E402
import oracle  # noqa: E402
from conftest import run_sharded  # noqa: E402
from oracle import BF16, F32, assert_fixed_order_exact, bits  # noqa: E402
from test_dispatch import assert_expert_layout, assert_rank_layout  # noqa: E402

SETTINGS = dict(max_examples=25, deadline=None, derandomize=True, print_blob=True)


@st.composite
def routings(draw):
  r = draw(st.sampled_from([1, 2, 4, 8]))
  e = r * draw(st.integers(1, 4))
  k = draw(st.integers(1, min(e, 4)))
  t = draw(st.integers(0, 24))
  h = draw(st.sampled_from([8, 128, 256]))
  dtype = draw(st.sampled_from([BF16, F32]))
  mode = draw(st.sampled_from(["random", "random", "skewed", "empty_rank", "all_invalid"]))
  drop = draw(st.sampled_from([0.0, 0.3]))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  idx, w = oracle.make_topk(rng, r, t, k, e, drop=drop, mode=mode)
  x = oracle.make_x(rng, (r, t, h), dtype)
  return r, e, t, x, idx, w, rng


@settings(**SETTINGS)
@given(routings(), st.sampled_from(["rank", "expert"]), st.sampled_from([1, 3, 8]))
def test_dispatch_reference_equals_oracle_bitwise(case, layout, align):
  r, e, t, x, idx, w, _ = case
  kw = dict(layout=layout) if layout == "rank" else dict(layout=layout, expert_alignment=align)

  def fn(x, i, w):
    o = jax_ep.dispatch(x, i, w, num_experts=e, axis_name="ep", **kw)
    hd = o.handle
    return (o.recv_x, o.recv_topk_idx, o.recv_topk_weights, o.counts,
            dict(recv_src_rank=hd.recv_src_rank, recv_src_token=hd.recv_src_token,
                 recv_src_k=hd.recv_src_k, recv_counts=hd.recv_counts,
                 pos_in_rank=hd.pos_in_rank))

  *out, handle = run_sharded(r, fn, x, idx, w)
  c = out[0].shape[1]
  if layout == "rank":
    exp = oracle.dispatch_rank((x,), idx, w, e)
    assert_rank_layout(out, exp, c)
  else:
    exp = oracle.dispatch_expert((x,), idx, w, e, align)
    assert_expert_layout(out, exp, c)
  # The whole handle, not only what combine happens to read.
  want = oracle.dispatch_handle(exp, idx, e, layout, c)
  for name, value in want.items():
    np.testing.assert_array_equal(handle[name], value, err_msg=name)


@settings(**SETTINGS)
@given(routings(), st.sampled_from(["rank", "expert"]))
def test_combine_reference_equals_fixed_order_oracle(case, layout):
  r, e, t, x, idx, w, rng = case
  exp_d = (oracle.dispatch_rank((x,), idx, w, e) if layout == "rank"
           else oracle.dispatch_expert((x,), idx, w, e, 1))
  c = exp_d[0].payload[0].shape[0]
  y = oracle.make_x(rng, (r, c, x.shape[-1]), x.dtype)
  rw = rng.uniform(-1.5, 1.5, size=(r, c)).astype(np.float32)

  def fn(x, i, w, y, rw):
    o = jax_ep.dispatch(x, i, w, num_experts=e, axis_name="ep", layout=layout)
    return jax_ep.combine(y, o.handle, rw, axis_name="ep")

  got = run_sharded(r, fn, x, idx, w, y, rw)
  rows = [d.rows for d in exp_d]
  assert_fixed_order_exact(got, lambda mode: oracle.combine(y, rows, rw, t, mode=mode))


@settings(**SETTINGS)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 16),
       st.sampled_from([8, 24]), st.sampled_from([8, 16]), st.integers(0, 2**31 - 1))
def test_grouped_matmul_reference_equals_float64_oracle(sizes, tail, h, f, seed):
  rng = np.random.default_rng(seed)
  m = sum(sizes) + tail
  x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((len(sizes), h, f)) / np.sqrt(h), jnp.bfloat16)
  out = jax_ep.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32)
  want = oracle.grouped_matmul(x, w, sizes)
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-5)
  assert not np.asarray(out)[sum(sizes):].any()
