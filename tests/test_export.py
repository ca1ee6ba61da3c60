"""jax.export of programs that use jax_ep (docs/errors.md, "Exported
programs"): a jitted training step with nn.MoE and the ops serialises,
deserialises and runs on CPU with the same results as under jit, and lowers
for CUDA from this CPU machine; the run-time checks stay on, as data: a bad
expert id makes the exported program's payload NaN instead of raising (a host
callback cannot be serialised)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import _native

pytest.importorskip("flatbuffers")  # jax's Exported.serialize needs it
nnx = pytest.importorskip("flax.nnx")

R, T, H, F, E, K = 2, 8, 32, 64, 4, 2


def _mesh() -> Mesh:
  if len(jax.devices()) < R:
    pytest.skip(f"needs {R} devices")
  return Mesh(np.array(jax.devices()[:R]), ("ep",))


def _training_step(mesh: Mesh):
  """(step, leaves, data): step(leaves, x, idx, w, target) -> (loss, new
  leaves), a plain SGD step over an nn.MoE layer and a dispatch -> combine of
  x along a given routing (get_dispatch_layout's counts in the loss too), the
  layer's state as a flat list so the exported signature is plain arrays."""
  model = jax_ep.nn.MoE(H, F, E, K, mesh=mesh, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)

  def ops(x, idx, w):
    lay = jax_ep.get_dispatch_layout(idx, num_experts=E)
    out = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert")
    y = jax_ep.combine(out.recv_x, out.handle, out.recv_topk_weights)
    return y, lay.num_tokens_per_rank[None]

  ops_sharded = jax_ep.shard_map(ops, mesh)

  def step(leaves, x, idx, w, target):
    def loss_fn(leaves):
      m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
      y, per_rank = ops_sharded(x, idx, w)
      err = m(x).astype(jnp.float32) + y.astype(jnp.float32) - target
      return jnp.mean(err * err) + 1e-3 * jnp.sum(per_rank).astype(jnp.float32)
    loss, grads = jax.value_and_grad(loss_fn)(leaves)
    return loss, [p - 0.05 * g for p, g in zip(leaves, grads)]

  rng = np.random.default_rng(2026)
  tokens = NamedSharding(mesh, P("ep"))
  idx = np.argsort(rng.random((R * T, E)), axis=1)[:, :K].astype(np.int32)
  idx[rng.random(idx.shape) < 0.2] = -1
  data = dict(x=rng.standard_normal((R * T, H)).astype(np.float32),
              idx=idx, w=rng.uniform(0.1, 1.0, (R * T, K)).astype(np.float32),
              target=rng.standard_normal((R * T, H)).astype(np.float32))
  data = {k: jax.device_put(v, tokens) for k, v in data.items()}
  return step, leaves, data


def _args(leaves, data, idx=None):
  return (leaves, data["x"], data["idx"] if idx is None else idx, data["w"], data["target"])


def test_an_exported_training_step_serialises_deserialises_and_runs_like_jit():
  mesh = _mesh()
  step, leaves, data = _training_step(mesh)
  args = _args(leaves, data)
  want_loss, want_leaves = jax.jit(step)(*args)
  blob = jax.export.export(jax.jit(step))(*args).serialize()
  assert isinstance(blob, (bytes, bytearray)) and len(blob) > 0
  exported = jax.export.deserialize(blob)
  got_loss, got_leaves = exported.call(*args)
  np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
  for g, w in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
  assert np.isfinite(np.asarray(got_loss))


def test_in_an_exported_step_a_bad_expert_id_makes_the_loss_nan_not_a_wrong_number():
  """Under jit the bad id raises when the result is read; the exported program
  cannot call back into Python, so its check poisons the payload: the loss
  is NaN, and the next good call is finite again."""
  mesh = _mesh()
  step, leaves, data = _training_step(mesh)
  bad_idx = np.asarray(data["idx"]).copy()
  bad_idx[3, 1] = E + 1
  bad_idx = jax.device_put(bad_idx, data["idx"].sharding)
  with pytest.raises(jax.errors.JaxRuntimeError, match="expert id outside"):
    np.asarray(jax.jit(step)(*_args(leaves, data, bad_idx))[0])
  exported = jax.export.deserialize(
      jax.export.export(jax.jit(step))(*_args(leaves, data)).serialize())
  loss, new_leaves = exported.call(*_args(leaves, data, bad_idx))
  assert np.isnan(np.asarray(loss))
  assert np.isfinite(np.asarray(exported.call(*_args(leaves, data))[0]))


def test_an_exported_dispatch_with_a_bad_id_delivers_nan_rows_on_every_rank():
  mesh = _mesh()
  tokens = NamedSharding(mesh, P("ep"))

  def per_rank(x, idx):
    out = jax_ep.dispatch(x, idx, None, num_experts=E)
    return out.recv_x, jax_ep.get_dispatch_layout(idx, num_experts=E).num_tokens_per_rank[None]

  f = jax.jit(jax_ep.shard_map(per_rank, mesh))
  x = jax.device_put(jnp.ones((R * T, H), jnp.bfloat16), tokens)
  idx = np.zeros((R * T, K), np.int32)
  idx[:, 1] = 2                               # every token: expert 0 (rank 0) and 2 (rank 1)
  good = jax.device_put(idx.copy(), tokens)   # (CPU device_put may alias the host array)
  idx[T + 1, 0] = -2                          # on rank 1
  bad = jax.device_put(idx, tokens)
  exported = jax.export.deserialize(jax.export.export(f)(x, good).serialize())
  rows, per_rank_counts = (np.asarray(a) for a in exported.call(x, bad))
  rows = rows.astype(np.float32).reshape(R, -1, H)
  for r in range(R):                          # the rows each rank received are NaN
    assert np.isnan(rows[r, :T]).all(), r
  assert (per_rank_counts == -1).all()
  rows, per_rank_counts = (np.asarray(a) for a in exported.call(x, good))
  assert not np.isnan(rows.astype(np.float32)).any() and (per_rank_counts == T).all()


def test_a_training_step_exports_for_cuda_from_this_cpu_machine():
  """Lowering only (no GPU here): the checks do not stop the CUDA export.
  With the CUDA build the expert GEMMs lower to jax_ep's grouped GEMM
  calls, which (as every non-jax custom call) must be allowed at export."""
  mesh = _mesh()
  step, leaves, data = _training_step(mesh)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _native.TARGETS]
  exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=checks)(
      *_args(leaves, data))
  assert exported.platforms == ("cuda",)
  assert len(exported.serialize()) > 0
  targets = set(re.findall(r"custom_call @(\w+)", exported.mlir_module()))
  assert not {t for t in targets if "callback" in t}, targets  # no host callback in it


def test_a_training_step_on_the_kernels_exports_for_cuda(monkeypatch):
  """As if a Communicator existed: the step lowers to jax_ep's custom calls
  (allowed explicitly, as every non-jax custom call must be) and serialises."""
  import dataclasses

  from jax_ep.ops import _backend

  @dataclasses.dataclass
  class _FakeComm:
    comm_id: int = 4242424242
    num_ranks: int = R
    num_bytes: int = 1 << 30

  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _FakeComm())
  mesh = _mesh()
  step, leaves, data = _training_step(mesh)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _native.TARGETS]
  exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=checks)(
      *_args(leaves, data))
  text = exported.mlir_module()
  assert "jax_ep_dispatch" in text and "jax_ep_combine" in text
  assert len(exported.serialize()) > 0
