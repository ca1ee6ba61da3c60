"""get_dispatch_layout: per-rank / per-expert token counts and the token→rank mask."""
from __future__ import annotations

import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded


def _layout(R, E, idx):
    def fn(i):
        lay = jax_ep.get_dispatch_layout(i, num_experts=E, axis_name="ep")
        return (lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank)

    return run_sharded(R, fn, idx)


def _check(R, E, idx):
    per_rank, per_expert, in_rank = _layout(R, E, idx)
    T = idx.shape[1]
    assert per_rank.shape == (R, R) and per_rank.dtype == np.int32
    assert per_expert.shape == (R, E) and per_expert.dtype == np.int32
    assert in_rank.shape == (R, T, R) and in_rank.dtype == np.bool_
    for s in range(R):
        exp_rank, exp_expert, exp_in = oracle.layout(idx[s], E, R)
        np.testing.assert_array_equal(per_rank[s], exp_rank, err_msg=f"rank {s}")
        np.testing.assert_array_equal(per_expert[s], exp_expert, err_msg=f"rank {s}")
        np.testing.assert_array_equal(in_rank[s], exp_in, err_msg=f"rank {s}")


@pytest.mark.parametrize(
    "R,T,K,E",
    [(1, 16, 2, 8), (2, 33, 4, 8), (4, 16, 1, 16), (8, 33, 2, 32), (8, 1, 4, 8)],
)
def test_layout_counts_match_oracle_random_routing(R, T, K, E):
    rng = np.random.default_rng(100 + R * 7 + T + K + E)
    idx, _ = oracle.make_topk(rng, R, T, K, E)
    _check(R, E, idx)


@pytest.mark.parametrize("R", [2, 8])
def test_layout_token_counted_once_per_rank_when_several_experts_there(R):
    # E_l = 4 and K = 4: most tokens pick several experts on the same rank.
    E, T, K = 4 * R, 16, 4
    rng = np.random.default_rng(7 + R)
    idx = np.stack([np.stack([rng.permutation(4)[:K] + 4 * rng.integers(R) for _ in range(T)]) for _ in range(R)]).astype(np.int32)
    per_rank, per_expert, in_rank = _layout(R, E, idx)
    for s in range(R):
        assert per_rank[s].sum() == T  # every token lives on exactly one rank
        assert per_expert[s].sum() == T * K
    _check(R, E, idx)


@pytest.mark.parametrize("R", [1, 4])
def test_layout_ignores_minus_one_ids_all_invalid_gives_zeros(R):
    rng = np.random.default_rng(3)
    idx, _ = oracle.make_topk(rng, R, 16, 2, 8, mode="all_invalid")
    per_rank, per_expert, in_rank = _layout(R, 8, idx)
    assert not per_rank.any() and not per_expert.any() and not in_rank.any()


@pytest.mark.parametrize("mode", ["skewed", "empty_rank"])
def test_layout_skewed_and_empty_rank_match_oracle(mode):
    R, T, K, E = 4, 16, 2, 16
    rng = np.random.default_rng(11)
    idx, _ = oracle.make_topk(rng, R, T, K, E, mode=mode)
    _check(R, E, idx)


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_pos_in_rank_is_each_tokens_index_among_this_ranks_tokens_bound_for_each_rank(layout):
    """The handle's pos_in_rank [T, R] on a routing small enough to write out:
    token t's index among this rank's tokens that have an expert on rank j
    (ascending t, from 0), -1 where it has none. An off-by-one shows here
    directly, not only through the property test's oracle."""
    R, E, T, K, H = 2, 4, 5, 2, 8                # experts 0, 1 on rank 0; 2, 3 on rank 1
    idx = np.array([[[0, 3], [1, -1], [-1, -1], [2, 3], [0, 2]],
                    [[3, -1], [0, 1], [2, 0], [-1, -1], [1, 3]]], np.int32)
    want = np.array([[[0, 0], [1, -1], [-1, -1], [-1, 1], [2, 2]],
                     [[-1, 0], [0, -1], [1, 1], [-1, -1], [2, 2]]], np.int32)
    x = np.ones((R, T, H), np.float32)

    def fn(x, i):
        return jax_ep.dispatch(x, i, None, num_experts=E, layout=layout).handle.pos_in_rank

    got = run_sharded(R, fn, x, idx)
    np.testing.assert_array_equal(got, want)
    disp = oracle.dispatch_rank((x,), idx, np.ones(idx.shape, np.float32), E)
    np.testing.assert_array_equal(
        got, oracle.dispatch_handle(disp, idx, E, "rank", R * T)["pos_in_rank"])
