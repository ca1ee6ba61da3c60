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
