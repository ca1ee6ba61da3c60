"""The low-latency ops rebuilt from the normal ops (tests/ll_via_normal.py, an
extra oracle) equal the low-latency reference bit for bit: dispatch grid,
counts, handle and combine. The inner normal ops run the reference backend,
so two independent derivations of the contract are compared."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded
import ll_via_normal as via
from oracle import BF16, F32, bits

CASES = [
    # R, T, K, E, H, dtype, max_tokens, mode, fp8
    (1, 16, 2, 8, 128, BF16, 16, "random", False),
    (2, 16, 4, 8, 256, BF16, 16, "random", False),
    (2, 16, 4, 8, 256, BF16, 16, "random", True),
    (4, 16, 2, 16, 128, F32, 20, "random", False),
    (8, 33, 2, 32, 128, BF16, 33, "random", True),
    (8, 16, 4, 8, 128, BF16, 16, "skewed", False),
    (4, 16, 2, 8, 128, F32, 16, "empty_rank", False),
    (2, 1, 1, 8, 128, F32, 4, "random", False),
]


def _id(c):
    return "-".join(str(getattr(v, "name", v)) for v in c)


@pytest.mark.parametrize("R,T,K,E,H,dtype,mt,mode,fp8", CASES, ids=[_id(c) for c in CASES])
def test_low_latency_over_normal_ops_equals_low_latency_reference(R, T, K, E, H, dtype, mt, mode, fp8):
    rng = np.random.default_rng(20000 + R * 17 + T + K + E + H + mt + fp8)
    idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
    x = oracle.make_x(rng, (R, T, H), dtype)
    # every cell of y nonzero, also past recv_count: those must be ignored
    y = oracle.make_x(rng, (R, E // R, R * mt, H), BF16)

    def fn(x, i, w, y):
        kw = dict(num_experts=E, max_tokens=mt, axis_name="ep", fp8=fp8)
        ref = jax_ep.low_latency_dispatch(x, i, backend="reference", **kw)
        ref_out = jax_ep.low_latency_combine(y, i, w, ref.handle, axis_name="ep", backend="reference")
        got = via.dispatch_via_normal(x, i, ue8m0=False, backend="reference", **kw)
        got_out = via.combine_via_normal(y, i, w, got.handle, axis_name="ep", backend="reference")
        return ((ref.recv_x, ref.recv_count, ref.handle.src_entry, ref_out),
                (got.recv_x, got.recv_count, got.handle.src_entry, got_out))

    want, got = run_sharded(R, fn, x, idx, w, y)
    lw, lg = jax.tree.leaves(want), jax.tree.leaves(got)
    assert len(lw) == len(lg)
    for i, (a, b) in enumerate(zip(lw, lg)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i}")
    if mode == "empty_rank":
        assert not np.asarray(got[3][R - 1], np.float32).any()


def test_low_latency_cuda_backend_without_communicator_is_a_clear_error():
    R, T, K, E, H, mt = 2, 8, 2, 8, 128, 8
    rng = np.random.default_rng(20100)
    idx, _ = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), BF16)

    def fn(x, i):
        return jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, axis_name="ep",
                                           backend="cuda").recv_count

    with pytest.raises(ValueError, match="cuda"):
        run_sharded(R, fn, x, idx)
