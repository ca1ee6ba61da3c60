"""Normal dispatch/combine through their GIN code path, on 2 NVLink GPUs.

With transport="gin_emulated" every remote peer is a GIN peer (no LSA
pointer reaches the kernels for it), and gin.cuh's helpers carry the puts and
signals over NVLink. So every GIN branch of the kernels (control words put
ahead of the barrier signal, staged chunks put with per-chunk signals,
expert-layout combine rows put one by one, waits on signal snapshots) runs
here, and must give the reference's bits, as the LSA path does in
test_gpu_dispatch.py.

A module of its own: the ops use the most recently created Communicator of
the axis, so this module's emulated one must not outlive it into other
modules' tests, nor theirs shadow it here.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax

import jax_ep
from jax_ep import _native
from oracle import stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and GPUs"),
]

if _native.cuda_available():
  import gpu_helpers as h
  from test_gpu_dispatch import (_assert_same, _both, _inputs, _rows_fn,
                                 check_errors_then_next_call_works,
                                 check_expert_alignment_and_small_capacity, check_repetitions_no_drift)

COMM_BYTES = 1 << 30


@pytest.fixture(scope="module")
def comm():
  devs = jax.devices("cuda")
  if len(devs) < 2:
    pytest.skip("needs 2 GPUs")
  from jax_ep.comm import Communicator
  mesh = jax.sharding.Mesh(np.array(devs[:2]), ("ep",))
  c = Communicator.create(mesh, "ep", COMM_BYTES, transport="gin_emulated")
  yield c
  c.close()


def test_every_remote_peer_is_an_emulated_gin_peer(comm):
  info = _native.module().comm_info(comm.comm_id)
  assert len(info) == 2
  for d in info:
    assert d["gin_emulated"] is True
    assert d["gin_mask"] == 1 << (1 - d["rank"]), d


CASES = [
    # T, H, K, E, dtype, mode
    (0, 128, 1, 8, "bfloat16", "random"),            # no tokens at all
    (1, 128, 1, 8, "bfloat16", "random"),
    (1, 2048, 8, 256, "float32", "random"),
    (127, 2048, 6, 64, "bfloat16", "random"),
    (200, 512, 4, 16, "bfloat16", "random"),         # several 32-row chunks
    (127, 2048, 8, 64, "bfloat16", "empty_rank"),    # one rank sends nothing
    (127, 128, 6, 8, "bfloat16", "skewed"),
    (4096, 2048, 1, 8, "float32", "skewed"),         # chunks longer than 32 rows (31 channels)
    (4096, 7168, 8, 256, "bfloat16", "random"),
    (127, 2048, 8, 256, "fp8_pair", "random"),
    (4096, 7168, 8, 256, "fp8_pair", "random"),
]


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("T,H,K,E,dtype,mode", CASES)
def test_gin_emulated_dispatch_and_combine_bitwise_equal_reference(comm, layout, T, H, K, E, dtype,
                                                                    mode):
  rng = np.random.default_rng(stable_seed(T, H, K, E, dtype, mode, layout, "gin"))
  x, idx, w = _inputs(rng, comm.num_ranks, T, H, K, E, dtype, mode)
  (oc, cc), (orf, cr) = _both(comm, E, layout, False, _rows_fn, x, idx, w)
  _assert_same((oc.recv_x, oc.recv_topk_idx, oc.recv_topk_weights, oc.counts, oc.handle),
               (orf.recv_x, orf.recv_topk_idx, orf.recv_topk_weights, orf.counts, orf.handle),
               "dispatch")
  _assert_same(cc, cr, "combine")


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_gin_emulated_in_kernel_fp8_cast_bitwise_equal_reference(comm, layout):
  rng = np.random.default_rng(23)
  x, idx, w = _inputs(rng, comm.num_ranks, 127, 2048, 6, 64, "bfloat16", "random")
  (oc, cc), (orf, cr) = _both(comm, 64, layout, True, _rows_fn, x, idx, w)
  _assert_same((oc.recv_x, oc.handle), (orf.recv_x, orf.handle), "dispatch")
  _assert_same(cc, cr, "combine")


def test_gin_emulated_expert_alignment_and_small_capacity_bitwise(comm):
  check_expert_alignment_and_small_capacity(comm)


def test_gin_emulated_errors_raise_then_next_call_works(comm):
  check_errors_then_next_call_works(comm)


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_gin_emulated_200_repetitions_no_drift_no_hang(comm, layout):
  check_repetitions_no_drift(comm, 200, layout)


def test_ops_without_a_gin_data_path_are_refused(comm):
  """get_dispatch_layout's kernel reaches peers by LSA pointer only: with GIN
  peers it must refuse (a clear error), not write through a null pointer."""
  idx = np.stack([h.random_topk(np.random.default_rng(r), 16, 2, 8) for r in range(2)])
  f = h.per_rank_jit(comm.mesh, lambda i: jax_ep.get_dispatch_layout(i, num_experts=8,
                                                                     backend="cuda"))
  with pytest.raises(Exception, match="GIN"):
    jax.block_until_ready(f(h.put(comm.mesh, idx)))
  # The communicator is still usable for the ops that have a GIN path.
  test_gin_emulated_expert_alignment_and_small_capacity_bitwise(comm)
