"""Gradients (custom_vjp) of dispatch and combine: numerical checks with
jax.test_util.check_grads and explicit NumPy expectations, including the
gradient that reaches topk_weights through the received row weights."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_ep
import oracle
from conftest import sharded
from oracle import BF16

RTOL = 1e-5
ATOL = 1e-5


def _row_maps(exp_d):
    """{(s, t, k): (dest rank, row)} from the oracle's expert-layout dispatch."""
    m = {}
    for r, d in enumerate(exp_d):
        for row, info in enumerate(d.rows):
            if info is None:
                continue
            s, t, key = info
            m[(s, t, key[2])] = (r, row)
    return m


def _expert_loss_fn(R, E):
    """out = combine(recv_x * S, handle, weights=recv_topk_weights) (expert layout)."""

    def fn(x, i, tw, S):
        o = jax_ep.dispatch(x, i, tw, num_experts=E, axis_name="ep", layout="expert")
        return jax_ep.combine(o.recv_x * S, o.handle, o.recv_topk_weights, axis_name="ep")

    return sharded(R, fn)


def _rank_loss_fn(R, E):
    """(combine(recv_x * S, handle, V), recv_topk_weights) (rank layout)."""

    def fn(x, i, tw, S, V):
        o = jax_ep.dispatch(x, i, tw, num_experts=E, axis_name="ep", layout="rank")
        out = jax_ep.combine(o.recv_x * S, o.handle, V, axis_name="ep")
        return out, o.recv_topk_weights

    return sharded(R, fn)


@pytest.mark.parametrize("R,layout", [(1, "expert"), (2, "rank"), (4, "expert"), (4, "rank")])
def test_dispatch_combine_check_grads_rev_f32(layout, R):
    T, K, E, H = 8, 2, 8, 128
    rng = np.random.default_rng(9000 + R + len(layout))
    idx, tw = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), np.float32)
    if layout == "expert":
        C = oracle.default_capacity_expert(R, T, K, E // R, 1)
        S = rng.standard_normal((R, C, H)).astype(np.float32)
        f = _expert_loss_fn(R, E)
        g = lambda x, tw: f(x, idx, tw, S)  # noqa: E731
    else:
        C = R * T
        S = rng.standard_normal((R, C, H)).astype(np.float32)
        V = rng.uniform(-1, 1, (R, C)).astype(np.float32)
        f = _rank_loss_fn(R, E)

        def g(x, tw):
            out, rw = f(x, idx, tw, S, V)
            return out, jnp.tanh(rw)

    check_grads(g, (x, tw), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("R", [1, 4, 8])
def test_expert_layout_grad_into_x_and_topk_weights_matches_numpy(R):
    T, K, E, H = 16, 2, 16, 128
    rng = np.random.default_rng(9100 + R)
    idx, tw = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), np.float32)
    exp_d = oracle.dispatch_expert((x,), idx, tw, E)
    C = exp_d[0].payload[0].shape[0]
    S = rng.standard_normal((R, C, H)).astype(np.float32)
    G = rng.standard_normal((R, T, H)).astype(np.float32)
    f = _expert_loss_fn(R, E)
    dx, dtw = jax.grad(lambda x, tw: jnp.sum(G * f(x, idx, tw, S)), argnums=(0, 1))(x, tw)
    dx, dtw = np.asarray(dx), np.asarray(dtw)

    m = _row_maps(exp_d)
    ex_dx = np.zeros_like(x)
    ex_dtw = np.zeros_like(tw)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                if idx[s, t, k] < 0:
                    continue
                r, row = m[(s, t, k)]
                ex_dx[s, t] += tw[s, t, k] * S[r, row] * G[s, t]
                ex_dtw[s, t, k] = np.dot(G[s, t].astype(np.float64), (S[r, row] * x[s, t]).astype(np.float64))
    np.testing.assert_allclose(dx, ex_dx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dtw, ex_dtw, rtol=1e-4, atol=1e-4)
    assert not dtw[idx < 0].any(), "-1 slots get zero weight gradient"


@pytest.mark.parametrize("R", [2, 8])
def test_rank_layout_grad_into_x_and_topk_weights_matches_numpy(R):
    T, K, E, H = 16, 4, 8, 128
    rng = np.random.default_rng(9200 + R)
    idx, tw = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), np.float32)
    exp_d = oracle.dispatch_rank((x,), idx, tw, E)
    C = R * T
    S = rng.standard_normal((R, C, H)).astype(np.float32)
    V = rng.uniform(-1, 1, (R, C)).astype(np.float32)
    G = rng.standard_normal((R, T, H)).astype(np.float32)
    Wc = rng.standard_normal((R, C, K)).astype(np.float32)
    f = _rank_loss_fn(R, E)

    def loss(x, tw):
        out, rw = f(x, idx, tw, S, V)
        return jnp.sum(G * out) + jnp.sum(Wc * rw)

    dx, dtw = jax.grad(loss, argnums=(0, 1))(x, tw)
    dx, dtw = np.asarray(dx), np.asarray(dtw)

    El = E // R
    ex_dx = np.zeros_like(x)
    ex_dtw = np.zeros_like(tw)
    for s in range(R):
        for t in range(T):
            dests = sorted({int(e) // El for e in idx[s, t] if e >= 0})
            for r in dests:
                row = [i for i, info in enumerate(exp_d[r].rows) if info[:2] == (s, t)]
                assert len(row) == 1
                row = row[0]
                ex_dx[s, t] += V[r, row] * S[r, row] * G[s, t]
                for k in range(K):
                    if idx[s, t, k] >= 0 and int(idx[s, t, k]) // El == r:
                        ex_dtw[s, t, k] = Wc[r, row, k]
    np.testing.assert_allclose(dx, ex_dx, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dtw, ex_dtw, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_combine_vjp_wrt_rows_and_row_weights_matches_numpy(layout, weighted):
    R, T, K, E, H = 4, 16, 2, 8, 128
    rng = np.random.default_rng(9300 + len(layout) + weighted)
    idx, tw = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), np.float32)
    if layout == "rank":
        exp_d = oracle.dispatch_rank((x,), idx, tw, E)
    else:
        exp_d = oracle.dispatch_expert((x,), idx, tw, E)
    C = exp_d[0].payload[0].shape[0]
    y = oracle.make_x(rng, (R, C, H), np.float32)
    wr = rng.uniform(-1.5, 1.5, (R, C)).astype(np.float32)
    G = rng.standard_normal((R, T, H)).astype(np.float32)

    def fn(x, i, tw, y, wr):
        o = jax_ep.dispatch(x, i, tw, num_experts=E, axis_name="ep", layout=layout)
        return jax_ep.combine(y, o.handle, wr if weighted else None, axis_name="ep")

    f = sharded(R, fn)
    _, vjp = jax.vjp(lambda y, wr: f(x, idx, tw, y, wr), y, wr)
    dy, dwr = (np.asarray(a) for a in vjp(G))

    ex_dy = np.zeros_like(y)
    ex_dwr = np.zeros_like(wr)
    for r in range(R):
        for row, info in enumerate(exp_d[r].rows):
            if info is None:
                continue
            s, t, _ = info
            ex_dy[r, row] = (wr[r, row] if weighted else 1.0) * G[s, t]
            if weighted:
                ex_dwr[r, row] = np.dot(G[s, t].astype(np.float64), y[r, row].astype(np.float64))
    np.testing.assert_allclose(dy, ex_dy, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dwr, ex_dwr, rtol=1e-4, atol=1e-4)


def test_combine_check_grads_rev_f32_expert_layout():
    R, T, K, E, H = 2, 8, 2, 8, 128
    rng = np.random.default_rng(9400)
    idx, tw = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), np.float32)
    C = oracle.default_capacity_expert(R, T, K, E // R, 1)
    y = oracle.make_x(rng, (R, C, H), np.float32)
    wr = rng.uniform(-1.5, 1.5, (R, C)).astype(np.float32)

    def fn(x, i, tw, y, wr):
        o = jax_ep.dispatch(x, i, tw, num_experts=E, axis_name="ep", layout="expert")
        return jax_ep.combine(y, o.handle, wr, axis_name="ep")

    f = sharded(R, fn)
    check_grads(lambda y, wr: f(x, idx, tw, y, wr), (y, wr), order=1, modes=["rev"], atol=2e-2, rtol=2e-2)


def test_bf16_dispatch_combine_grad_has_bf16_dtype_and_matches_f32():
    R, T, K, E, H = 2, 16, 2, 8, 128
    rng = np.random.default_rng(9500)
    idx, tw = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)
    C = oracle.default_capacity_expert(R, T, K, E // R, 1)
    S = rng.standard_normal((R, C, H)).astype(np.float32)
    G = rng.standard_normal((R, T, H)).astype(np.float32)

    def fn(x, i, tw, S):
        o = jax_ep.dispatch(x, i, tw, num_experts=E, axis_name="ep", layout="expert")
        y = (o.recv_x.astype(jnp.float32) * S).astype(x.dtype)
        return jax_ep.combine(y, o.handle, o.recv_topk_weights, axis_name="ep")

    f = sharded(R, fn)
    loss = lambda x, tw: jnp.sum(G * f(x, idx, tw, S).astype(jnp.float32))  # noqa: E731
    dx, dtw = jax.grad(loss, argnums=(0, 1))(x, tw)
    assert dx.dtype == jnp.bfloat16 and dtw.dtype == jnp.float32
    dx32, dtw32 = jax.grad(loss, argnums=(0, 1))(x.astype(np.float32), tw)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx32), rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(np.asarray(dtw), np.asarray(dtw32), rtol=5e-2, atol=0.5)
