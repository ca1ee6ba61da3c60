"""Low-latency (decode) dispatch/combine: per-expert packed receive buffers,
FP8 cast, weighted combine in (expert id, k) order, split == fused bitwise."""
from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded
from oracle import BF16, F32, FP8, assert_fixed_order_exact, bits


def _required_kwonly(fn) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    ]


def _call_done(fn, pending, **available):
    """Call a *_done with the pending value, plus any keyword the implementation
    (against the contract) still requires; test_ll_done_takes_only_pending flags that."""
    return fn(pending, **{k: available[k] for k in _required_kwonly(fn) if k in available})


def test_ll_done_takes_only_pending():
    """Contract: low_latency_{dispatch,combine}_done(pending) need nothing but pending."""
    for fn in (jax_ep.low_latency_dispatch_done, jax_ep.low_latency_combine_done):
        assert _required_kwonly(fn) == [], f"{fn.__name__} requires {_required_kwonly(fn)}"


def _ll_dispatch(R, E, mt, x, idx, **kw):
    def fn(x, i):
        o = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, axis_name="ep", **kw)
        return o.recv_x, o.recv_count

    return run_sharded(R, fn, x, idx)


def _assert_ll_dispatch(got, exp, R, El, mt):
    recv_x, count = got
    payload = tuple(recv_x) if isinstance(recv_x, (tuple, list)) else (recv_x,)
    assert count.dtype == np.int32 and count.shape == (R, El)
    for r in range(R):
        e = exp[r]
        np.testing.assert_array_equal(count[r], e.count, err_msg=f"recv_count, rank {r}")
        assert len(payload) == len(e.payload)
        for j, (g, want) in enumerate(zip(payload, e.payload)):
            assert g.shape[1:] == want.shape, (j, g.shape, want.shape)
            assert g.shape[2] == R * mt
            assert g.dtype == want.dtype
            np.testing.assert_array_equal(bits(g[r]), bits(want), err_msg=f"payload {j}, rank {r}")


LL_CASES = [
    # R, T, K, E, H, dtype, max_tokens, mode
    (1, 16, 2, 8, 128, BF16, 16, "random"),
    (2, 16, 4, 8, 256, BF16, 16, "random"),
    (4, 16, 2, 16, 128, F32, 20, "random"),
    (8, 33, 2, 32, 128, BF16, 33, "random"),
    (8, 16, 4, 8, 128, BF16, 16, "skewed"),
    (4, 16, 2, 8, 128, BF16, 16, "empty_rank"),
    (2, 1, 1, 8, 128, F32, 4, "random"),
    (2, 0, 2, 8, 128, BF16, 4, "random"),  # no tokens anywhere: an empty gather, zero grid
]


def _id(c):
    return "-".join(str(getattr(v, "name", v)) for v in c)


@pytest.mark.parametrize("R,T,K,E,H,dtype,mt,mode", LL_CASES, ids=[_id(c) for c in LL_CASES])
def test_ll_dispatch_rows_packed_per_expert_in_source_rank_token_order(R, T, K, E, H, dtype, mt, mode):
    rng = np.random.default_rng(10000 + R * 17 + T + K + E + H + mt)
    idx, _ = oracle.make_topk(rng, R, T, K, E, mode=mode)
    x = oracle.make_x(rng, (R, T, H), dtype)
    got = _ll_dispatch(R, E, mt, x, idx)
    _assert_ll_dispatch(got, oracle.low_latency_dispatch((x,), idx, E, mt), R, E // R, mt)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32scale", "ue8m0"])
@pytest.mark.parametrize("R", [2, 8])
def test_ll_dispatch_fp8_cast_matches_numpy_quantisation_exactly(R, ue8m0):
    T, K, E, H, mt = 16, 4, 16, 256, 16
    rng = np.random.default_rng(10100 + R + ue8m0)
    idx, _ = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)
    x = (x.astype(np.float32) * rng.choice([1e-3, 1.0, 50.0], size=(R, T, 1))).astype(BF16)
    q, s = oracle.quantize_fp8(x, ue8m0=ue8m0)
    got = _ll_dispatch(R, E, mt, x, idx, fp8=True, ue8m0=ue8m0)
    assert isinstance(got[0], (tuple, list)) and len(got[0]) == 2
    assert got[0][0].dtype == FP8 and got[0][1].dtype == F32
    _assert_ll_dispatch(got, oracle.low_latency_dispatch((q, s), idx, E, mt), R, E // R, mt)


LLC_CASES = [
    # R, T, K, E, H, dtype, max_tokens, mode
    (1, 16, 2, 8, 128, F32, 16, "random"),
    (2, 16, 4, 8, 256, BF16, 16, "random"),
    (4, 16, 4, 8, 128, F32, 20, "random"),
    (8, 33, 2, 32, 128, BF16, 33, "random"),
    (8, 16, 4, 8, 128, BF16, 16, "skewed"),
    (4, 16, 2, 8, 128, F32, 16, "empty_rank"),
]


@pytest.mark.parametrize("R,T,K,E,H,dtype,mt,mode", LLC_CASES, ids=[_id(c) for c in LLC_CASES])
def test_ll_combine_weighted_sum_in_expert_then_k_order_exactly(R, T, K, E, H, dtype, mt, mode):
    rng = np.random.default_rng(10200 + R * 17 + T + K + E + H + mt)
    idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
    x = oracle.make_x(rng, (R, T, H), dtype)
    El = E // R
    # every row of y nonzero, also rows past recv_count: those must be ignored
    y = oracle.make_x(rng, (R, El, R * mt, H), dtype)

    def fn(x, i, w, y):
        o = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, axis_name="ep")
        return jax_ep.low_latency_combine(y, i, w, o.handle, axis_name="ep")

    got = run_sharded(R, fn, x, idx, w, y)
    disp = oracle.low_latency_dispatch((x,), idx, E, mt)
    assert_fixed_order_exact(
        got, lambda mode: oracle.low_latency_combine(y, idx, w, disp, mode=mode), "low_latency_combine"
    )
    if mode == "empty_rank":
        assert not got[R - 1].astype(np.float32).any()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("R", [1, 4])
def test_ll_split_start_done_equals_fused_bitwise(R, fp8):
    T, K, E, H, mt = 16, 2, 8, 128, 16
    rng = np.random.default_rng(10300 + R + fp8)
    idx, w = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)
    y = oracle.make_x(rng, (R, E // R, R * mt, H), BF16)

    def fn(x, i, w, y):
        kw = dict(num_experts=E, max_tokens=mt, fp8=fp8)
        fused = jax_ep.low_latency_dispatch(x, i, axis_name="ep", **kw)
        pend = jax_ep.low_latency_dispatch_start(x, i, **kw)
        split = _call_done(jax_ep.low_latency_dispatch_done, pend, num_experts=E, max_tokens=mt)
        out_fused = jax_ep.low_latency_combine(y, i, w, fused.handle, axis_name="ep")
        pc = jax_ep.low_latency_combine_start(y, i, w, split.handle)
        out_split = _call_done(jax_ep.low_latency_combine_done, pc, num_experts=E, max_tokens=mt)
        return (fused.recv_x, fused.recv_count, out_fused), (split.recv_x, split.recv_count, out_split)

    fused, split = run_sharded(R, fn, x, idx, w, y)
    lf, ls = jax.tree.leaves(fused), jax.tree.leaves(split)
    assert len(lf) == len(ls)
    for a, b in zip(lf, ls):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    # and both are right
    disp = oracle.low_latency_dispatch(oracle.quantize_fp8(x) if fp8 else (x,), idx, E, mt)
    assert_fixed_order_exact(fused[2], lambda mode: oracle.low_latency_combine(y, idx, w, disp, mode=mode))


def test_ll_dispatch_more_tokens_than_max_tokens_is_value_error():
    R, T, K, E, H = 2, 16, 2, 8, 128
    rng = np.random.default_rng(10400)
    idx, _ = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)
    with pytest.raises(ValueError, match="max_tokens|tokens"):
        _ll_dispatch(R, E, T - 1, x, idx)


def test_ll_dispatch_all_invalid_gives_zero_counts_and_zero_buffers():
    R, T, K, E, H, mt = 4, 8, 2, 8, 128, 8
    rng = np.random.default_rng(10500)
    idx, _ = oracle.make_topk(rng, R, T, K, E, mode="all_invalid")
    x = oracle.make_x(rng, (R, T, H), BF16)
    recv, count = _ll_dispatch(R, E, mt, x, idx)
    assert not count.any()
    assert not recv.astype(np.float32).any()


def test_ll_dispatch_overflow_is_reported_at_run_time():
    """Tokens that repeat an expert inside their top-k give that expert two
    rows each: with T = max_tokens on every rank it receives 2·R·T rows, past
    its R·max_tokens slots. The op must raise, not drop rows."""
    R, T, K, E, H = 2, 4, 2, 8, 128
    rng = np.random.default_rng(10450)
    x = oracle.make_x(rng, (R, T, H), BF16)
    idx = np.zeros((R, T, K), np.int32)          # every slot: expert 0
    with pytest.raises(Exception, match="(?i)overflow"):
        _ll_dispatch(R, E, T, x, idx)


def _uneven_topk(rng, R, T, K, E):
    """Distinct experts per token drawn with skewed odds (a few hot experts,
    some never chosen), a share of -1 slots that differs per rank (none on
    rank 0, every slot on the last rank when R > 1)."""
    odds = rng.permutation(1.0 / np.arange(1, E + 1) ** 1.5)
    idx = np.stack([[rng.choice(E, size=K, replace=False, p=odds / odds.sum()) for _ in range(T)]
                    for _ in range(R)]).astype(np.int32).reshape(R, T, K)
    drop = np.linspace(0.0, 1.0 if R > 1 else 0.4, R)[:, None, None]
    idx[rng.random((R, T, K)) < drop] = -1
    return idx


HANDLE_CASES = [
    # R, T, K, E, max_tokens
    (1, 16, 4, 8, 16),
    (2, 33, 6, 16, 40),
    (4, 16, 2, 8, 16),
    (4, 7, 8, 32, 9),
    (8, 16, 4, 64, 16),
    (8, 33, 8, 16, 33),
]


@pytest.mark.parametrize("R,T,K,E,mt", HANDLE_CASES, ids=[_id(c) for c in HANDLE_CASES])
def test_ll_handle_src_entry_and_recv_count_equal_the_oracle(R, T, K, E, mt):
    """The whole low-latency handle (src_entry: flat (source rank, token, k)
    of every row, -1 past the count; recv_count), fused and split, against
    tests/oracle.py on uneven random routings with -1 slots."""
    H = 8
    x = np.zeros((R, T, H), BF16)

    def fn(x, i):
        kw = dict(num_experts=E, max_tokens=mt)
        fused = jax_ep.low_latency_dispatch(x, i, axis_name="ep", **kw)
        split = _call_done(jax_ep.low_latency_dispatch_done,
                           jax_ep.low_latency_dispatch_start(x, i, axis_name="ep", **kw),
                           num_experts=E, max_tokens=mt)
        return [(o.handle.src_entry, o.handle.recv_count, o.recv_count) for o in (fused, split)]

    rng = np.random.default_rng(oracle.stable_seed("ll-handle", R, T, K, E, mt))
    for rnd in range(3):
        idx = _uneven_topk(rng, R, T, K, E)
        disp = oracle.low_latency_dispatch((x,), idx, E, mt)
        want_entry = oracle.low_latency_src_entry(disp, T, K, mt)
        want_count = np.stack([d.count for d in disp])
        for how, (entry, hcount, count) in zip(("fused", "split"), run_sharded(R, fn, x, idx)):
            assert entry.dtype == np.int32 and entry.shape == want_entry.shape, (entry.dtype, entry.shape)
            np.testing.assert_array_equal(entry, want_entry, err_msg=f"{how} src_entry, round {rnd}")
            np.testing.assert_array_equal(hcount, want_count, err_msg=f"{how} handle.recv_count, round {rnd}")
            np.testing.assert_array_equal(count, want_count, err_msg=f"{how} recv_count, round {rnd}")
        if R > 1 and rnd == 0:  # the routing is as uneven as meant
            assert want_count.max() >= 3 * max(1, want_count.min()), want_count


def test_the_kernels_take_max_tokens_up_to_their_16_bit_counts():
    """ffi/kernels/low_latency.cuh kLlMaxTokens: above it the automatic
    choice runs the reference and backend="cuda" says why at trace time."""
    import jax.numpy as jnp
    from jax_ep._ffi import low_latency as ffi_ll
    from jax_ep.ops import low_latency as ll
    assert ffi_ll.MAX_TOKENS == 0xFFFF
    assert "max_tokens <= 65535" in ll._kernel_refusal(jnp.bfloat16, 128, False, 8,
                                                       ffi_ll.MAX_TOKENS + 1)
    assert ll._kernel_refusal(jnp.bfloat16, 128, False, 8, ffi_ll.MAX_TOKENS) is None


def _fill_to(R, T, K, extra):
    """[R, T, K] ids giving expert 0 exactly R*T + extra rows (extra in
    -1, 0, 1) with max_tokens = T: every token picks expert 0 once in slot 0
    (R*T rows); extra = 1 makes one token repeat it in slot 1, extra = -1
    sends one token to expert 1 instead. Other slots -1."""
    idx = np.full((R, T, K), -1, np.int32)
    idx[:, :, 0] = 0
    if extra == 1:
        idx[R - 1, T - 1, 1] = 0
    elif extra == -1:
        idx[0, 0, 0] = 1
    return idx


@pytest.mark.isolated
@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_ll_dispatch_at_under_and_one_row_over_r_times_max_tokens_for_an_expert(R, extra):
    """The edge of the receive grid: R*max_tokens rows fit (and equal the
    oracle), one more must raise, never drop a row."""
    T, K, E, H = 4, 2, 4 * R, 128
    rng = np.random.default_rng(10460 + R)
    x = oracle.make_x(rng, (R, T, H), BF16)
    idx = _fill_to(R, T, K, extra)
    if extra == 1:
        with pytest.raises(jax.errors.JaxRuntimeError, match=rf"overflow: an expert got {R * T + 1} rows"):
            _ll_dispatch(R, E, T, x, idx)
        return
    got = _ll_dispatch(R, E, T, x, idx)
    assert got[1][0][0] == R * T + extra
    _assert_ll_dispatch(got, oracle.low_latency_dispatch((x,), idx, E, T), R, E // R, T)


def test_ll_combine_starts_from_minus_zero_so_all_minus_zero_rows_give_minus_zero():
    """As the normal combine (test_combine.py): a token whose every row is
    -0.0 gets -0.0, a token with no valid expert +0.0; bitwise the oracle."""
    R, T, K, E, H, mt = 2, 8, 2, 8, 128, 8
    rng = np.random.default_rng(10470)
    idx, w = oracle.make_topk(rng, R, T, K, E, drop=0.0)
    idx[:, 1] = -1
    x = oracle.make_x(rng, (R, T, H), F32)
    disp = oracle.low_latency_dispatch((x,), idx, E, mt)
    y = oracle.make_x(rng, (R, E // R, R * mt, H), F32)
    neg = {(s, 0) for s in range(R)} | {(s, 6) for s in range(R)}
    for r in range(R):
        for l, lst in enumerate(disp[r].rows):
            for pos, (s, t, _) in enumerate(lst):
                if (s, t) in neg:
                    y[r, l, pos] = -0.0

    def fn(x, i, w, y):
        o = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt)
        return jax_ep.low_latency_combine(y, i, w, o.handle)

    got = run_sharded(R, fn, x, idx, w, y)
    assert_fixed_order_exact(got, lambda mode: oracle.low_latency_combine(y, idx, w, disp, mode=mode))
    for s, t in neg:
        assert np.signbit(got[s, t]).all() and not got[s, t].any(), (s, t)
    assert not np.signbit(got[:, 1]).any() and not got[:, 1].any()
