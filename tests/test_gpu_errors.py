"""Checked mode (Communicator.create(checked=True), docs/errors.md): a
device-side error fails the program that caused it, so waiting on any of its
results raises, naming the op and the cause; the next correct call works.
On the GPUs (the `gpu` marker)."""
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

COMM_BYTES = 256 << 20
COMM_CHECKED = True  # conftest's gpu_comm reads it


@pytest.fixture(scope="module")
def comm(gpu_comm):
  assert gpu_comm.checked
  return gpu_comm


def _case(rng, R, T=64, H=256, K=4, E=16):
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
  w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
  x = (rng.standard_normal((R, T, H)) * 3).astype(np.float32)
  return x, idx, w, E


def _dispatch(comm, E, backend="cuda", **kw):
  return h.per_rank_jit(comm.mesh, lambda x, i, w: jax_ep.dispatch(
      x.astype(jax.numpy.bfloat16), i, w, num_experts=E, backend=backend, **kw).recv_x)


@pytest.mark.parametrize("fault", ["expert id", "capacity"])
def test_checked_mode_raises_when_the_bad_calls_result_is_waited_on(comm, fault):
  rng = np.random.default_rng(stable_seed("checked", fault))
  x, idx, w, E = _case(rng, comm.num_ranks)
  kw = {}
  if fault == "expert id":
    idx = idx.copy()
    idx[comm.num_ranks - 1, 7, 2] = E + 3
  else:
    kw = dict(capacity=4)
  args = [h.put(comm.mesh, v) for v in (x, idx, w)]
  with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?i)dispatch.*{fault}"):
    np.asarray(jax.block_until_ready(_dispatch(comm, E, **kw)(*args)))
  comm.check()  # already reported by the call itself: nothing left over
  # The next correct call works and equals the reference.
  _, good_idx, _, _ = _case(np.random.default_rng(stable_seed("checked-good", fault)),
                            comm.num_ranks)
  good = [h.put(comm.mesh, v) for v in (x, good_idx, w)]
  got = np.asarray(jax.block_until_ready(_dispatch(comm, E)(*good)))
  ref = np.asarray(_dispatch(comm, E, backend="reference")(*good))
  np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_checked_mode_combine_and_a_training_like_loop_stay_correct(comm):
  """Checked mode changes no result: dispatch -> combine in a jitted loop of
  20 steps equals the reference bit for bit."""
  rng = np.random.default_rng(stable_seed("checked-loop"))
  x, idx, w, E = _case(rng, comm.num_ranks, T=128, H=512, K=8, E=32)

  def step(backend):
    def f(x, i, w):
      def body(c, _):
        o = jax_ep.dispatch(c, i, w, num_experts=E, layout="expert", backend=backend)
        y = jax_ep.combine(o.recv_x, o.handle, o.recv_topk_weights, backend=backend)
        return y.astype(c.dtype), None
      return jax.lax.scan(body, x.astype(jax.numpy.bfloat16), None, length=20)[0]
    return h.per_rank_jit(comm.mesh, f)

  args = [h.put(comm.mesh, v) for v in (x, idx, w)]
  got = np.asarray(jax.block_until_ready(step("cuda")(*args)))
  ref = np.asarray(step("reference")(*args))
  np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
  comm.check()


def test_checked_mode_bad_engram_index_fails_its_own_program(comm):
  """An Engram index >= V on one rank: in checked mode the fetch's own
  program fails when its rows are waited on, naming engram_fetch and the
  cause; nothing is left for check(); the next fetch is bitwise the gather."""
  R, VL, D, T, e = comm.num_ranks, 512, 128, 64, 8
  rng = np.random.default_rng(stable_seed("checked-engram"))
  shards = (rng.standard_normal((R, VL, D)) * 2).astype(jax.numpy.bfloat16)
  idx = rng.integers(-1, R * VL, size=(R, T, e)).astype(np.int32)
  bad = idx.copy()
  bad[R - 1, 5, 3] = R * VL + 9
  f = h.per_rank_jit(comm.mesh, lambda t, i: jax_ep.engram_fetch(
      jax_ep.engram_publish(t, axis_name=h.AXIS, backend="cuda"), i))
  tab = h.put(comm.mesh, shards)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"engram_fetch.*index out of range"):
    np.asarray(jax.block_until_ready(f(tab, h.put(comm.mesh, bad))))
  comm.check()
  got = np.asarray(jax.block_until_ready(f(tab, h.put(comm.mesh, idx))))
  table = shards.reshape(R * VL, D)
  want = np.where(idx[..., None] >= 0, table[np.maximum(idx, 0)], 0).astype(shards.dtype)
  np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_checked_mode_low_latency_overflow_fails_its_own_program(comm):
  """A token that repeats one expert in its top-k more often than
  max_tokens allows overflows that expert's (expert, source) slots: in
  checked mode the low-latency dispatch's own program fails naming the op
  and the overflow; the next correct call's counts are the reference's."""
  R, T, H, K, E, mt = comm.num_ranks, 4, 256, 8, 8, 4
  rng = np.random.default_rng(stable_seed("checked-ll"))
  x = rng.standard_normal((R, T, H)).astype(jax.numpy.bfloat16)
  good = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
  bad = good.copy()
  bad[:, :, :] = 0          # every (token, k) of every rank to expert 0: T*K = 32 rows > mt
  # Above the bytes this module's dispatches use (docs/low_latency.md).
  f = h.per_rank_jit(comm.mesh, lambda x, i: jax_ep.low_latency_dispatch(
      x, i, num_experts=E, max_tokens=mt, reserved_bytes=COMM_BYTES // 2,
      backend="cuda").recv_count)
  xs = h.put(comm.mesh, x)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"(?i)low_latency.*(overflow|capacity)"):
    np.asarray(jax.block_until_ready(f(xs, h.put(comm.mesh, bad))))
  comm.check()
  got = np.asarray(jax.block_until_ready(f(xs, h.put(comm.mesh, good))))
  ref = np.asarray(h.per_rank_jit(comm.mesh, lambda x, i: jax_ep.low_latency_dispatch(
      x, i, num_experts=E, max_tokens=mt, backend="reference").recv_count)(
          xs, h.put(comm.mesh, good)))
  np.testing.assert_array_equal(got, ref)
