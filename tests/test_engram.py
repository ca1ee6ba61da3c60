"""Engram remote-row lookups: rows of a table split contiguously over ranks,
-1 -> zero row, FP8 rows with replicated per-row scales, start/wait == fused,
gradient summed into the owner's shard, out-of-range index is an error."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded, sharded
from oracle import BF16, F32, FP8, bits


def _indices(rng, R, T, n, V, drop=0.2, hot=None):
    hi = V if hot is None else hot
    idx = rng.integers(0, hi, size=(R, T, n)).astype(np.int32)
    idx[rng.random((R, T, n)) < drop] = -1
    return idx


def _shards(table, R):
    V = table.shape[0]
    return table.reshape(R, V // R, *table.shape[1:])


CASES = [
    # R, V, D, T, n, dtype, hot
    (1, 64, 128, 16, 4, BF16, None),
    (2, 128, 128, 33, 3, F32, None),
    (4, 256, 64, 16, 4, BF16, None),
    (8, 512, 128, 16, 6, BF16, None),
    (8, 64, 32, 1, 1, F32, None),
    (4, 64, 128, 16, 4, F32, 3),  # every lookup hits the first rank's 3 rows
]


def _id(c):
    return "-".join(str(getattr(v, "name", v)) for v in c)


@pytest.mark.parametrize("R,V,D,T,n,dtype,hot", CASES, ids=[_id(c) for c in CASES])
def test_engram_fetch_returns_global_table_rows_and_zero_for_minus_one(R, V, D, T, n, dtype, hot):
    rng = np.random.default_rng(11000 + R + V + D + T + n)
    table = oracle.make_x(rng, (V, D), dtype)
    idx = _indices(rng, R, T, n, V, hot=hot)

    def fn(tab, i):
        return jax_ep.engram_fetch(tab, i, axis_name="ep")

    got = run_sharded(R, fn, _shards(table, R), idx)
    exp = oracle.engram_fetch(table, idx)
    assert got.shape == (R, T, n, D) and got.dtype == table.dtype
    np.testing.assert_array_equal(bits(got), bits(exp))
    assert not got.astype(np.float32)[idx < 0].any()


@pytest.mark.parametrize("R", [2, 8])
def test_engram_fetch_fp8_rows_bitwise_with_replicated_row_scales(R):
    V, D, T, n = 256, 128, 16, 4
    rng = np.random.default_rng(11100 + R)
    tq = np.clip(rng.standard_normal((V, D)) * 60, -448, 448).astype(np.float32).astype(FP8)
    scales = rng.uniform(0.01, 4.0, V).astype(np.float32)
    idx = _indices(rng, R, T, n, V)

    def fn(tab, i, sc):
        return jax_ep.engram_fetch(tab, i, axis_name="ep", scales=sc)

    rows, row_scales = run_sharded(R, fn, _shards(tq, R), idx, np.tile(scales, (R, 1)))
    assert rows.dtype == FP8 and row_scales.dtype == F32
    assert rows.shape == (R, T, n, D) and row_scales.shape == (R, T, n)
    np.testing.assert_array_equal(bits(rows), bits(oracle.engram_fetch(tq, idx)))
    np.testing.assert_array_equal(row_scales, oracle.engram_scales(scales, idx))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("R", [1, 4])
def test_engram_fetch_start_wait_equals_fused(R, fp8):
    V, D, T, n = 128, 128, 16, 3
    rng = np.random.default_rng(11200 + R + fp8)
    if fp8:
        table = np.clip(rng.standard_normal((V, D)) * 60, -448, 448).astype(np.float32).astype(FP8)
    else:
        table = oracle.make_x(rng, (V, D), BF16)
    scales = np.tile(rng.uniform(0.1, 2.0, V).astype(np.float32), (R, 1))
    idx = _indices(rng, R, T, n, V)

    def fn(tab, i, sc):
        kw = dict(scales=sc) if fp8 else {}
        fused = jax_ep.engram_fetch(tab, i, axis_name="ep", **kw)
        split = jax_ep.engram_fetch_wait(jax_ep.engram_fetch_start(tab, i, **kw))
        return fused, split

    fused, split = run_sharded(R, fn, _shards(table, R), idx, scales)
    lf, ls = jax.tree.leaves(fused), jax.tree.leaves(split)
    assert len(lf) == len(ls) == (2 if fp8 else 1)
    for a, b in zip(lf, ls):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    np.testing.assert_array_equal(bits(lf[0]), bits(oracle.engram_fetch(table, idx)))


@pytest.mark.parametrize(
    "R,dtype,hot", [(1, F32, None), (2, F32, None), (8, F32, None), (4, F32, 5), (4, BF16, None), (8, BF16, 7)]
)
def test_engram_table_grad_is_sum_of_row_cotangents_into_owner_shard(R, dtype, hot):
    V, D, T, n = 128, 128, 16, 4
    rng = np.random.default_rng(11300 + R + (hot or 0) + (dtype == BF16))
    table = oracle.make_x(rng, (V, D), dtype)
    idx = _indices(rng, R, T, n, V, hot=hot)
    if dtype == BF16:
        # small integers: every partial sum is exact in bf16, whatever the order
        G = rng.integers(-4, 5, size=(R, T, n, D)).astype(np.float32)
    else:
        G = rng.standard_normal((R, T, n, D)).astype(np.float32)

    f = sharded(R, lambda tab, i: jax_ep.engram_fetch(tab, i, axis_name="ep"))
    d = jax.grad(lambda tab: jnp.sum(G * f(tab, idx).astype(jnp.float32)))(_shards(table, R))
    assert d.dtype == table.dtype and d.shape == (R, V // R, D)
    exp = oracle.engram_table_grad(V, idx, G).reshape(R, V // R, D)
    if dtype == BF16:
        np.testing.assert_array_equal(np.asarray(d, np.float32), exp)
    else:
        # f32 summation in any order: |err| <= (n-1) u sum|g|, u = 2^-24, plus rounding
        # of the float64 oracle; hot rows (many terms) need this bound, not rtol=1e-6.
        n, abs_sum = oracle.engram_grad_terms(V, idx, G)
        bound = np.maximum(n - 1, 0) * 2.0**-24 * abs_sum + 1e-6 * np.abs(exp.reshape(V, D))
        bound = bound.reshape(exp.shape)
        err = np.abs(np.asarray(d, np.float64) - exp)
        assert np.all(err <= bound + 1e-30), f"max excess {np.max(err - bound)}"


def test_the_kernels_gradient_entries_sorted_stably_sum_to_the_references_bits():
    """The CUDA backend's table gradient sorts the reference's entries by
    local row (stably) and sums each row's run in order
    (ops.engram._shard_grad; the sum is a kernel). On CPU: those
    entries, summed in that order by NumPy, give the reference's gradient bit
    for bit, on order-sensitive values (1e8, 1, -1e8 on hot rows)."""
    from jax_ep import reference as ref
    R, V, D, T, n = 4, 64, 8, 16, 3
    rng = np.random.default_rng(11350)
    idx = _indices(rng, R, T, n, V, hot=6)
    G = rng.choice(np.float32([1e8, 1.0, -1e8, 0.5, -3.0]), size=(R, T, n, D)).astype(np.float32)
    v_l = V // R

    def entries(d, i):
        rows, dd = ref.engram_grad_entries(d, i, v_l, axis_name="ep")
        order = jnp.argsort(rows, stable=True)
        return rows[order], dd[order]

    rows, dd = run_sharded(R, entries, G, idx)
    got = np.zeros((R, v_l, D), np.float32)
    for r in range(R):  # the kernel's loop: a run of equal rows, added in order from +0.0
        for q in range(rows.shape[1]):
            if rows[r, q] < v_l:
                got[r, rows[r, q]] = got[r, rows[r, q]] + dd[r, q]
    want = run_sharded(R, lambda d, i: ref.engram_table_grad(d, i, v_l, jnp.float32,
                                                              axis_name="ep"), G, idx)
    np.testing.assert_array_equal(bits(got), bits(np.asarray(want)))
    np.testing.assert_array_equal(
        bits(got.reshape(V, D)), bits(oracle.engram_table_grad_ordered(V, idx, G)))


@pytest.mark.isolated
def test_engram_index_out_of_range_raises_runtime_error_then_next_call_works():
    R, V, D, T, n = 4, 64, 128, 8, 2
    rng = np.random.default_rng(11400)
    table = oracle.make_x(rng, (V, D), F32)
    idx = _indices(rng, R, T, n, V)
    f = sharded(R, lambda tab, i: jax_ep.engram_fetch(tab, i, axis_name="ep"))
    for bad in (V, -2, V + 1000):  # one past the end, below -1, far out
        bad_idx = idx.copy()
        bad_idx[2, 3, 1] = bad
        with pytest.raises(Exception, match="(?i)index"):
            jax.block_until_ready(f(_shards(table, R), bad_idx))
        got = np.asarray(jax.block_until_ready(f(_shards(table, R), idx)))
        np.testing.assert_array_equal(got, oracle.engram_fetch(table, idx))


def test_engram_fetch_wait_of_a_cuda_pending_returns_its_rows_and_reference_row_scales():
    # The CUDA start leaves finished rows in the Pending; wait only adds the
    # FP8 row scales, with the reference's expression.
    from jax_ep._types import Pending

    rng = np.random.default_rng(11500)
    V, T, n, D = 64, 5, 3, 16
    idx = rng.integers(-1, V, size=(T, n)).astype(np.int32)
    rows = rng.standard_normal((T, n, D)).astype(np.float32)
    scales = rng.uniform(0.1, 2.0, V).astype(np.float32)
    p = Pending((jnp.asarray(rows), jnp.asarray(idx), jnp.asarray(scales)), op="engram_fetch",
                rows_per_rank=V, backend="cuda")
    got_rows, got_scales = jax_ep.engram_fetch_wait(p)
    np.testing.assert_array_equal(np.asarray(got_rows), rows)
    np.testing.assert_array_equal(np.asarray(got_scales), oracle.engram_scales(scales, idx[None])[0])
    p = Pending((jnp.asarray(rows), jnp.asarray(idx), None), op="engram_fetch", rows_per_rank=V,
                backend="cuda")
    np.testing.assert_array_equal(np.asarray(jax_ep.engram_fetch_wait(p)), rows)


@pytest.mark.parametrize("backend", [None, "auto", "reference"])
def test_engram_fetch_non_cuda_backends_are_the_reference(backend):
    R, V, D, T, n = 2, 64, 32, 8, 3
    rng = np.random.default_rng(11600)
    table = oracle.make_x(rng, (V, D), BF16)
    idx = _indices(rng, R, T, n, V)
    got = run_sharded(R, lambda t, i: jax_ep.engram_fetch(t, i, backend=backend),
                      _shards(table, R), idx)
    np.testing.assert_array_equal(bits(got), bits(oracle.engram_fetch(table, idx)))


def test_engram_fetch_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        run_sharded(2, lambda t, i: jax_ep.engram_fetch(t, i, backend="gpu"),
                    np.zeros((2, 4, 16), np.float32), np.zeros((2, 3, 2), np.int32))


# --- publish once, fetch many ----------------------------------------------------


@pytest.mark.parametrize("R,dtype", [(2, BF16), (4, F32)])
def test_published_table_fetches_equal_the_one_call_fetch_bitwise(R, dtype):
    V, D, T, n = 64 * R, 128, 16, 3
    rng = np.random.default_rng(11500 + R)
    table = oracle.make_x(rng, (V, D), dtype)
    idx1 = _indices(rng, R, T, n, V)
    idx2 = _indices(rng, R, T, n, V)

    def fn(tab, i1, i2):
        pub = jax_ep.engram_publish(tab, axis_name="ep")
        return jax_ep.engram_fetch(pub, i1), jax_ep.engram_fetch(pub, i2)

    got1, got2 = run_sharded(R, fn, _shards(table, R), idx1, idx2)
    np.testing.assert_array_equal(bits(got1), bits(oracle.engram_fetch(table, idx1)))
    np.testing.assert_array_equal(bits(got2), bits(oracle.engram_fetch(table, idx2)))


def test_published_fp8_table_returns_rows_and_row_scales():
    R, V, D, T, n = 2, 128, 128, 8, 2
    rng = np.random.default_rng(11600)
    q = oracle.make_x(rng, (V, D), F32).clip(-400, 400).astype(FP8)
    scales = rng.uniform(0.1, 2.0, size=(V,)).astype(np.float32)
    idx = _indices(rng, R, T, n, V)
    sc = np.broadcast_to(scales, (R, V)).copy()

    def fn(tab, s, i):
        pub = jax_ep.engram_publish(tab, s, axis_name="ep")
        return jax_ep.engram_fetch(pub, i)

    rows, row_scales = run_sharded(R, fn, _shards(q, R), sc, idx)
    np.testing.assert_array_equal(bits(rows), bits(oracle.engram_fetch(q, idx)))
    np.testing.assert_array_equal(row_scales, oracle.engram_scales(scales, idx))


def test_gradient_through_publish_and_fetch_reaches_the_shard():
    R, V, D, T, n = 4, 256, 64, 16, 4
    rng = np.random.default_rng(11700)
    table = oracle.make_x(rng, (V, D), F32)
    idx = _indices(rng, R, T, n, V)
    G = rng.standard_normal((R, T, n, D)).astype(np.float32)
    f = sharded(R, lambda tab, i: jax_ep.engram_fetch(jax_ep.engram_publish(tab, axis_name="ep"), i))
    d = jax.grad(lambda tab: jnp.sum(G * f(tab, idx).astype(jnp.float32)))(_shards(table, R))
    exp = oracle.engram_table_grad(V, idx, G).reshape(R, V // R, D)
    np.testing.assert_allclose(np.asarray(d), exp, rtol=1e-6, atol=1e-6)


def test_tables_published_side_by_side_stack_down_from_the_window_end():
    R, D = 2, 128
    t1 = jnp.ones((100, D), jnp.bfloat16)
    t2 = jnp.ones((50, D), jnp.float32)

    def fn(a, b):
        p1 = jax_ep.engram_publish(a, axis_name="ep")
        p2 = jax_ep.engram_publish(b, axis_name="ep", above=p1)
        p3 = jax_ep.engram_publish(a, axis_name="ep", above=p2)
        assert p1.table_end_offset == 0
        # 100 rows x 256 B = 25600 B, rounded to 256, plus 256 of slack
        assert p2.table_end_offset == 25600 + 256
        assert p3.table_end_offset == p2.table_end_offset + 50 * D * 4 + 256
        return jax_ep.engram_fetch(p2, jnp.zeros((1, 1), jnp.int32))

    sharded(R, fn)(jnp.ones((R * 100, D), jnp.bfloat16)[None].reshape(R, 100, D),
                   jnp.ones((R, 50, D), jnp.float32))
    with pytest.raises(ValueError, match="above"):
        sharded(R, lambda a: jax_ep.engram_publish(a, axis_name="ep", above=a).table)(
            jnp.ones((R, 100, D), jnp.bfloat16))


def test_buffer_size_hint_makes_room_for_stacked_engram_tables():
    base = jax_ep.get_buffer_size_hint(num_ranks=2, tokens_per_rank=64, hidden=256, topk=2,
                                       num_experts=8)
    tables = [(524288, 128, jnp.bfloat16), (1000, 64, jnp.float32)]
    hint = jax_ep.get_buffer_size_hint(num_ranks=2, tokens_per_rank=64, hidden=256, topk=2,
                                       num_experts=8, engram_tables=tables)
    # The dispatch area, plus the two tables as engram_publish stacks them.
    need = base + (524288 * 256 + 256) + (-(-1000 * 256 // 256) * 256 + 256)
    assert need <= hint < need + (2 << 20) and hint % (2 << 20) == 0


def test_buffer_size_hint_makes_room_for_a_gin_fetchs_scratch_below_the_tables():
    """With GIN peers a fetch of T * e rows needs its request/answer scratch
    (engram_layout.h EngramGinArea) below the tables: the hint counts it for
    the widest table's rows."""
    from jax_ep import _window

    kw = dict(num_ranks=4, tokens_per_rank=64, hidden=256, topk=2, num_experts=8)
    base = jax_ep.get_buffer_size_hint(**kw)
    tables = [(524288, 128, jnp.bfloat16), (1000, 64, jnp.float32)]
    hint = jax_ep.get_buffer_size_hint(**kw, engram_tables=tables)
    gin = _window.engram_gin_bytes(num_ranks=4, rows=512 * 24, dim=128, dtype=jnp.bfloat16)
    assert gin == 2 * 4 * (512 * 24 * 4 + 512 * 24 * 256) + 512 * 24 * 4
    with_gin = jax_ep.get_buffer_size_hint(**kw, engram_tables=tables, gin=True,
                                           engram_fetch_rows=512 * 24)
    assert jax_ep.get_buffer_size_hint(**kw, engram_tables=tables, engram_fetch_rows=512 * 24) == hint
    slots = (524288 * 256 + 256) + (1000 * 256 + 256)
    assert base + gin + slots <= with_gin <= hint + gin + (2 << 20)
    assert with_gin % (2 << 20) == 0


def test_a_kernels_publication_without_its_communicator_raises_naming_it():
    """A PublishedTable the kernels made lives in one Communicator's window:
    fetching from it once no Communicator of that id is open on the axis
    (closed, or replaced by another) is a clear error at trace time, never
    a read of freed or foreign memory and never a silent switch to the
    reference."""
    from jax_ep._types import PublishedTable

    table = jnp.zeros((8, 16), jnp.bfloat16)
    p = PublishedTable(table=table, scales=None, token=jnp.ones((1,), jnp.int32),
                       axis_name="ep", backend="auto", comm_id=7)
    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"Communicator 7's window .* closed or replaced"):
        jax_ep.engram_fetch(p, idx)
    with pytest.raises(ValueError, match="publish it again"):
        jax_ep.engram_fetch_start(p, idx)
