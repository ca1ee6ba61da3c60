"""The public ops pick the CUDA kernels when a Communicator exists: lowered
for the cuda platform (jax.export only lowers, so this runs on CPU), a step
that calls get_dispatch_layout, dispatch and combine holds the jax_ep custom
calls with the communicator's id; lowered for CPU it holds none."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_ep
from jax_ep import _native
from jax_ep.ops import _backend

COMM_ID = 4242424242
TARGETS = ("jax_ep_dispatch_layout", "jax_ep_dispatch", "jax_ep_combine")


@dataclasses.dataclass
class _FakeComm:
  comm_id: int = COMM_ID
  num_ranks: int = 2


@pytest.fixture
def fake_comm(monkeypatch):
  """As if jax_ep were built with CUDA and a Communicator existed for 'ep'."""
  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _FakeComm())


def _step(E, layout):
  def per_rank(x, idx, w):
    lay = jax_ep.get_dispatch_layout(idx, num_experts=E)
    o = jax_ep.dispatch(x, idx, w, num_experts=E, layout=layout)
    cw = o.recv_topk_weights if layout == "expert" else None
    return jax_ep.combine(o.recv_x, o.handle, cw), lay.num_tokens_per_rank
  return per_rank


def _lower(platform: str, layout: str) -> str:
  R, T, H, K, E = 2, 16, 256, 4, 16
  devs = jax.devices()[:R]
  if len(devs) < R:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(devs), ("ep",))
  f = jax_ep.shard_map(_step(E, layout), mesh)
  args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16), jax.ShapeDtypeStruct((R * T, K), jnp.int32),
          jax.ShapeDtypeStruct((R * T, K), jnp.float32))
  if platform == "cpu":  # this machine's platform; the reference's error callbacks don't export
    return jax.jit(f).lower(*args).as_text()
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]
  exp = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)
  return exp.mlir_module()


@pytest.mark.skipif(not _native.cuda_built(), reason="the CUDA wrappers need jax_ep built with CUDA")
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_public_ops_lower_to_jax_ep_custom_calls_for_cuda(fake_comm, layout):
  text = _lower("cuda", layout)
  for target in TARGETS:
    lines = [l for l in text.splitlines() if target + '"' in l or "@" + target + "(" in l]
    assert lines, f"{target} not in the cuda lowering"
    assert all(str(COMM_ID) in l for l in lines), (target, lines[0][:300])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowers for this machine's platform")
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_public_ops_lower_to_the_reference_for_cpu(fake_comm, layout):
  text = _lower("cpu", layout)
  for target in TARGETS:
    assert target + '"' not in text and "@" + target + "(" not in text, target
