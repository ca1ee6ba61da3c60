"""dispatch_start / dispatch_done and combine_start / combine_done: the same
values and gradients as the fused ops (CPU, reference backend), and on CUDA a
lowering where the start's kernels carry `start = 1`, the done aliases every
start result, and the overlapped compute sits between them."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_ep
from jax_ep.ops import _backend
from oracle import make_topk

COMM_ID = 5151515151


def _inputs(R, T, H, K, E, seed, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((R, T, H)), dtype)
  idx, w = make_topk(rng, R, T, K, E)
  w = jnp.asarray(w, jnp.float32)
  s = jnp.asarray(rng.standard_normal((R, T, H)), jnp.float32)
  return x, jnp.asarray(idx, jnp.int32), w, s


def _layer(split: bool, E: int, layout: str):
  """Rows out, a per-row transform, rows back; a 'shared expert' (tanh of s)
  between start and done when split."""
  def fn(x, idx, w, s):
    if split:
      p = jax_ep.dispatch_start(x, idx, w, num_experts=E, layout=layout)
      p, s2 = jax_ep.ordered_after(p, s)
      shared = jnp.tanh(s2)
      o = jax_ep.dispatch_done(p, after=shared)
    else:
      o = jax_ep.dispatch(x, idx, w, num_experts=E, layout=layout)
      shared = jnp.tanh(s)
    y = (o.recv_x.astype(jnp.float32) * 1.5).astype(o.recv_x.dtype)
    cw = o.recv_topk_weights if layout == "expert" else None
    if split:
      pc = jax_ep.combine_start(y, o.handle, cw)
      pc, sh = jax_ep.ordered_after(pc, shared)
      sh = sh * 2.0
      out = jax_ep.combine_done(pc, after=sh)
    else:
      out = jax_ep.combine(y, o.handle, cw)
      sh = shared * 2.0
    return out, sh, o.recv_x, o.recv_topk_weights, o.counts
  return fn


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("R", [1, 4])
def test_split_ops_equal_the_fused_ops_bitwise(run, R, layout):
  T, H, K, E = 24, 128, 3, 4 * R
  args = _inputs(R, T, H, K, E, seed=7 + R + (layout == "expert"))
  fused = run(R, _layer(False, E, layout), *args)
  split = run(R, _layer(True, E, layout), *args)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(split)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_split_ops_have_the_fused_ops_gradients(layout):
  from conftest import sharded
  R, T, H, K, E = 4, 16, 128, 2, 8
  x, idx, w, s = _inputs(R, T, H, K, E, seed=11, dtype=jnp.float32)

  def loss(split):
    f = sharded(R, _layer(split, E, layout))

    def l(x, w, s):
      out, sh, _, rw, _ = f(x, idx, w, s)
      return jnp.sum(out * jnp.cos(out)) + jnp.sum(sh ** 2) + jnp.sum(jnp.sin(rw))
    return jax.jit(jax.grad(l, argnums=(0, 1, 2)))

  g_fused = loss(False)(x, w, s)
  g_split = loss(True)(x, w, s)
  for a, b in zip(g_fused, g_split):
    assert np.any(np.asarray(a) != 0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_done_rejects_what_is_not_a_pending_op():
  with pytest.raises(ValueError, match="PendingDispatch"):
    jax_ep.dispatch_done(jnp.zeros(3))
  with pytest.raises(ValueError, match="PendingCombine"):
    jax_ep.combine_done(jnp.zeros(3))


@dataclasses.dataclass
class _FakeComm:
  comm_id: int = COMM_ID
  num_ranks: int = 2
  num_bytes: int = 1 << 30


def test_split_ops_lower_to_side_stream_starts_and_aliasing_dones(monkeypatch):
  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _FakeComm())
  R, T, H, K, E = 2, 16, 256, 4, 16
  devs = jax.devices()[:R]
  if len(devs) < R:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(devs), ("ep",))
  f = jax_ep.shard_map(_layer(True, E, "expert"), mesh)
  args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16), jax.ShapeDtypeStruct((R * T, K), jnp.int32),
          jax.ShapeDtypeStruct((R * T, K), jnp.float32), jax.ShapeDtypeStruct((R * T, H), jnp.float32))
  targets = ("jax_ep_dispatch", "jax_ep_combine", "jax_ep_side_done")
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
  text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
  lines = text.splitlines()

  def calls(t):
    return [i for i, l in enumerate(lines) if f'"{t}"' in l or f"@{t}(" in l]

  d, c, done = calls("jax_ep_dispatch"), calls("jax_ep_combine"), calls("jax_ep_side_done")
  assert len(d) == 1 and len(c) == 1 and len(done) == 2, text
  for i in d + c:
    assert re.search(r"start = 1 : i32", lines[i]), lines[i][:400]
    assert "has_side_effect = true" in lines[i], lines[i][:400]
  for i in done:
    assert "has_side_effect = true" in lines[i] and str(COMM_ID) in lines[i], lines[i][:400]
  # Every start result goes through its done aliased: the dispatch's nine
  # (rows, ids, weights, counts, five handle arrays), the combine's one.
  assert lines[done[0]].count("output_operand_alias<") == 9, lines[done[0]][-900:]
  assert lines[done[1]].count("output_operand_alias<") == 1, lines[done[1]][-900:]
  # start < shared compute (tanh) < done, for the dispatch pair.
  tanh = [i for i, l in enumerate(lines) if "tanh" in l]
  assert tanh and d[0] < tanh[0] < done[0], (d, tanh, done)
