"""jax_ep.ops.regroup: rank-layout rows grouped by local expert on one rank
(the rows of an expert-layout dispatch, bitwise), the weighted sums back
against a NumPy oracle, and both gradients against plain autodiff."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from conftest import run_sharded
from jax_ep.ops import regroup


def _routing(rng, R, T, K, E, drop=0.2):
  idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(R)])
  idx = np.where(rng.uniform(size=idx.shape) < drop, -1, idx).astype(np.int32)
  w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
  return idx, w


@pytest.mark.parametrize("R,T,H,K,E,align", [(2, 16, 32, 4, 8, 1), (4, 9, 16, 3, 8, 4), (1, 7, 16, 2, 4, 1)])
def test_expert_rows_are_the_expert_layout_dispatch(R, T, H, K, E, align):
  rng = np.random.default_rng(R * 100 + T)
  idx, w = _routing(rng, R, T, K, E)
  x = rng.standard_normal((R, T, H)).astype(np.float32)

  def fn(x, i, w):
    r = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout="rank")
    g = regroup.group_by_expert(r.recv_topk_idx, num_local_experts=E // R, expert_alignment=align)
    e = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout="expert",
                        expert_alignment=align)
    return regroup.expert_rows(r.recv_x, g), g.counts, e.recv_x, e.counts

  rows, counts, want_rows, want_counts = run_sharded(R, fn, x, idx, w)
  np.testing.assert_array_equal(counts, want_counts)
  assert rows.shape == want_rows.shape
  np.testing.assert_array_equal(rows.view(np.uint32), want_rows.view(np.uint32))


def test_sum_expert_rows_is_the_weighted_sum_in_slot_order_and_both_gradients_match_autodiff():
  rng = np.random.default_rng(3)
  C, K, H, El = 12, 3, 8, 4
  ids = rng.integers(-1, El, size=(C, K)).astype(np.int32)
  w = rng.uniform(0.25, 1.5, size=(C, K)).astype(np.float32) * (ids >= 0)
  g = regroup.group_by_expert(jnp.asarray(ids), num_local_experts=El)
  x = rng.standard_normal((C, H)).astype(np.float32)
  y = rng.standard_normal((g.source.shape[0], H)).astype(np.float32)
  slot = np.asarray(g.slot)
  want = np.zeros((C, H), np.float32)
  for r in range(C):
    for k in range(K):
      if slot[r, k] >= 0:
        want[r] += np.float32(w[r, k]) * y[slot[r, k]]
  got = regroup.sum_expert_rows(jnp.asarray(y), g, jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)

  def plain_rows(x):  # what expert_rows computes, differentiated by JAX itself
    s = g.source
    return jnp.where((s >= 0)[:, None], jnp.take(x, jnp.maximum(s, 0), axis=0), 0.0)

  def plain_sum(y, w):
    terms = [jnp.where((g.slot[:, k] >= 0)[:, None], jnp.take(y, jnp.maximum(g.slot[:, k], 0), axis=0), 0.0)
             * w[:, k:k + 1] for k in range(K)]
    return sum(terms)

  ct_rows = rng.standard_normal(y.shape).astype(np.float32)
  ct_out = rng.standard_normal((C, H)).astype(np.float32)
  dx = jax.vjp(lambda x: regroup.expert_rows(x, g), jnp.asarray(x))[1](jnp.asarray(ct_rows))[0]
  dx_plain = jax.vjp(plain_rows, jnp.asarray(x))[1](jnp.asarray(ct_rows))[0]
  np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_plain), rtol=1e-5, atol=1e-5)
  dy, dw = jax.vjp(lambda y, w: regroup.sum_expert_rows(y, g, w), jnp.asarray(y), jnp.asarray(w))[1](
      jnp.asarray(ct_out))
  dy_plain, dw_plain = jax.vjp(plain_sum, jnp.asarray(y), jnp.asarray(w))[1](jnp.asarray(ct_out))
  np.testing.assert_allclose(np.asarray(dy), np.asarray(dy_plain), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_plain), rtol=1e-5, atol=1e-5)
  # Every grouped row is either padding or exactly one (row, slot) entry.
  entry = np.asarray(g.entry)
  assert sorted(entry[entry >= 0].tolist()) == sorted(np.flatnonzero(ids.reshape(-1) >= 0).tolist())
