"""combine: weighted reduction of rows back to their source tokens, f32
accumulation in the fixed order (destination rank, local expert, k), checked
exactly against a NumPy float32 loop in the same order."""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded
from oracle import BF16, F32, assert_fixed_order_exact, bits

F16 = np.dtype(np.float16)


def _combine(R, E, T, x, idx, w, y, rw, *, layout, weights_mode, align=1):
    """Dispatch for the routing (handle), then combine y with the chosen weights."""

    def fn(x, i, w, y, rw):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout=layout,
                            expert_alignment=align)
        if weights_mode == "none":
            weights = None
        elif weights_mode == "recv":
            weights = o.recv_topk_weights
        else:
            weights = rw
        return jax_ep.combine(y, o.handle, weights, axis_name="ep")

    return run_sharded(R, fn, x, idx, w, y, rw)


CASES = [
    # R, T, K, E, H, dtype, layout, weights, mode, align
    (1, 16, 2, 8, 128, F32, "rank", "row", "random", 1),
    (2, 33, 4, 8, 256, BF16, "rank", "none", "random", 1),
    (4, 16, 2, 16, 128, BF16, "rank", "row", "random", 1),
    (4, 16, 4, 8, 128, F32, "rank", "row", "random", 1),
    (8, 33, 2, 32, 128, F32, "rank", "row", "random", 1),
    (8, 16, 4, 8, 128, BF16, "rank", "none", "empty_rank", 1),
    (2, 16, 2, 8, 128, BF16, "rank", "row", "skewed", 1),
    (1, 16, 2, 8, 128, F32, "expert", "recv", "random", 1),
    (2, 33, 4, 8, 256, BF16, "expert", "recv", "random", 1),
    (4, 16, 4, 8, 128, F32, "expert", "row", "random", 4),
    (8, 33, 2, 32, 128, BF16, "expert", "recv", "random", 1),
    (8, 16, 4, 16, 128, F16, "expert", "none", "random", 2),
    (4, 16, 2, 8, 128, BF16, "expert", "recv", "empty_rank", 1),
    (2, 16, 2, 8, 128, F32, "expert", "recv", "skewed", 3),
    (8, 1, 1, 8, 128, F32, "expert", "recv", "random", 1),
]


def _id(c):
    return "-".join(str(getattr(v, "name", v)) for v in c)


@pytest.mark.parametrize("R,T,K,E,H,dtype,layout,wmode,mode,align", CASES, ids=[_id(c) for c in CASES])
def test_combine_equals_fixed_order_f32_sum_exactly(R, T, K, E, H, dtype, layout, wmode, mode, align):
    rng = np.random.default_rng(8000 + R * 13 + T + K * 3 + E + H + align + len(layout + wmode))
    idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
    x = oracle.make_x(rng, (R, T, H), dtype)
    if layout == "rank":
        exp_d = oracle.dispatch_rank((x,), idx, w, E)
    else:
        exp_d = oracle.dispatch_expert((x,), idx, w, E, align)
    C = exp_d[0].payload[0].shape[0]
    # rows (padding rows included) carry arbitrary nonzero data: padding must be ignored
    y = oracle.make_x(rng, (R, C, H), dtype)
    rw = rng.uniform(-1.5, 1.5, size=(R, C)).astype(np.float32)
    got = _combine(R, E, T, x, idx, w, y, rw, layout=layout, weights_mode=wmode, align=align)
    if wmode == "none":
        weights = None
    elif wmode == "recv":
        weights = np.stack([d.topk_weights for d in exp_d])
    else:
        weights = rw
    rows = [d.rows for d in exp_d]
    assert_fixed_order_exact(got, lambda mode: oracle.combine(y, rows, weights, T, mode=mode))


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_combine_tokens_without_rows_are_zero(layout):
    R, T, K, E, H = 4, 16, 2, 8, 128
    rng = np.random.default_rng(8100 + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E, drop=0.0)
    idx[:, ::3] = -1  # every third token of every rank routes nowhere
    idx[1] = -1  # and rank 1 routes nothing at all
    x = oracle.make_x(rng, (R, T, H), BF16)
    C = R * T if layout == "rank" else R * T * min(K, E // R)
    y = oracle.make_x(rng, (R, C, H), BF16)
    rw = rng.uniform(0.5, 1.5, size=(R, C)).astype(np.float32)
    got = _combine(R, E, T, x, idx, w, y, rw, layout=layout, weights_mode="row")
    assert got.dtype == BF16 and got.shape == (R, T, H)
    dead = (idx < 0).all(-1)
    assert not got.astype(np.float32)[dead].any()
    assert got.astype(np.float32)[~dead].any()


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_dispatch_then_unweighted_combine_counts_copies_of_x(layout):
    """combine(recv_x) with unit weights returns x times the number of rows of t."""
    R, T, K, E, H = 4, 16, 4, 16, 128
    rng = np.random.default_rng(8200 + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E)
    # small integers: sums are exact in any order
    x = rng.integers(-8, 9, size=(R, T, H)).astype(np.float32)

    def fn(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout=layout)
        return jax_ep.combine(o.recv_x, o.handle, axis_name="ep")

    got = run_sharded(R, fn, x, idx, w)
    El = E // R
    if layout == "rank":
        n = np.array([[len({int(e) // El for e in idx[s, t] if e >= 0}) for t in range(T)] for s in range(R)])
    else:
        n = (idx >= 0).sum(-1)
    np.testing.assert_array_equal(got, x * n[..., None].astype(np.float32))


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_combine_order_is_ascending_rank_where_f32_order_matters(layout):
    """Values 1, 1e8, -1e8 on ranks 1, 2, 3 sum to 0 in ascending rank order
    ((1 + 1e8) - 1e8: the 1 is absorbed) and to 1 in any order that adds the
    two large values first: a combine that reduces in another order fails."""
    R, T, K, E, H = 4, 1, 3, 4, 8
    idx = np.full((R, T, K), -1, np.int32)
    idx[0, 0] = [3, 1, 2]                       # slot order differs from rank order on purpose
    w = np.ones((R, T, K), np.float32)
    x = np.ones((R, T, H), F32)
    C = 1                                       # one row per destination rank, either layout
    y = np.zeros((R, C, H), F32)
    y[1, 0], y[2, 0], y[3, 0] = 1.0, 1e8, -1e8

    def fn(x, i, w, y):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout=layout, capacity=C)
        return jax_ep.combine(y, o.handle, None, axis_name="ep")

    got = run_sharded(R, fn, x, idx, w, y)
    assert got.dtype == F32
    np.testing.assert_array_equal(got[0, 0], np.zeros(H, F32))
    assert np.float32(np.float32(-1e8) + np.float32(1e8)) + np.float32(1) == 1  # the other order


# --------------------------------------------------------------------------- order-sensitive, weighted

_BIG = np.float32(1e8)  # ulp 8: a 1 added to +-1e8 is lost


@functools.lru_cache(maxsize=None)
def _order_terms(n: int) -> np.ndarray:
    """Terms v[p, c] (f32) of a token's n rows, p its row's place in the
    contract's order, one column per check; zeros elsewhere.

    - every pair 1 <= i < j < n: -1e8 at place 0, 1e8 at i, 1 at j. In the
      order 0, i, j the large ones cancel first and the column sums to 1; an
      order that adds j before i, or 0 after j, adds the 1 to a 1e8 (lost): 0.
    - 1 at place 0, 1e8 at 1, -1e8 at 2: sums to 0 in order (the 1 is lost),
      to 1 where 0 is added after both 1 and 2.
    Together they tell the contract's order from every other one but the
    swap of the first two rows, which no float sum can see (a + b == b + a).
    """
    cols = []
    for i, j in itertools.combinations(range(1, n), 2):
        c = np.zeros(n, np.float32)
        c[0], c[i], c[j] = -_BIG, _BIG, 1
        cols.append(c)
    if n >= 3:
        c = np.zeros(n, np.float32)
        c[0], c[1], c[2] = 1, _BIG, -_BIG
        cols.append(c)
    return np.stack(cols, axis=1) if cols else np.zeros((n, 0), np.float32)


def _f32_sum_in_order(v: np.ndarray, order) -> np.ndarray:
    """v[p, c] summed over p in `order` (f32 adds); order [P, n] -> [P, c]."""
    order = np.asarray(order)
    acc = np.zeros((order.shape[0], v.shape[1]), np.float32)
    for step in range(order.shape[1]):
        acc = (acc + v[order[:, step]]).astype(np.float32)
    return acc


@pytest.mark.parametrize("n", [3, 4, 5, 8, 9])
def test_order_terms_tell_every_other_order_apart(n):
    """The premise of the test below, checked by brute force over all n! orders."""
    v = _order_terms(n)
    perms = np.array(list(itertools.permutations(range(n))), np.int8)
    sums = _f32_sum_in_order(v, perms)
    want = _f32_sum_in_order(v, [list(range(n))])[0]
    same = (bits(sums) == bits(want)[None]).all(axis=1)
    swap01 = [1, 0] + list(range(2, n))
    allowed = {tuple(range(n)), tuple(swap01)}
    assert {tuple(int(q) for q in p) for p in perms[same]} == allowed


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("R", [4, 8])
def test_weighted_combine_order_is_the_contracts_where_f32_order_matters(R, layout):
    """Weighted float32 combine at R >= 4 with terms -1e8, 1e8, 1 (as
    weight x row; powers-of-two weights, so every product is exact) placed
    so that any summation order of a token's rows other than the contract's
    (ascending rank of the row, then local expert) changes some column;
    checked bitwise against tests/oracle.py and against the sums the
    construction predicts."""
    T = 6
    E, K = 2 * R, R + 1
    rng = np.random.default_rng(oracle.stable_seed("weighted-order", R, layout))
    # Every token: one expert on every rank, the other expert of one rank
    # too, in shuffled slots (slot order is not the contract's order);
    # every third token loses one slot.
    idx = np.full((R, T, K), -1, np.int32)
    for s in range(R):
        for t in range(T):
            ids = [2 * j + int(rng.integers(2)) for j in range(R)]
            j = int(rng.integers(R))
            ids.append(2 * j + 1 - ids[j] % 2)
            idx[s, t] = rng.permutation(ids)
            if t % 3 == 2:
                idx[s, t, int(rng.integers(K))] = -1
    w = np.ones((R, T, K), np.float32)
    x = np.ones((R, T, 8), F32)
    exp_d = (oracle.dispatch_rank((x,), idx, w, E) if layout == "rank"
             else oracle.dispatch_expert((x,), idx, w, E))
    C = exp_d[0].payload[0].shape[0]
    H = _order_terms(R + 1).shape[1]
    rw = rng.choice(np.float32([0.25, 0.5, 2.0, 4.0]), size=(R, C)).astype(np.float32)
    y = np.full((R, C, H), 3 * _BIG, F32)  # padding rows: never summed
    rows = [d.rows for d in exp_d]
    per_token: dict = {}
    for r in range(R):
        for row, info in enumerate(rows[r]):
            if info is not None:
                per_token.setdefault(info[:2], []).append((info[2], r, row))
    want = np.zeros((R, T, H), F32)
    ns = set()
    for (s, t), lst in per_token.items():
        lst.sort()
        n = len(lst)
        ns.add(n)
        v = np.zeros((n, H), F32)
        v[:, :_order_terms(n).shape[1]] = _order_terms(n)
        for p, (_, r, row) in enumerate(lst):
            y[r, row] = v[p] / rw[r, row]
        want[s, t] = _f32_sum_in_order(v, [list(range(n))])[0]
    assert min(ns) >= 3 and max(ns) == (R if layout == "rank" else R + 1)

    got = _combine(R, E, T, x, idx, w, y, rw, layout=layout, weights_mode="row")
    assert got.dtype == F32
    assert_fixed_order_exact(got, lambda mode: oracle.combine(y, rows, rw, T, mode=mode))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_combine_starts_from_minus_zero_so_all_minus_zero_rows_give_minus_zero(layout):
    """The sum starts from -0.0, the exact additive identity (docs/design.md
    §2): a token whose every row product is -0.0 gets -0.0; starting from
    +0.0 would give +0.0 there. Tokens with no rows get +0.0. Pinned bitwise
    against the oracle, which starts from -0.0 too."""
    R, T, K, E, H = 4, 16, 2, 8, 128
    rng = np.random.default_rng(8200 + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E, drop=0.0)
    idx[:, 1] = -1                                   # token 1 of every rank: no rows
    x = oracle.make_x(rng, (R, T, H), F32)
    exp_d = oracle.dispatch_rank((x,), idx, w, E) if layout == "rank" else oracle.dispatch_expert((x,), idx, w, E)
    C = exp_d[0].payload[0].shape[0]
    y = oracle.make_x(rng, (R, C, H), F32)
    rw = rng.uniform(0.5, 1.5, size=(R, C)).astype(np.float32)
    neg_tokens = {(s, 0) for s in range(R)} | {(s, 5) for s in range(R)}
    for r, d in enumerate(exp_d):                    # every row of those tokens: -0.0
        for row, info in enumerate(d.rows):
            if info is not None and (info[0], info[1]) in neg_tokens:
                y[r, row] = -0.0
    got = _combine(R, E, T, x, idx, w, y, rw, layout=layout, weights_mode="row")
    rows = [d.rows for d in exp_d]
    assert_fixed_order_exact(got, lambda mode: oracle.combine(y, rows, rw, T, mode=mode))
    sign = np.signbit(got)
    for s, t in neg_tokens:
        assert sign[s, t].all() and not got[s, t].any(), (s, t)
    assert not sign[:, 1].any() and not got[:, 1].any()   # no rows: +0.0
