"""get_dispatch_layout's CUDA kernel is bitwise equal to the reference (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

import jax

from jax_ep import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and GPUs"),
]

if _native.cuda_available():
    import gpu_helpers as h
    from jax_ep._ffi import layout as layout_ffi


@pytest.fixture(scope="module")
def comm(gpu_comm):
    return gpu_comm


def _run_layout(comm, idx, E):
    R = comm.num_ranks
    f = h.per_rank_jit(comm.mesh, lambda i: layout_ffi.layout(i, num_experts=E, num_ranks=R,
                                                              comm_id=comm.comm_id))
    return [np.asarray(a) for a in jax.block_until_ready(f(h.put(comm.mesh, idx)))]


@pytest.mark.parametrize("T", [0, 1, 127, 4096])
@pytest.mark.parametrize("K,E", [(8, 256), (2, 8), (6, 64)])
def test_layout_kernel_bitwise_equals_reference(comm, T, K, E):
    R = comm.num_ranks
    rng = np.random.default_rng(1000 * T + 10 * K + E)
    idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
    outs = _run_layout(comm, idx, E)
    names = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "pos_in_rank")
    for r in range(R):
        want = h.reference_layout(idx[r], E, R)
        oracle = h.layout_oracle(idx[r], E, R)
        for k, name in enumerate(names):
            assert outs[k][r].dtype == want[k].dtype, name
            np.testing.assert_array_equal(outs[k][r], want[k], err_msg=f"{name} rank {r}")
            np.testing.assert_array_equal(outs[k][r], oracle[k], err_msg=f"{name} rank {r} oracle")
    comm.check()


def test_layout_counts_a_token_once_per_rank_with_several_experts_there(comm):
    R, E = comm.num_ranks, 8
    if R not in (1, 2):
        pytest.skip("expected values written for EP1 and EP2")
    idx = np.array([[[0, 1, 2], [4, -1, 5], [-1, -1, -1], [3, 7, 3]]] * R, np.int32)
    per_rank, per_expert, in_rank, pos = (a[0] for a in _run_layout(comm, idx, E))
    np.testing.assert_array_equal(per_expert, [1, 1, 1, 2, 1, 1, 0, 1])
    if R == 2:  # experts 0..3 on rank 0, 4..7 on rank 1
        np.testing.assert_array_equal(per_rank, [2, 2])
        np.testing.assert_array_equal(in_rank, [[1, 0], [0, 1], [0, 0], [1, 1]])
        np.testing.assert_array_equal(pos, [[0, -1], [-1, 0], [-1, -1], [1, 1]])
    else:  # every expert on the one rank: each token with an id counts once
        np.testing.assert_array_equal(per_rank, [3])
        np.testing.assert_array_equal(in_rank, [[1], [1], [0], [1]])
        np.testing.assert_array_equal(pos, [[0], [1], [-1], [2]])


def test_public_op_cuda_backend_equals_reference_backend(comm):
    import jax_ep

    R, T, K, E = comm.num_ranks, 300, 4, 32
    rng = np.random.default_rng(5)
    idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
    outs = {}
    for backend in ("cuda", "reference"):
        f = h.per_rank_jit(comm.mesh, lambda i, b=backend: tuple(jax_ep.get_dispatch_layout(
            i, num_experts=E, axis_name=h.AXIS, backend=b)))
        outs[backend] = [np.asarray(a) for a in f(h.put(comm.mesh, idx))]
    for a, b in zip(outs["cuda"], outs["reference"]):
        np.testing.assert_array_equal(a, b)


def test_bad_expert_id_raises_naming_the_op_on_the_next_call(comm):
    R, T, K, E = comm.num_ranks, 64, 2, 8
    rng = np.random.default_rng(9)
    idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
    bad = idx.copy()
    bad[0, 5, 1] = E  # rank 0 only; out of [-1, E)
    bad[0, 9, 0] = -7
    f = h.per_rank_jit(comm.mesh, lambda i: layout_ffi.layout(i, num_experts=E, num_ranks=R,
                                                              comm_id=comm.comm_id))
    outs = [np.asarray(a) for a in jax.block_until_ready(f(h.put(comm.mesh, bad)))]
    # The bad ids count nothing; the rest of the layout is still right.
    masked = bad[0].copy()
    masked[(masked < -1) | (masked >= E)] = -1
    for k, want in enumerate(h.layout_oracle(masked, E, R)):
        np.testing.assert_array_equal(outs[k][0], want)
    with pytest.raises(Exception, match=r"get_dispatch_layout.*expert id out of range"):
        jax.block_until_ready(f(h.put(comm.mesh, idx)))
    # Reported once: the communicator is usable again.
    outs = [np.asarray(a) for a in jax.block_until_ready(f(h.put(comm.mesh, idx)))]
    np.testing.assert_array_equal(outs[0][R - 1], h.layout_oracle(idx[R - 1], E, R)[0])
    comm.check()


def test_bad_expert_id_is_visible_through_check(comm):
    from jax_ep._checks import EpRuntimeError

    R, E = comm.num_ranks, 8
    idx = np.full((R, 4, 2), -1, np.int32)
    idx[R - 1, 0, 0] = 99  # the last rank (the only one at EP1)
    _run_layout(comm, idx, E)
    with pytest.raises(EpRuntimeError, match=rf"get_dispatch_layout \(EP rank {R - 1}"):
        comm.check()
    comm.check()  # cleared
