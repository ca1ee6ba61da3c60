"""Errors (docs/design.md §4): trace-time ValueErrors that name the argument, and
device-side errors (bad expert id, capacity overflow) raised as exceptions at
the latest at block_until_ready, never a silent drop; the next good call works."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_ep
import oracle
from conftest import run_sharded, sharded
from oracle import BF16, F32


def _dispatch(R, E, x, idx, w, **kw):
    def fn(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", **kw)
        return o.recv_x, o.recv_topk_idx, o.recv_topk_weights, o.counts

    return run_sharded(R, fn, x, idx, w)


def _inputs(R, T, K, E, H, dtype=BF16, seed=0):
    rng = np.random.default_rng(12000 + seed)
    idx, w = oracle.make_topk(rng, R, T, K, E)
    x = oracle.make_x(rng, (R, T, H), dtype)
    return x, idx, w


# ----------------------------------------------------------------- trace-time


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_fp8_cast_with_hidden_not_multiple_of_128_is_value_error(layout):
    x, idx, w = _inputs(2, 8, 2, 8, 192)
    with pytest.raises(ValueError, match="hidden|128"):
        _dispatch(2, 8, x, idx, w, layout=layout, fp8=True)


def test_fp8_tuple_with_hidden_not_multiple_of_128_is_value_error():
    R, T, H = 2, 8, 64
    _, idx, w = _inputs(R, T, 2, 8, H)
    q = np.ones((R, T, H), np.float32).astype(oracle.FP8)
    s = np.ones((R, T, 1), np.float32)
    with pytest.raises(ValueError, match="hidden|128"):
        _dispatch(R, 8, (q, s), idx, w)


def test_low_latency_fp8_with_hidden_not_multiple_of_128_is_value_error():
    x, idx, _ = _inputs(2, 8, 2, 8, 192)

    def fn(x, i):
        return jax_ep.low_latency_dispatch(x, i, num_experts=8, max_tokens=8, axis_name="ep", fp8=True).recv_count

    with pytest.raises(ValueError, match="hidden|128"):
        run_sharded(2, fn, x, idx)


def test_num_experts_not_divisible_by_ranks_is_value_error():
    x, idx, w = _inputs(4, 8, 2, 10, 128)
    with pytest.raises(ValueError, match="num_experts"):
        _dispatch(4, 10, x, idx, w)
    with pytest.raises(ValueError, match="num_experts"):
        run_sharded(4, lambda i: jax_ep.get_dispatch_layout(i, num_experts=10, axis_name="ep"), idx)


def test_topk_larger_than_num_experts_is_value_error():
    R, T, K, E = 2, 8, 4, 2
    rng = np.random.default_rng(1)
    idx = rng.integers(0, E, size=(R, T, K)).astype(np.int32)
    w = np.ones((R, T, K), np.float32)
    x = oracle.make_x(rng, (R, T, 128), BF16)
    with pytest.raises(ValueError, match="topk"):
        _dispatch(R, E, x, idx, w)


@pytest.mark.parametrize("cap", [0, -3])
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_capacity_below_one_is_value_error(layout, cap):
    x, idx, w = _inputs(2, 8, 2, 8, 128)
    with pytest.raises(ValueError, match="capacity"):
        _dispatch(2, 8, x, idx, w, layout=layout, capacity=cap)


@pytest.mark.parametrize("bad", ["extra_k", "extra_token"])
def test_topk_weights_shape_mismatch_is_value_error(bad):
    x, idx, w = _inputs(2, 8, 2, 8, 128)
    w = np.concatenate([w, w[:, :, :1]], axis=2) if bad == "extra_k" else np.concatenate([w, w], axis=1)
    with pytest.raises(ValueError, match="topk_weights"):
        _dispatch(2, 8, x, idx, w)


def test_unknown_layout_is_value_error():
    x, idx, w = _inputs(2, 8, 2, 8, 128)
    with pytest.raises(ValueError, match="layout"):
        _dispatch(2, 8, x, idx, w, layout="token")


@pytest.mark.parametrize("align", [0, -4])
def test_expert_alignment_below_one_is_value_error(align):
    x, idx, w = _inputs(2, 8, 2, 8, 128)
    with pytest.raises(ValueError, match="alignment"):
        _dispatch(2, 8, x, idx, w, layout="expert", expert_alignment=align)


# ----------------------------------------------------------------- device-side


@pytest.mark.isolated
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_expert_id_out_of_range_raises_at_run_time_and_next_call_works(layout):
    R, T, K, E, H = 4, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=5)

    def fn(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout=layout)
        return o.recv_x, o.recv_topk_idx

    f = sharded(R, fn)
    exp = oracle.dispatch_rank((x,), idx, w, E) if layout == "rank" else oracle.dispatch_expert((x,), idx, w, E)
    for bad_id in (E, -2, 10 * E):
        bad = idx.copy()
        bad[1, 3, 1] = bad_id
        # The documented type to catch on either backend (jax_ep's own
        # EpRuntimeError is one too).
        with pytest.raises(jax.errors.JaxRuntimeError, match="(?i)expert"):
            jax.block_until_ready(f(x, bad, w))
        recv_x, ridx = (np.asarray(a) for a in jax.block_until_ready(f(x, idx, w)))
        for r in range(R):
            np.testing.assert_array_equal(recv_x[r].astype(np.float32), exp[r].payload[0].astype(np.float32))
            np.testing.assert_array_equal(ridx[r], exp[r].topk_idx)


@pytest.mark.isolated
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_capacity_overflow_raises_at_run_time_never_silent_drop_then_next_call_works(layout):
    R, T, K, E, H = 4, 16, 2, 8, 128
    rng = np.random.default_rng(12100 + len(layout))
    good_idx, w = oracle.make_topk(rng, R, T, K, E, drop=0.0)
    x = oracle.make_x(rng, (R, T, H), F32)
    if layout == "rank":
        cap = oracle.needed_capacity_rank(good_idx, E)
    else:
        cap = oracle.needed_capacity_expert(good_idx, E)
    over_idx, _ = oracle.make_topk(rng, R, T, K, E, mode="skewed")  # everything to rank 0
    need_over = (
        oracle.needed_capacity_rank(over_idx, E) if layout == "rank" else oracle.needed_capacity_expert(over_idx, E)
    )
    assert need_over > cap

    def fn(x, i, w):
        o = jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout=layout, capacity=cap)
        return o.recv_x, o.counts

    f = sharded(R, fn)
    with pytest.raises(Exception, match="(?i)capacity"):
        jax.block_until_ready(f(x, over_idx, w))
    recv_x, counts = (np.asarray(a) for a in jax.block_until_ready(f(x, good_idx, w)))
    exp = (
        oracle.dispatch_rank((x,), good_idx, w, E, capacity=cap)
        if layout == "rank"
        else oracle.dispatch_expert((x,), good_idx, w, E, capacity=cap)
    )
    for r in range(R):
        np.testing.assert_array_equal(recv_x[r], exp[r].payload[0])
        np.testing.assert_array_equal(counts[r], exp[r].counts if layout == "rank" else exp[r].group_sizes)


@pytest.mark.isolated
def test_capacity_overflow_by_one_row_is_detected():
    """Exactly one row too many on one rank must still raise."""
    R, T, K, E, H = 2, 8, 1, 4, 128
    idx = np.zeros((R, T, K), np.int32)
    idx[:, :, 0] = np.arange(T) % E  # rank 0 gets experts 0,1; rank 1 gets 2,3
    idx[0, 0, 0] = 0
    idx[0, 2, 0] = 1  # token 2 (was expert 2) now goes to rank 0: rank 0 has one extra row
    need = oracle.needed_capacity_rank(idx, E)
    rng = np.random.default_rng(3)
    x = oracle.make_x(rng, (R, T, H), F32)
    w = np.ones((R, T, K), np.float32)

    def fn(x, i, w):
        return jax_ep.dispatch(x, i, w, num_experts=E, axis_name="ep", layout="rank", capacity=need - 1).recv_x

    with pytest.raises(Exception, match="(?i)capacity"):
        jax.block_until_ready(sharded(R, fn)(x, idx, w))


def test_ops_outside_shard_map_or_on_a_wrong_axis_say_what_to_do():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import jax_ep
  x = jnp.ones((4, 128), jnp.bfloat16)
  idx = jnp.zeros((4, 2), jnp.int32)
  w = jnp.ones((4, 2), jnp.float32)
  with pytest.raises(ValueError, match="inside shard_map"):
    jax_ep.dispatch(x, idx, w, num_experts=8)
  with pytest.raises(ValueError, match="inside shard_map"):
    jax_ep.get_dispatch_layout(idx, num_experts=8)
  mesh = Mesh(np.array(jax.devices()[:2]), ("experts",))
  f = jax_ep.shard_map(lambda i: jax_ep.get_dispatch_layout(i, num_experts=8).num_tokens_per_rank,
                       mesh, axis_name="experts")
  with pytest.raises(ValueError, match="axis_name='ep'"):
    jax.jit(f)(jnp.zeros((8, 2), jnp.int32))


def test_ep_runtime_error_is_the_jax_runtime_error_users_catch():
    assert issubclass(jax_ep.EpRuntimeError, jax.errors.JaxRuntimeError)
    assert issubclass(jax_ep.EpRuntimeError, RuntimeError)


@pytest.mark.skipif(not __import__("jax_ep")._native.cuda_built(),
                    reason="the status messages are the native module's")
def test_a_status_message_names_the_op_the_cause_and_the_call():
    """What a kernel's status code becomes (the deferred report must name the
    call that caused it: docs/errors.md); op 3 = dispatch, cause 1 = bad id."""
    from jax_ep import _native
    describe = _native.module().describe_status
    code = (3 << 16) | (1 << 8)
    msg = describe(code, 1, 0, 10.0, 1234)
    assert "dispatch" in msg and "expert id" in msg and "EP rank 1" in msg, msg
    assert "[call 1234 on device 0]" in msg, msg
    assert "[call" not in describe(code, 1, 0, 10.0, 0), "an unknown call number (0) is left out"


def test_a_run_time_error_prints_once_not_once_per_rank(tmp_path):
    """docs/errors.md (end of its second section): on 8 CPU devices a bad
    expert id used to log a traceback per rank and again in an atexit
    callback; now the user's exception carries it and at most one line
    follows at exit."""
    import subprocess
    import sys
    script = tmp_path / "bad.py"
    script.write_text(
        "import numpy as np, jax, jax.numpy as jnp, jax_ep\n"
        "from jax.sharding import Mesh, PartitionSpec as P\n"
        "mesh = Mesh(np.array(jax.devices()), ('ep',))\n"
        "R = len(jax.devices())\n"
        "x = jnp.ones((R * 4, 128), jnp.bfloat16)\n"
        "idx = jnp.zeros((R * 4, 2), jnp.int32).at[3, 0].set(99).at[:, 1].set(1)\n"
        "f = jax.jit(jax.shard_map(lambda x, i: jax_ep.dispatch(x, i, None, num_experts=16).recv_x,\n"
        "            mesh=mesh, in_specs=(P('ep'), P('ep')), out_specs=P('ep')))\n"
        "try:\n"
        "    np.asarray(f(x, idx))\n"
        "except jax.errors.JaxRuntimeError as e:\n"
        "    assert 'expert id' in str(e)\n"
        "    print('CAUGHT')\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0 and "CAUGHT" in res.stdout, res.stderr[-3000:]
    assert "jax.debug.callback failed" not in res.stderr, res.stderr[-3000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.count("expert id") <= 1, res.stderr[-3000:]


@pytest.mark.skipif(not __import__("jax_ep")._native.cuda_built(),
                    reason="the status classification is the native module's")
def test_which_errors_refuse_the_next_op():
    """After a bad id, an overflow, a bad Engram index, a stale publication
    or a peer that failed its own checks the next op runs (its peers do not
    wait for it) and then reports; after a peer that never arrived, or
    low-latency calls out of order, it is refused (docs/errors.md, its table)."""
    from jax_ep import _native
    fatal = _native.module().is_fatal_status
    code = lambda op, cause, detail=0: (op << 16) | (cause << 8) | detail  # noqa: E731
    assert not fatal(0)
    for cause in (1, 2, 4, 6):  # bad id, overflow, bad index, stale publication
        assert not fatal(code(3, cause)), cause
    assert not fatal(code(3, 3, 0x80 | 1))  # peer 1 failed this call
    assert fatal(code(3, 3, 1))             # peer 1 did not arrive
    assert fatal(code(5, 7))                # low-latency out of order
    assert not fatal(code(3, 8, 1))         # peer 1 refused the call (stood in for its barriers)
    assert not fatal(code(3, 9, 1))         # peer 1 called with another configuration


@pytest.mark.skipif(not __import__("jax_ep")._native.cuda_built(),
                    reason="the status messages are the native module's")
def test_a_peer_that_refused_is_named_and_not_a_timeout():
    """The message of Cause::kPeerRefused (a peer whose handler refused
    told this rank through its barrier flag) names the peer and says the
    communicator stays usable, not that a peer never arrived."""
    from jax_ep import _native
    msg = _native.module().describe_status((3 << 16) | (8 << 8) | 1, 0, 0, 10.0)
    assert "peer rank 1 refused this call" in msg and "stays usable" in msg, msg
    assert "did not arrive" not in msg, msg
    msg = _native.module().describe_status((3 << 16) | (9 << 8) | 1, 0, 0, 10.0)
    assert "dispatch" in msg and "EP rank 1 called this op with another configuration" in msg, msg


def test_an_unknown_transport_argument_is_a_value_error_naming_the_choices():
  """Communicator.create(transport=...) is checked before anything else
  (docs/design.md §3), on any machine."""
  import re
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
  with pytest.raises(ValueError, match=re.escape("transport='nvlink' is not one of ('auto', 'gin', 'gin_emulated')")):
    jax_ep.Communicator.create(mesh, "ep", transport="nvlink")


# ------------------------------------------------- under jit, the documented type


def _bad_call(op):
    """(jitted per-rank function, its bad inputs, its good inputs) for one op
    whose device-side check must fire."""
    R, T, K, E, H = 2, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=40)
    bad = idx.copy()
    bad[1, 2, 0] = E + 3
    if op == "get_dispatch_layout":
        fn = lambda x, i, w: jax_ep.get_dispatch_layout(i, num_experts=E).num_tokens_per_rank  # noqa: E731
    elif op == "dispatch":
        fn = lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, layout="expert").recv_x  # noqa: E731
    elif op == "low_latency_dispatch":
        fn = lambda x, i, w: jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=T).recv_x  # noqa: E731
    elif op == "engram_fetch":
        table = np.random.default_rng(41).standard_normal((R, 16, H)).astype(np.float32)
        fn = lambda x, i, w, t=table: jax_ep.engram_fetch(jax.numpy.asarray(t)[0], i)  # noqa: E731
        bad = idx.copy()
        bad[1, 2, 0] = R * 16 + 7            # a table of R * 16 rows
        idx = np.where(idx >= 0, idx % (R * 16), -1).astype(np.int32)
    return sharded(R, fn), (x, bad, w), (x, idx, w)


@pytest.mark.isolated
@pytest.mark.parametrize("op", ["get_dispatch_layout", "dispatch", "low_latency_dispatch",
                                "engram_fetch"])
def test_under_jit_a_device_side_error_is_caught_as_the_documented_type_when_a_result_is_read(op):
    """docs/errors.md, "What to catch": jax.errors.JaxRuntimeError, whose
    text names the op and the cause; the call itself returns (the error
    belongs to its results) and the next good call works."""
    f, bad, good = _bad_call(op)
    result = f(*bad)                          # returns: the error belongs to the result
    try:
        np.asarray(jax.tree.leaves(result)[0])
    except jax.errors.JaxRuntimeError as e:   # the documented type
        assert f"jax_ep {op}:" in str(e), str(e)[-2000:]
    else:
        pytest.fail("no error when the bad call's result was read")
    np.asarray(jax.tree.leaves(f(*good))[0])


def test_ep_runtime_error_outside_jit_is_also_the_documented_type():
    """Where jax_ep's own Python raises (Communicator.check(), a check
    evaluated eagerly), it raises EpRuntimeError, which the documented
    `except jax.errors.JaxRuntimeError` catches too."""
    from jax_ep import _checks
    with pytest.raises(jax.errors.JaxRuntimeError, match="expert id 9"):
        _checks._check_p.bind(np.int32(1), np.int32(9), np.ones(2, np.float32),
                              message="jax_ep dispatch: expert id {}", num_details=1)


# ------------------------------------------------------ bad input gets an answer


@pytest.mark.isolated
@pytest.mark.parametrize("bad_id,shown", [(-2, "got -2"), (-7, "got -7"), (8, "got 8"),
                                          (1000, "got 1000")])
def test_a_bad_expert_id_is_reported_by_its_value(bad_id, shown):
    """Not the largest id of the routing (which was a valid one for -2)."""
    R, T, K, E, H = 2, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=42)
    idx[0, 5, 1] = bad_id
    with pytest.raises(jax.errors.JaxRuntimeError, match=shown + r";"):
        _dispatch(R, E, x, idx, w)


@pytest.mark.isolated
def test_bad_ids_on_both_sides_are_both_reported():
    R, T, K, E, H = 2, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=43)
    idx[0, 5, 1] = -3
    idx[1, 2, 0] = 11
    with pytest.raises(jax.errors.JaxRuntimeError, match="got -3 and 11"):
        _dispatch(R, E, x, idx, w)


def test_combine_with_the_handle_of_another_dispatch_is_a_value_error_naming_handle():
    """Two dispatches of the same shapes: their handles differ only in
    values, so y or the weights of one with the handle of the other would
    combine silently into wrong sums. The handle, the rows, the weights and
    the counts each know the dispatch that made them (grouped_matmul's
    result that of its group sizes)."""
    R, T, K, E, H = 2, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=44)
    idx2 = np.roll(idx, 1, axis=1)

    def fn(x, i, i2, w):
        a = jax_ep.dispatch(x, i, w, num_experts=E, layout="expert")
        b = jax_ep.dispatch(x, i2, w, num_experts=E, layout="expert")
        return jax_ep.combine(a.recv_x * 2, b.handle, a.recv_topk_weights)  # y: unknown

    with pytest.raises(ValueError, match="handle and weights come from two different dispatches"):
        run_sharded(R, fn, x, idx, idx2, w)

    def rows_only(x, i, i2, w):                 # y straight from the other dispatch, no weights
        a = jax_ep.dispatch(x, i, w, num_experts=E)
        b = jax_ep.dispatch(x, i2, w, num_experts=E)
        return jax_ep.combine(a.recv_x, b.handle)

    with pytest.raises(ValueError, match="handle and y come from two different dispatches"):
        run_sharded(R, rows_only, x, idx, idx2, w)

    def through_experts(x, i, i2, w):           # y made by the expert GEMMs on a's rows
        import jax.numpy as jnp
        a = jax_ep.dispatch(x, i, w, num_experts=E, layout="expert")
        b = jax_ep.dispatch(x, i2, w, num_experts=E, layout="expert")
        ws = jnp.ones((E // R, H, H), x.dtype)
        y = jax_ep.grouped_matmul(a.recv_x, ws, a.counts)
        return jax_ep.combine(y, b.handle, b.recv_topk_weights)

    with pytest.raises(ValueError, match="handle and y come from two different dispatches"):
        run_sharded(R, through_experts, x, idx, idx2, w)

    def split(x, i, i2, w):                     # the rows of a dispatch_start / dispatch_done
        a = jax_ep.dispatch(x, i, w, num_experts=E)
        b = jax_ep.dispatch_done(jax_ep.dispatch_start(x, i2, w, num_experts=E))
        return jax_ep.combine(b.recv_x, a.handle)

    with pytest.raises(ValueError, match="handle and y come from two different dispatches"):
        run_sharded(R, split, x, idx, idx2, w)

    def same(x, i, i2, w):
        a = jax_ep.dispatch(x, i, w, num_experts=E, layout="expert")
        b = jax_ep.dispatch(x, i2, w, num_experts=E, layout="expert")
        return (jax_ep.combine(a.recv_x, a.handle, a.recv_topk_weights),
                jax_ep.combine(b.recv_x, b.handle, b.recv_topk_weights))

    run_sharded(R, same, x, idx, idx2, w)   # matching pairs: no error


@pytest.mark.isolated
def test_a_cached_dispatch_with_another_routing_raises_at_run_time_naming_the_handle():
    R, T, K, E, H = 2, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=45)
    other = idx.copy()
    other[1, 0] = other[1, 1]

    def fn(x, i, i2, w):
        a = jax_ep.dispatch(x, i, w, num_experts=E)
        return jax_ep.dispatch(x * 2, i2, w, num_experts=E, handle=a.handle).recv_x

    with pytest.raises(jax.errors.JaxRuntimeError, match="handle was made for another routing"):
        run_sharded(R, fn, x, idx, other, w)
    got = run_sharded(R, fn, x, idx, idx, w)      # the same routing in another array: fine
    exp = oracle.dispatch_rank((x * 2,), idx, w, E)
    for r in range(R):
        np.testing.assert_array_equal(got[r], exp[r].payload[0])


def test_combine_outside_shard_map_says_to_call_it_inside_shard_map():
    import jax.numpy as jnp
    R, T, K, E, H = 2, 8, 2, 8, 128
    x, idx, w = _inputs(R, T, K, E, H, seed=46)
    handle = run_sharded(R, lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E).handle,
                         x, idx, w)
    handle = jax.tree.map(lambda a: jnp.asarray(a[0]), handle)
    with pytest.raises(ValueError, match="inside shard_map over the expert-parallel mesh axis"):
        jax_ep.combine(jnp.zeros((5, H), jnp.bfloat16), handle)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("combine_layout", [None, "rank", "expert"])
def test_nn_moe_with_zero_tokens_returns_zero_tokens_and_gradients(ranks, combine_layout):
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("ep",))
    layer = jax_ep.nn.MoE(16, 32, 2 * ranks, 2, mesh=mesh, combine_layout=combine_layout,
                          rngs=nnx.Rngs(0))
    x = jnp.zeros((0, 16), jnp.float32)
    assert layer(x).shape == (0, 16)
    grads = nnx.grad(lambda m: jnp.sum(m(x)))(layer)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))


def test_nn_moe_given_another_width_is_a_value_error_naming_x():
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    layer = jax_ep.nn.MoE(16, 32, 4, 2, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., hidden=16\].*\[8, 24\]"):
        layer(jnp.zeros((8, 24), jnp.float32))


def test_the_check_passes_its_payload_through_vmap_grad_and_jvp_and_fires_per_batch_element():
    import jax.numpy as jnp
    from jax_ep import _checks
    f = lambda b, d, x: _checks._check_p.bind(b, d, x, message="jax_ep test: bad {}",  # noqa: E731
                                              num_details=1)[0]
    x = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(jax.jit(jax.vmap(f))(jnp.zeros(3, jnp.int32), jnp.arange(3), x), x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="bad 2"):
        np.asarray(jax.jit(jax.vmap(f))(jnp.array([0, 1, 0], jnp.int32), jnp.arange(3), x))
    g = jax.jit(jax.grad(lambda v: jnp.sum(f(jnp.int32(0), jnp.int32(0), v) ** 2)))(x[1])
    np.testing.assert_array_equal(g, 2 * x[1])
    _, t = jax.jvp(lambda v: f(jnp.int32(0), jnp.int32(0), v), (x[0],), (x[2],))
    np.testing.assert_array_equal(t, x[2])
