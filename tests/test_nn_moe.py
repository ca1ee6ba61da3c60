"""jax_ep.nn.MoE on 8 CPU devices (reference backend): shapes, a gradient
step, bf16 parameter storage computing exactly what f32 storage cast to bf16
computes; routing (softmax, sigmoid, group-limited) against an oracle, the
layer's outputs and gradients against a dense one-device oracle (shared
expert, FP8 dispatch with its straight-through backward), dp x ep meshes,
remat, one compilation for repeated train steps, argument errors."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ep import dequantize, quantize
from jax_ep.mesh import place_replicated
from jax_ep.nn import MoE
from jax_ep.nn.moe import group_limited_mask, route, shared_expert


def _setup(param_dtype):
  mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
  model = MoE(64, 32, 8, 2, mesh=mesh, param_dtype=param_dtype, rngs=nnx.Rngs(7))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (4 * 16, 64), jnp.float32),
                     NamedSharding(mesh, P("ep")))
  return model, x


def test_bf16_parameters_compute_what_f32_parameters_cast_to_bf16_compute():
  m32, x = _setup(jnp.float32)
  m16, _ = _setup(jnp.bfloat16)
  assert m16.w_in[...].dtype == jnp.bfloat16 and m32.w_in[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(m16.w_in[...], np.float32),
                                np.asarray(m32.w_in[...].astype(jnp.bfloat16), np.float32))
  y32 = nnx.jit(lambda m, x: m(x))(m32, x)
  y16 = nnx.jit(lambda m, x: m(x))(m16, x)
  assert y32.shape == x.shape and y32.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y16), np.asarray(y32))


def test_gradients_reach_every_parameter():
  model, x = _setup(jnp.float32)
  loss, grads = nnx.jit(lambda m, x: nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m))(
      model, x)
  assert np.isfinite(float(loss))
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert np.all(np.isfinite(np.asarray(g))), path
    assert np.any(np.asarray(g) != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"


# ---------------------------------------------------------------- oracles
#
# Written apart from jax_ep.nn.moe: argsort / sort instead of lax.top_k, the
# routing as a dense [N, E] gate matrix and every expert applied to every
# token.

def _gelu(v):
  return 0.5 * v * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


def _oracle_route(logits, *, topk, score_fn="softmax", num_groups=None, topk_groups=None,
                  routed_scaling_factor=1.0):
  """-> (topk_idx [N, K], weights [N, K], gates [N, E])."""
  logits = jnp.asarray(logits, jnp.float32)
  n, e = logits.shape
  if score_fn == "softmax":
    s = jnp.exp(logits - logits.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
  else:
    s = 1 / (1 + jnp.exp(-logits))
  allowed = jnp.ones((n, e), bool)
  if num_groups is not None:
    g = s.reshape(n, num_groups, e // num_groups)
    group_score = jnp.sort(g, axis=-1)[..., -2:].sum(-1)  # a 1-expert group: its score
    best = jnp.argsort(-group_score, axis=-1)[:, :topk_groups]
    allowed = jnp.repeat((best[..., None] == jnp.arange(num_groups)).any(1), e // num_groups, 1)
  idx = jnp.argsort(-jnp.where(allowed, s, -jnp.inf), axis=-1)[:, :topk]
  w = jnp.take_along_axis(s, idx, axis=-1)
  w = w / w.sum(-1, keepdims=True) * routed_scaling_factor
  gates = jnp.zeros((n, e)).at[jnp.arange(n)[:, None], idx].set(w)
  return idx, w, gates


_ROUTE_KEYS = ("topk", "score_fn", "num_groups", "topk_groups", "routed_scaling_factor")


def _oracle_layer(params, x, *, x_expert=None, **cfg):
  """The MoE layer on one device: y [N, H] (f32)."""
  _, _, gates = _oracle_route(x @ params["router"], **{k: cfg[k] for k in _ROUTE_KEYS if k in cfg})
  xe = x if x_expert is None else x_expert
  h = _gelu(jnp.einsum("nh,ehf->enf", xe, params["w_in"]))
  y = jnp.einsum("ne,enh->nh", gates, jnp.einsum("enf,efh->enh", h, params["w_out"]))
  if "shared_w_in" in params:
    a = x @ params["shared_w_in"]
    a = _gelu(x @ params["shared_w_gate"]) * a if "shared_w_gate" in params else _gelu(a)
    y = y + a @ params["shared_w_out"]
  return y


_PARAMS = ("router", "w_in", "w_out", "shared_w_in", "shared_w_gate", "shared_w_out")


def _params(model):
  return {k: jnp.asarray(getattr(model, k)[...]) for k in _PARAMS
          if getattr(model, k) is not None}


def _grads_dict(grads):
  return {k: np.asarray(v) for k, v in nnx.to_pure_dict(grads).items()}


def _mesh(shape=(4,), names=("ep",)):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _tokens(mesh, n, h, seed=1, spec=P("ep")):
  x = jax.random.normal(jax.random.key(seed), (n, h), jnp.float32)
  return jax.device_put(x, NamedSharding(mesh, spec))


def _value_and_grads(model, x, r):
  """y and the gradients of sum(y * r) w.r.t. the parameters and x."""
  def loss(m, x):
    y = m(x)
    return jnp.sum(y * r), y
  (_, y), (gm, gx) = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=(0, 1),
                                                              has_aux=True)(m, x))(model, x)
  return np.asarray(y), _grads_dict(gm), np.asarray(gx)


def _assert_close_to_oracle(model, x, cfg, *, x_expert=None, rtol=2e-5):
  r = jax.random.normal(jax.random.key(99), x.shape, jnp.float32)
  y, gm, gx = _value_and_grads(model, x, r)
  params, xn = _params(model), jnp.asarray(np.asarray(x))

  def oracle_loss(p, x):
    y = _oracle_layer(p, x, x_expert=None if x_expert is None else x_expert(x), **cfg)
    return jnp.sum(y * r), y

  (_, want_y), (want_gm, want_gx) = jax.jit(jax.value_and_grad(
      oracle_loss, argnums=(0, 1), has_aux=True))(params, xn)
  scale = lambda a: rtol * float(np.max(np.abs(a)))
  np.testing.assert_allclose(y, want_y, rtol=rtol, atol=scale(want_y))
  assert set(gm) == set(want_gm)
  for k in want_gm:
    np.testing.assert_allclose(gm[k], want_gm[k], rtol=rtol, atol=scale(want_gm[k]), err_msg=k)
  np.testing.assert_allclose(gx, want_gx, rtol=rtol, atol=scale(want_gx))
  return y


# ---------------------------------------------------------------- routing

@pytest.mark.parametrize("cfg", [
    dict(topk=2),
    dict(topk=3, score_fn="sigmoid"),
    dict(topk=4, score_fn="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5),
    dict(topk=2, score_fn="softmax", num_groups=8, topk_groups=3),   # 2-expert groups
    dict(topk=3, score_fn="sigmoid", num_groups=16, topk_groups=5),  # 1-expert groups: the max
], ids=["softmax", "sigmoid", "sigmoid-groups-scaled", "softmax-groups", "groups-of-one"])
def test_route_matches_the_oracle(cfg):
  logits = 2 * jax.random.normal(jax.random.key(3), (96, 16), jnp.float32)
  idx, w = route(logits, **cfg)
  want_idx, want_w, _ = _oracle_route(logits, **cfg)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
  np.testing.assert_allclose(np.asarray(w), np.asarray(want_w), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(w).sum(-1), cfg.get("routed_scaling_factor", 1.0),
                             rtol=1e-6)


def test_softmax_weights_are_the_softmax_of_the_top_k_logits():
  logits = jax.random.normal(jax.random.key(4), (32, 8), jnp.float32)
  idx, w = route(logits, topk=3)
  top = np.sort(np.asarray(logits), axis=-1)[:, ::-1][:, :3]
  want = np.exp(top - top.max(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(w), want / want.sum(-1, keepdims=True), rtol=1e-6)
  sig_idx, sig_w = route(logits, topk=3, score_fn="sigmoid")
  np.testing.assert_array_equal(np.asarray(sig_idx), np.asarray(idx))  # sigmoid is monotone too
  s = 1 / (1 + np.exp(-top))
  np.testing.assert_allclose(np.asarray(sig_w), s / s.sum(-1, keepdims=True), rtol=1e-6)


def test_group_limited_routing_on_a_crafted_example():
  # Three groups of four. By the sum of the two best scores group 1 wins
  # (1.1); by the best score alone group 0 would (0.9), by the sum of all
  # four group 2 (1.6).
  scores = np.array([[0.9, 0.1, 0.01, 0.01, 0.6, 0.5, 0.01, 0.01, 0.4, 0.4, 0.4, 0.4]],
                    np.float32)
  logits = jnp.asarray(np.log(scores / (1 - scores)))
  mask = group_limited_mask(jnp.asarray(scores), num_groups=3, topk_groups=1)
  np.testing.assert_array_equal(np.asarray(mask)[0], np.arange(12) // 4 == 1)
  idx, w = route(logits, topk=2, score_fn="sigmoid", num_groups=3, topk_groups=1,
                 routed_scaling_factor=2.0)
  np.testing.assert_array_equal(np.asarray(idx)[0], [4, 5])
  np.testing.assert_allclose(np.asarray(w)[0], [2 * 0.6 / 1.1, 2 * 0.5 / 1.1], rtol=1e-5)
  free_idx, _ = route(logits, topk=2, score_fn="sigmoid")
  np.testing.assert_array_equal(np.asarray(free_idx)[0], [0, 4])
  # Groups of one expert: a group's score is that expert's, so the mask keeps
  # the topk_groups best experts.
  ones = group_limited_mask(jnp.asarray(scores), num_groups=12, topk_groups=3)
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(ones)[0]), [0, 4, 5])


# ---------------------------------------------------------------- the layer

@pytest.mark.parametrize("cfg", [
    dict(topk=2),
    dict(topk=3, score_fn="sigmoid", num_groups=4, topk_groups=2, routed_scaling_factor=2.5),
    dict(topk=2, num_groups=16, topk_groups=3, shared_ffn=48, shared_gated=True),
    dict(topk=2, score_fn="sigmoid", shared_ffn=40),
], ids=["softmax", "sigmoid-groups-scaled", "groups-of-one-gated-shared", "sigmoid-shared"])
def test_layer_matches_the_dense_oracle_forward_and_gradients(cfg):
  mesh = _mesh()
  model = MoE(64, 32, 16, mesh=mesh, dtype=jnp.float32, backend="reference",
              rngs=nnx.Rngs(11), **cfg)
  _assert_close_to_oracle(model, _tokens(mesh, 64, 64), cfg)


@pytest.mark.parametrize("cfg", [
    dict(topk=3),
    dict(topk=2, shared_ffn=40, overlap_shared=True),
], ids=["plain", "overlapped-shared"])
def test_rank_layout_combine_matches_the_dense_oracle_forward_and_gradients(cfg):
  """combine_layout="rank": per-rank partial sums, then a rank-layout
  combine; the same layer as the oracle's, up to f32 rounding."""
  mesh = _mesh()
  model = MoE(64, 32, 16, mesh=mesh, dtype=jnp.float32, backend="reference",
              combine_layout="rank", rngs=nnx.Rngs(12), **cfg)
  layer_cfg = {k: v for k, v in cfg.items() if k != "overlap_shared"}  # what the oracle computes
  _assert_close_to_oracle(model, _tokens(mesh, 64, 64), layer_cfg)
  with pytest.raises(ValueError, match="combine_layout"):
    MoE(64, 32, 8, 2, mesh=mesh, combine_layout="token", rngs=nnx.Rngs(0))


def test_default_combine_layout_is_rank_across_ranks_and_expert_otherwise():
  """None picks the layout with the fewest link bytes where there is a link:
  rank at EP >= 2 (bf16 or FP8 rows), expert at one rank."""
  kw = dict(rngs=nnx.Rngs(0))
  assert MoE(128, 32, 8, 2, mesh=_mesh(), **kw).combine_layout == "rank"
  assert MoE(128, 32, 8, 2, mesh=_mesh(), fp8_dispatch=True, **kw).combine_layout == "rank"
  assert MoE(128, 32, 8, 2, mesh=_mesh((1,)), **kw).combine_layout == "expert"
  assert MoE(128, 32, 8, 2, mesh=_mesh((1,)), fp8_dispatch=True, **kw).combine_layout == "expert"
  two_d = _mesh((2, 2), ("dp", "ep"))
  assert MoE(128, 32, 8, 2, mesh=two_d, data_axis="dp", **kw).combine_layout == "rank"
  assert MoE(128, 32, 8, 2, mesh=_mesh(), combine_layout="expert", **kw).combine_layout == "expert"


def test_shared_expert_adds_the_dense_mlp():
  mesh = _mesh()
  kw = dict(mesh=mesh, dtype=jnp.float32, backend="reference")
  plain = MoE(64, 32, 8, 2, rngs=nnx.Rngs(3), **kw)
  shared = MoE(64, 32, 8, 2, shared_ffn=48, rngs=nnx.Rngs(3), **kw)
  for k in ("router", "w_in", "w_out"):  # the new parameters are drawn after the old ones
    np.testing.assert_array_equal(np.asarray(getattr(plain, k)[...]),
                                  np.asarray(getattr(shared, k)[...]))
  x = _tokens(mesh, 64, 64)
  fwd = nnx.jit(lambda m, x: m(x))
  y0, y1 = np.asarray(fwd(plain, x)), np.asarray(fwd(shared, x))
  xn = np.asarray(x)
  dense = _gelu(xn @ np.asarray(shared.shared_w_in[...])) @ np.asarray(shared.shared_w_out[...])
  assert np.max(np.abs(dense)) > 0.1
  np.testing.assert_allclose(y1 - y0, dense, rtol=1e-4, atol=1e-5)
  # shared_expert itself, gated, against the formula.
  wi, wg, wo = (np.asarray(jax.random.normal(jax.random.key(i), s)) / 8
                for i, s in enumerate([(64, 48), (64, 48), (48, 64)]))
  got = shared_expert(jnp.asarray(xn), wi, wo, wg, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), (_gelu(xn @ wg) * (xn @ wi)) @ wo, rtol=1e-4,
                             atol=1e-5)
  # Tokens with leading dims: the same as flattened.
  y3 = fwd(shared, x.reshape(4, 16, 64))
  assert y3.shape == (4, 16, 64)
  np.testing.assert_array_equal(np.asarray(y3).reshape(64, 64), y1)


def test_overlap_shared_gives_the_same_outputs_and_gradients():
  """overlap_shared runs the shared expert between dispatch_start and
  dispatch_done: the same numbers, forward and backward."""
  mesh = _mesh()
  kw = dict(mesh=mesh, dtype=jnp.float32, backend="reference", shared_ffn=48, shared_gated=True)
  plain = MoE(64, 32, 8, 2, rngs=nnx.Rngs(4), **kw)
  over = MoE(64, 32, 8, 2, overlap_shared=True, rngs=nnx.Rngs(4), **kw)
  x = _tokens(mesh, 64, 64)

  def loss(m, x):
    return jnp.sum(jnp.sin(m(x)))

  g = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
  (l0, (gm0, gx0)), (l1, (gm1, gx1)) = g(plain, x), g(over, x)
  assert float(l0) == float(l1)
  np.testing.assert_array_equal(np.asarray(gx0), np.asarray(gx1))
  for a, b in zip(jax.tree.leaves(nnx.state(gm0)), jax.tree.leaves(nnx.state(gm1))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.any(np.asarray(gm1.shared_w_gate[...]) != 0)
  with pytest.raises(ValueError, match="overlap_shared"):
    MoE(64, 32, 8, 2, mesh=mesh, overlap_shared=True, rngs=nnx.Rngs(0))


def test_dp_by_ep_mesh_gives_the_ep_only_layer_results():
  cfg = dict(score_fn="sigmoid", shared_ffn=32, backend="reference", dtype=jnp.float32)
  ep, dp_ep = _mesh(), _mesh((2, 4), ("dp", "ep"))
  m_ep = MoE(64, 32, 8, 2, mesh=ep, rngs=nnx.Rngs(5), **cfg)
  m_dp = MoE(64, 32, 8, 2, mesh=dp_ep, data_axis="dp", rngs=nnx.Rngs(5), **cfg)
  assert m_dp.w_in[...].sharding.spec == P("ep") and m_dp.router[...].sharding.spec == P()
  x_ep = _tokens(ep, 64, 64)
  x_dp = _tokens(dp_ep, 64, 64, spec=P(("dp", "ep")))
  r = jax.random.normal(jax.random.key(8), (64, 64), jnp.float32)
  y_ep, g_ep, gx_ep = _value_and_grads(m_ep, x_ep, r)
  y_dp, g_dp, gx_dp = _value_and_grads(m_dp, x_dp, r)
  # Tokens really are split 8 ways, not replicated over dp.
  y = nnx.jit(lambda m, x: m(x))(m_dp, x_dp)
  assert {s.data.shape for s in y.addressable_shards} == {(8, 64)}
  np.testing.assert_allclose(y_dp, y_ep, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(gx_dp, gx_ep, rtol=1e-5, atol=1e-6)
  for k in g_ep:  # experts replicated over dp: their gradient is summed over both replicas
    np.testing.assert_allclose(g_dp[k], g_ep[k], rtol=1e-5, atol=1e-5 * np.abs(g_ep[k]).max(),
                               err_msg=k)


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_fp8_dispatch_is_close_to_bf16_and_its_backward_is_straight_through(layout):
  mesh = _mesh()
  cfg = dict(topk=2, shared_ffn=32)
  kw = dict(mesh=mesh, dtype=jnp.float32, backend="reference", combine_layout=layout, **cfg)
  m8 = MoE(128, 32, 8, fp8_dispatch=True, rngs=nnx.Rngs(2), **kw)
  m16 = MoE(128, 32, 8, rngs=nnx.Rngs(2), **kw)
  x = _tokens(mesh, 64, 128)

  def fp8_rows(x):  # what the experts see; the quantisation counts as identity backwards
    return x + jax.lax.stop_gradient(dequantize(*quantize(x), jnp.float32) - x)

  y8 = _assert_close_to_oracle(m8, x, cfg, x_expert=fp8_rows, rtol=5e-5)
  y16 = np.asarray(nnx.jit(lambda m, x: m(x))(m16, x))
  err = np.max(np.abs(y8 - y16))
  assert 0 < err <= 0.05 * np.max(np.abs(y16)), err


def test_remat_gives_the_same_gradients():
  mesh = _mesh()
  model = MoE(128, 32, 8, 2, mesh=mesh, score_fn="sigmoid", shared_ffn=32, fp8_dispatch=True,
              dtype=jnp.float32, rngs=nnx.Rngs(4))
  x = _tokens(mesh, 64, 128)

  def grads(apply):
    f = lambda m: jnp.mean(apply(m, x).astype(jnp.float32) ** 2)
    return _grads_dict(nnx.jit(lambda m: nnx.grad(f)(m))(model))

  plain = grads(lambda m, x: m(x))
  remat = grads(nnx.remat(lambda m, x: m(x)))
  for k in plain:
    assert np.any(plain[k] != 0), k
    np.testing.assert_allclose(remat[k], plain[k], rtol=1e-5, atol=1e-5 * np.abs(plain[k]).max(),
                               err_msg=k)


@pytest.mark.parametrize("dp", [False, True], ids=["ep", "dp-ep-fp8-shared"])
def test_train_step_compiles_once_and_lowers_the_loss(dp):
  mesh = _mesh((2, 4), ("dp", "ep")) if dp else _mesh()
  extra = dict(data_axis="dp", fp8_dispatch=True, shared_ffn=32, score_fn="sigmoid") if dp else {}
  model = MoE(128, 32, 8, 2, mesh=mesh, rngs=nnx.Rngs(6), **extra)
  for k, v in _params(model).items():
    assert isinstance(v.sharding, NamedSharding) and v.sharding.mesh == mesh, k
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  # The optimizer's own scalars are the caller's to place (the layer's are placed).
  nnx.update(opt, place_replicated(nnx.state(opt), mesh))
  tokens = P(("dp", "ep")) if dp else P("ep")
  x = _tokens(mesh, 64, 128, spec=tokens)
  a = jax.random.normal(jax.random.key(2), (128, 128)) / np.sqrt(128)
  target = jnp.tanh(x @ a)
  graph, state = nnx.split((model, opt))

  @jax.jit
  def step(state, x, target):
    model, opt = nnx.merge(graph, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  losses = []
  for _ in range(4):
    loss, state = step(state, x, target)
    losses.append(float(loss))
  assert step._cache_size() == 1
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=12), "num_experts"),
    (dict(topk=9), "topk"),
    (dict(score_fn="relu"), "score_fn"),
    (dict(num_groups=4), "topk_groups"),
    (dict(num_groups=3, topk_groups=1), "num_groups"),
    (dict(num_groups=4, topk_groups=5), "topk_groups"),
    (dict(num_groups=4, topk_groups=1, topk=3), "topk"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(shared_ffn=0), "shared_ffn"),
    (dict(fp8_dispatch=True, hidden=64), "hidden"),
    (dict(data_axis="dp"), "data_axis"),
    (dict(axis_name="tp"), "axis_name"),
])
def test_bad_configuration_raises_a_value_error_naming_the_argument(kwargs, match):
  mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
  args = dict(hidden=128, ffn=32, num_experts=8, topk=2)
  args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
  with pytest.raises(ValueError, match=match):
    MoE(args["hidden"], args["ffn"], args["num_experts"], args["topk"], mesh=mesh,
        rngs=nnx.Rngs(0), **kwargs)


def test_tokens_that_do_not_split_over_the_mesh_raise_a_value_error():
  mesh = _mesh()
  model = MoE(64, 32, 8, 2, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="tokens"):
    model(jnp.ones((30, 64)))


def test_nn_is_reachable_after_import_jax_ep():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", "import jax_ep; print(jax_ep.nn.MoE.__name__)"],
                       capture_output=True, text=True, env=env, timeout=120)
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.split() == ["MoE"]
