"""dispatch: rank layout and expert layout rows, bitwise against the NumPy oracle;
FP8 payloads (tuple moved bitwise, cast inside), capacity, cached dispatch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded, sharded
from oracle import BF16, F32, FP8, bits

F16 = np.dtype(np.float16)


def _dispatch(R, E, x, idx, w, **kw):
    def fn(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", **kw)
        return o.recv_x, o.recv_topk_idx, o.recv_topk_weights, o.counts

    return run_sharded(R, fn, x, idx, w)


def _payload(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_rank_layout(out, exp, C):
    recv_x, ridx, rw, counts = out
    got_payload = _payload(recv_x)
    R = len(exp)
    for r in range(R):
        e = exp[r]
        assert len(got_payload) == len(e.payload)
        for j, (g, x) in enumerate(zip(got_payload, e.payload)):
            assert g.shape[1:] == x.shape, (j, g.shape, x.shape)
            assert g.dtype == x.dtype, (j, g.dtype, x.dtype)
            np.testing.assert_array_equal(bits(g[r]), bits(x), err_msg=f"payload {j}, dest rank {r}")
        assert ridx.dtype == np.int32 and ridx.shape[1] == C
        np.testing.assert_array_equal(ridx[r], e.topk_idx, err_msg=f"recv_topk_idx, dest rank {r}")
        assert rw.dtype == np.float32
        np.testing.assert_array_equal(rw[r], e.topk_weights, err_msg=f"recv_topk_weights, dest {r}")
        assert counts.dtype == np.int32
        np.testing.assert_array_equal(counts[r], e.counts, err_msg=f"counts, dest rank {r}")


def assert_expert_layout(out, exp, C):
    recv_x, ridx, rw, sizes = out
    got_payload = _payload(recv_x)
    for r in range(len(exp)):
        e = exp[r]
        for j, (g, x) in enumerate(zip(got_payload, e.payload)):
            assert g.shape[1:] == x.shape, (j, g.shape, x.shape)
            assert g.dtype == x.dtype
            np.testing.assert_array_equal(bits(g[r]), bits(x), err_msg=f"payload {j}, dest rank {r}")
        assert ridx.dtype == np.int32 and ridx.shape[1:] == (C,)
        np.testing.assert_array_equal(ridx[r], e.topk_idx, err_msg=f"recv_topk_idx, dest rank {r}")
        assert rw.dtype == np.float32 and rw.shape[1:] == (C,)
        np.testing.assert_array_equal(rw[r], e.topk_weights, err_msg=f"recv weights, dest {r}")
        assert sizes.dtype == np.int32
        np.testing.assert_array_equal(sizes[r], e.group_sizes, err_msg=f"group_sizes, dest {r}")


RANK_CASES = [
    # R, T, K, E, H, dtype, mode
    (1, 16, 2, 8, 128, F32, "random"),
    (2, 33, 4, 8, 256, BF16, "random"),
    (4, 16, 2, 16, 128, BF16, "random"),
    (4, 1, 1, 16, 128, F32, "random"),
    (8, 33, 2, 32, 128, BF16, "random"),
    (8, 16, 4, 8, 256, F16, "random"),
    (2, 16, 2, 8, 128, BF16, "skewed"),
    (8, 16, 2, 16, 128, F32, "skewed"),
    (4, 16, 2, 8, 128, BF16, "empty_rank"),
    (1, 16, 2, 8, 128, BF16, "all_invalid"),
    (8, 16, 1, 8, 128, F32, "all_invalid"),
]


def _id(case):
    return "-".join(str(getattr(c, "name", c)) for c in case)


@pytest.mark.parametrize("R,T,K,E,H,dtype,mode", RANK_CASES, ids=[_id(c) for c in RANK_CASES])
def test_rank_layout_rows_ordered_by_source_rank_then_token_bitwise(R, T, K, E, H, dtype, mode):
    rng = np.random.default_rng(1000 + R * 31 + T * 7 + K + E + H)
    idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
    x = oracle.make_x(rng, (R, T, H), dtype)
    out = _dispatch(R, E, x, idx, w, layout="rank")
    C = oracle.default_capacity_rank(R, T)
    assert out[0].shape == (R, C, H), "default rank-layout capacity is R*T"
    assert_rank_layout(out, oracle.dispatch_rank((x,), idx, w, E), C)


EXPERT_CASES = [
    # R, T, K, E, H, dtype, mode, alignment
    (1, 16, 2, 8, 128, F32, "random", 1),
    (2, 33, 4, 8, 256, BF16, "random", 1),
    (2, 16, 4, 8, 128, BF16, "random", 4),
    (4, 16, 2, 16, 128, BF16, "random", 3),
    (4, 1, 1, 16, 128, F32, "random", 8),
    (8, 33, 2, 32, 128, BF16, "random", 1),
    (8, 16, 4, 8, 256, F16, "random", 2),
    (2, 16, 2, 8, 128, BF16, "skewed", 4),
    (8, 16, 2, 16, 128, F32, "skewed", 1),
    (4, 16, 2, 8, 128, BF16, "empty_rank", 4),
    (1, 16, 2, 8, 128, BF16, "all_invalid", 1),
    (8, 16, 1, 8, 128, F32, "all_invalid", 4),
]


@pytest.mark.parametrize(
    "R,T,K,E,H,dtype,mode,align", EXPERT_CASES, ids=[_id(c) for c in EXPERT_CASES]
)
def test_expert_layout_rows_grouped_by_local_expert_padded_to_alignment_bitwise(
    R, T, K, E, H, dtype, mode, align
):
    rng = np.random.default_rng(2000 + R * 31 + T * 7 + K + E + H + align)
    idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
    x = oracle.make_x(rng, (R, T, H), dtype)
    out = _dispatch(R, E, x, idx, w, layout="expert", expert_alignment=align)
    El = E // R
    C = oracle.default_capacity_expert(R, T, K, El, align)
    assert out[0].shape == (R, C, H), f"default expert-layout capacity {C}"
    exp = oracle.dispatch_expert((x,), idx, w, E, align)
    assert_expert_layout(out, exp, C)
    # group sizes are multiples of the alignment and sum to the used rows
    for r in range(R):
        assert (out[3][r] % align == 0).all()
        assert out[3][r].sum() == exp[r].num_rows


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("R", [2, 8])
def test_fp8_tuple_payload_moved_bitwise(layout, R):
    T, K, E, H = 16, 2, 16, 256
    rng = np.random.default_rng(3000 + R + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E)
    q, s = oracle.make_fp8_tuple(rng, R, T, H)
    out = _dispatch(R, E, (q, s), idx, w, layout=layout)
    assert isinstance(out[0], (tuple, list)) and len(out[0]) == 2
    assert out[0][0].dtype == FP8 and out[0][1].dtype == F32
    if layout == "rank":
        assert_rank_layout(out, oracle.dispatch_rank((q, s), idx, w, E), R * T)
    else:
        C = oracle.default_capacity_expert(R, T, K, E // R, 1)
        assert_expert_layout(out, oracle.dispatch_expert((q, s), idx, w, E), C)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32scale", "ue8m0"])
@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("R", [1, 4])
def test_fp8_cast_inside_matches_numpy_quantisation_exactly(ue8m0, layout, R):
    T, K, E, H = 16, 2, 8, 256
    rng = np.random.default_rng(4000 + R + 2 * ue8m0 + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)
    # make block amax span several binades, include a tiny block (< 1e-4 clamp)
    x = (x.astype(np.float32) * rng.choice([1e-3, 0.1, 1.0, 30.0], size=(R, T, 1))).astype(BF16)
    x[0, 0, :128] = (np.full(128, 1e-6, np.float32) * np.sign(rng.standard_normal(128))).astype(BF16)
    q, s = oracle.quantize_fp8(x, ue8m0=ue8m0)
    out = _dispatch(R, E, x, idx, w, layout=layout, fp8=True, ue8m0=ue8m0)
    assert isinstance(out[0], (tuple, list)) and len(out[0]) == 2
    if layout == "rank":
        assert_rank_layout(out, oracle.dispatch_rank((q, s), idx, w, E), R * T)
    else:
        C = oracle.default_capacity_expert(R, T, K, E // R, 1)
        assert_expert_layout(out, oracle.dispatch_expert((q, s), idx, w, E), C)
    if ue8m0:  # the scales that came through are powers of two
        sc = out[0][1]
        sc = sc[sc != 0]
        assert sc.size and np.all(np.frexp(sc)[0] == 0.5)


def test_fp8_quantisation_oracle_self_check():
    """The numpy quantiser itself: q*s reconstructs x within e4m3 precision."""
    rng = np.random.default_rng(5)
    x = oracle.make_x(rng, (4, 256), BF16)
    for ue in (False, True):
        q, s = oracle.quantize_fp8(x, ue8m0=ue)
        rec = q.astype(np.float32).reshape(4, 2, 128) * s[..., None]
        np.testing.assert_allclose(rec.reshape(4, 256), x.astype(np.float32), rtol=0.07, atol=1e-3)
        assert np.abs(q.astype(np.float32)).max() <= 448


def test_fp8_reference_steps_round_like_ieee_numpy():
    """The reference's own reciprocal and e4m3 rounding (which do not trust
    XLA:GPU's division and convert) give numpy's IEEE bits: every e4m3 value,
    every tie between two of them and its neighbours, and scales over the
    whole range a finite input can produce."""
    import ml_dtypes
    from jax_ep import fp8
    rng = np.random.default_rng(11)
    s = np.concatenate([np.exp(rng.uniform(-16, 82, 200_000)),
                        2.0 ** np.arange(-22, 119)]).astype(np.float32)
    np.testing.assert_array_equal(bits(np.asarray(jax.jit(fp8.reciprocal_rn)(s))),
                                  bits(np.float32(1) / s))
    q = np.unique(np.arange(256, dtype=np.uint8).view(FP8).astype(np.float32))
    q = q[np.isfinite(q)]
    ties = ((q[:-1].astype(np.float64) + q[1:]) / 2).astype(np.float32)
    v = np.concatenate([q, ties, np.nextafter(ties, np.float32(np.inf)),
                        np.nextafter(ties, np.float32(-np.inf)),
                        np.clip(rng.standard_normal(100_000).astype(np.float32) * 50, -448, 448)])
    np.testing.assert_array_equal(bits(np.asarray(jax.jit(fp8.to_e4m3)(v))),
                                  bits(v.astype(ml_dtypes.float8_e4m3fn)))


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_explicit_capacity_exact_fit_keeps_every_row(layout):
    R, T, K, E, H = 4, 16, 2, 8, 128
    rng = np.random.default_rng(6000 + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)
    if layout == "rank":
        C = oracle.needed_capacity_rank(idx, E)
        out = _dispatch(R, E, x, idx, w, layout="rank", capacity=C)
        assert out[0].shape == (R, C, H)
        assert_rank_layout(out, oracle.dispatch_rank((x,), idx, w, E, capacity=C), C)
    else:
        C = oracle.needed_capacity_expert(idx, E, 2)
        out = _dispatch(R, E, x, idx, w, layout="expert", capacity=C, expert_alignment=2)
        assert out[0].shape == (R, C, H)
        assert_expert_layout(out, oracle.dispatch_expert((x,), idx, w, E, 2, capacity=C), C)


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_cached_dispatch_with_handle_equals_fresh_dispatch_of_other_data(layout):
    R, T, K, E, H = 4, 16, 2, 16, 128
    rng = np.random.default_rng(7000 + len(layout))
    idx, w = oracle.make_topk(rng, R, T, K, E)
    x1 = oracle.make_x(rng, (R, T, H), BF16)
    x2 = oracle.make_x(rng, (R, T, H), BF16)

    def fn(x1, x2, i, w):
        kw = dict(num_experts=E, axis_name="ep", layout=layout)
        o1 = jax_ep.dispatch(x1, i, w, **kw)
        cached = jax_ep.dispatch(x2, i, w, handle=o1.handle, **kw)
        fresh = jax_ep.dispatch(x2, i, w, **kw)
        return tuple(cached[:4]), tuple(fresh[:4])

    cached, fresh = run_sharded(R, fn, x1, x2, idx, w)
    for a, b in zip(jax.tree.leaves(cached), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(bits(a), bits(b))
    if layout == "rank":
        assert_rank_layout(cached, oracle.dispatch_rank((x2,), idx, w, E), R * T)
    else:
        C = oracle.default_capacity_expert(R, T, K, E // R, 1)
        assert_expert_layout(cached, oracle.dispatch_expert((x2,), idx, w, E), C)


def test_handle_is_pytree_of_arrays_that_crosses_a_jit_boundary():
    """dispatch in one jitted shard_map, combine with the returned handle in another."""
    R, T, K, E, H = 2, 16, 2, 8, 128
    rng = np.random.default_rng(7100)
    idx, w = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), F32)

    def first(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout="rank")
        return o.recv_x, o.handle

    recv, handle = sharded(R, first)(x, idx, w)
    for leaf in jax.tree.leaves(handle):
        assert isinstance(leaf, jax.Array)

    def second(y, h):
        return jax_ep.combine(y, h, axis_name="ep")

    out = np.asarray(sharded(R, second)(recv, handle))
    exp = oracle.dispatch_rank((x,), idx, w, E)
    rows = [d.rows for d in exp]
    oracle.assert_fixed_order_exact(out, lambda mode: oracle.combine(np.asarray(recv), rows, None, T, mode=mode))


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_zero_tokens_per_rank_gives_empty_outputs(layout):
    R, T, K, E, H = 2, 0, 2, 8, 128
    idx = np.zeros((R, 0, K), np.int32)
    w = np.zeros((R, 0, K), np.float32)
    x = np.zeros((R, 0, H), np.float32)
    out = _dispatch(R, E, x, idx, w, layout=layout)
    assert out[0].shape[:2] == (R, 0)
    assert not out[3].any()


# Special values by their bits: quiet NaNs with a payload, of either sign, a
# signalling NaN, +-Inf and -0.
_SPECIAL_BITS = {
    F32: dict(nan=[0x7FC01234, 0xFFC00001, 0x7F800001], pinf=[0x7F800000], ninf=[0xFF800000],
              nzero=[0x80000000]),
    BF16: dict(nan=[0x7FC1, 0xFFC3, 0x7F81], pinf=[0x7F80], ninf=[0xFF80], nzero=[0x8000]),
}


def _with_special_values(x, rng):
    """x [R, T, H] with NaNs, +Inf, -Inf and -0 set by their bits, each kind
    in tokens of its own (one element per token); returns x and
    {kind: [(s, t, c), ...]}."""
    x = x.copy()
    R, T, H = x.shape
    u = x.view(np.uint32 if x.dtype == F32 else np.uint16)
    tokens = rng.permutation(R * T)
    where, i = {}, 0
    for kind, patterns in _SPECIAL_BITS[np.dtype(x.dtype)].items():
        for p in patterns:
            for _ in range(2):
                s, t = divmod(int(tokens[i]), T)
                c = int(rng.integers(H))
                u[s, t, c] = p
                where.setdefault(kind, []).append((s, t, c))
                i += 1
    return x, where


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_nan_and_inf_in_the_payload_pass_through_unchanged(layout, dtype):
    """Dispatch moves bits: NaNs (quiet with a payload, negative, signalling),
    +-Inf and -0 arrive as they left. Combine (positive weights) carries
    them into their own token's sum only: NaN where a row of the token has
    a NaN in that column, +-Inf likewise, every other element finite and
    equal to the oracle's sum."""
    R, T, K, E, H = 4, 16, 3, 8, 128
    rng = np.random.default_rng(oracle.stable_seed("nan-inf", layout, dtype.name))
    idx, w = oracle.make_topk(rng, R, T, K, E, drop=0.0)
    x, where = _with_special_values(oracle.make_x(rng, (R, T, H), dtype), rng)

    def fn(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout=layout)
        rw = o.recv_topk_weights if layout == "expert" else jnp.where(o.handle.recv_src_rank >= 0, 0.75, 0.0)
        return o.recv_x, jax_ep.combine(o.recv_x, o.handle, rw, axis_name="ep")

    recv, out = run_sharded(R, fn, x, idx, w)
    exp = (oracle.dispatch_rank((x,), idx, w, E) if layout == "rank"
           else oracle.dispatch_expert((x,), idx, w, E))
    for r in range(R):
        np.testing.assert_array_equal(bits(recv[r]), bits(exp[r].payload[0]), err_msg=f"dest rank {r}")
    for kind, n in (("nan", 3), ("pinf", 1), ("ninf", 1), ("nzero", 1)):  # every one arrived
        for p in _SPECIAL_BITS[np.dtype(dtype)][kind][:n]:
            assert (bits(recv) == p).sum() >= 2, (kind, hex(p))

    assert out.dtype == dtype and out.shape == (R, T, H)
    o32 = out.astype(np.float32)
    want = {k: np.zeros((R, T, H), bool) for k in ("nan", "pinf", "ninf")}
    for kind in want:
        for s, t, c in where[kind]:
            want[kind][s, t, c] = True
    np.testing.assert_array_equal(np.isnan(o32), want["nan"], err_msg="NaN outputs")
    np.testing.assert_array_equal(np.isposinf(o32), want["pinf"], err_msg="+Inf outputs")
    np.testing.assert_array_equal(np.isneginf(o32), want["ninf"], err_msg="-Inf outputs")
    y = np.stack([d.payload[0] for d in exp])
    ws = (np.stack([d.topk_weights for d in exp]) if layout == "expert"
          else np.stack([np.where(np.arange(y.shape[1]) < d.num_rows, 0.75, 0.0) for d in exp]))
    finite = np.isfinite(o32)
    for mode in oracle.COMBINE_STEP_MODES:
        with np.errstate(invalid="ignore"):  # the oracle's own NaN and Inf arithmetic
            e32 = oracle.combine(y, [d.rows for d in exp], ws, T, mode=mode).astype(np.float32)
        if np.array_equal(o32[finite], e32[finite]):  # by value: the oracle sums from +0, not -0
            break
    else:
        raise AssertionError("combine: the finite outputs differ from the oracle's sums")
