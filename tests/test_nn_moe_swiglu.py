"""jax_ep.nn.MoE with SwiGLU experts (activation="swiglu") and FP8 experts
(precision="fp8", jax_ep.grouped_matmul_fp8's training form on the
reference backend) on CPU virtual devices.

The SwiGLU layer's outputs and gradients against a float64 NumPy oracle
(routing, SwiGLU, a shared expert, the backward written out by hand) at
R = 1, 2, 4, 8 and both combine layouts; the auto backend against the
reference; remat; a dp x ep mesh; one compiled program for repeated train
steps; the fused activation staying in bf16 between the GEMMs. The FP8
grouped GEMM (forward, dgrad, wgrad) against a float64 oracle of the same
casts; the FP8 layer within the e4m3 bound of the bf16 one; NaN propagating
and all-zero blocks; argument errors naming the argument."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import oracle
from conftest import RANKS, make_mesh
from jax_ep import _native
from jax_ep.mesh import place_replicated
from jax_ep.nn import MoE
from jax_ep.nn.moe import fuse_gate_up, shared_expert, swiglu
from jax_ep.ops.grouped_gemm import grouped_matmul_fp8
from oracle import stable_seed

SWIGLU_PARAMS = ("router", "w13", "w2", "shared_w13", "shared_w2")


# ---------------------------------------------------------------- float64 oracle
#
# NumPy, float64, dense: every expert on every token, the routing as an
# [N, E] gate matrix from argsort, the backward written out by hand (no
# autodiff), so nothing is shared with jax_ep.nn.moe.

def _sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def _np_route(logits, *, topk, score_fn="softmax", routed_scaling_factor=1.0):
  """-> (idx [N, K], w [N, K], scores [N, E]): w = c * softmax over the k
  largest logits, or c * the k largest sigmoid scores renormalised."""
  idx = np.argsort(-logits, axis=-1, kind="stable")[:, :topk]
  chosen = np.take_along_axis(logits, idx, axis=-1)
  if score_fn == "softmax":
    p = np.exp(chosen - chosen.max(-1, keepdims=True))
    scores = None
  else:
    p = _sigmoid(chosen)
    scores = p
  w = p / p.sum(-1, keepdims=True) * routed_scaling_factor
  return idx, w, scores


def _np_swiglu_fwd(x, w13, w2):
  f = w2.shape[0]
  a = x @ w13
  g, u = a[:, :f], a[:, f:]
  h = g * _sigmoid(g) * u
  return h @ w2, (a, h)


def _np_swiglu_bwd(x, w13, w2, cache, dout):
  """(dx, dw13, dw2) of out = swiglu(x @ w13) @ w2 for dout."""
  f = w2.shape[0]
  a, h = cache
  g, u = a[:, :f], a[:, f:]
  sg = _sigmoid(g)
  dh = dout @ w2.T
  dg = dh * u * (sg + g * sg * (1 - sg))
  du = dh * g * sg
  da = np.concatenate([dg, du], axis=1)
  return da @ w13.T, x.T @ da, h.T @ dout


def np_swiglu_layer(params, x, r, *, topk, score_fn="softmax", routed_scaling_factor=1.0):
  """y and the gradients of sum(y * r) w.r.t. every parameter and x."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x = np.asarray(x, np.float64)
  r = np.asarray(r, np.float64)
  n = x.shape[0]
  e = p["w13"].shape[0]
  logits = x @ p["router"]
  idx, w, scores = _np_route(logits, topk=topk, score_fn=score_fn,
                             routed_scaling_factor=routed_scaling_factor)
  gates = np.zeros((n, e))
  np.put_along_axis(gates, idx, w, axis=-1)
  y = np.zeros_like(x)
  grads = {k: np.zeros_like(v) for k, v in p.items()}
  dx = np.zeros_like(x)
  dgates = np.zeros((n, e))
  for j in range(e):
    out, cache = _np_swiglu_fwd(x, p["w13"][j], p["w2"][j])
    y += gates[:, j:j + 1] * out
    dgates[:, j] = np.sum(r * out, axis=-1)
    dxj, grads["w13"][j], grads["w2"][j] = _np_swiglu_bwd(x, p["w13"][j], p["w2"][j], cache,
                                                          gates[:, j:j + 1] * r)
    dx += dxj
  if "shared_w13" in p:
    out, cache = _np_swiglu_fwd(x, p["shared_w13"], p["shared_w2"])
    y += out
    dxs, grads["shared_w13"], grads["shared_w2"] = _np_swiglu_bwd(
        x, p["shared_w13"], p["shared_w2"], cache, r)
    dx += dxs
  # The routing weights' gradient, back to the chosen logits.
  dw = np.take_along_axis(dgates, idx, axis=-1)
  c = routed_scaling_factor
  if score_fn == "softmax":
    dchosen = w * (dw - np.sum(w / c * dw, axis=-1, keepdims=True))
  else:
    total = scores.sum(-1, keepdims=True)
    dscores = c / total * (dw - np.sum(dw * w / c, axis=-1, keepdims=True))
    dchosen = dscores * scores * (1 - scores)
  dlogits = np.zeros((n, e))
  np.put_along_axis(dlogits, idx, dchosen, axis=-1)
  grads["router"] = x.T @ dlogits
  dx += dlogits @ p["router"].T
  return y, grads, dx


# ---------------------------------------------------------------- helpers

def _params(model, names=SWIGLU_PARAMS):
  return {k: np.asarray(getattr(model, k)[...], np.float32) for k in names
          if getattr(model, k) is not None}


def _tokens(mesh, n, h, seed=1, spec=None):
  spec = spec if spec is not None else P(mesh.axis_names[-1])
  x = jax.random.normal(jax.random.key(seed), (n, h), jnp.float32)
  return jax.device_put(x, NamedSharding(mesh, spec))


def _value_and_grads(model, x, r):
  """y and the gradients of sum(y * r) w.r.t. the parameters and x."""
  def loss(m, x):
    y = m(x)
    return jnp.sum(y.astype(jnp.float32) * r), y
  (_, y), (gm, gx) = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=(0, 1),
                                                              has_aux=True)(m, x))(model, x)
  grads = {k: np.asarray(v, np.float32) for k, v in nnx.to_pure_dict(gm).items()}
  return np.asarray(y, np.float32), grads, np.asarray(gx, np.float32)


def _assert_close(got, want, rtol, what):
  """|got - want| <= rtol * max|want| elementwise (the oracle is float64)."""
  want = np.asarray(want, np.float64)
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), what
  scale = float(np.max(np.abs(want)))
  assert scale > 0, f"{what}: the oracle is all zeros (the test would prove nothing)"
  err = float(np.max(np.abs(got - want)))
  assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol} * {scale:.3e}"


def _check_against_oracle(model, x, cfg, *, rtol):
  r = jax.random.normal(jax.random.key(99), x.shape, jnp.float32)
  y, grads, gx = _value_and_grads(model, x, r)
  want_y, want_g, want_gx = np_swiglu_layer(_params(model), np.asarray(x), np.asarray(r), **cfg)
  _assert_close(y, want_y, rtol, "y")
  assert set(grads) == set(want_g)
  for k in want_g:
    _assert_close(grads[k], want_g[k], rtol, f"d{k}")
  _assert_close(gx, want_gx, rtol, "dx")


# ---------------------------------------------------------------- the SwiGLU layer

@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("cfg, layer", [
    (dict(topk=2), dict()),
    (dict(topk=3, score_fn="sigmoid", routed_scaling_factor=2.5), dict(shared_ffn=48)),
    (dict(topk=2), dict(shared_ffn=40, combine_layout="expert")),
], ids=["softmax", "sigmoid-scaled-shared", "shared-expert-layout"])
def test_swiglu_layer_matches_the_float64_oracle_forward_and_gradients(R, cfg, layer):
  mesh = make_mesh(R)
  model = MoE(64, 32, 16, mesh=mesh, activation="swiglu", dtype=jnp.float32,
              backend="reference", rngs=nnx.Rngs(stable_seed(R, *cfg)), **cfg, **layer)
  assert model.w13[...].shape == (16, 64, 64) and model.w2[...].shape == (16, 32, 64)
  assert model.w_in is None and model.w_out is None
  _check_against_oracle(model, _tokens(mesh, 64, 64, seed=R), cfg, rtol=2e-5)


def test_bf16_swiglu_layer_is_within_bf16_rounding_of_the_oracle():
  """dtype=bf16 (the default): bf16 operands, the first GEMM's [M, 2F] and
  the SwiGLU output rounded to bf16, f32 accumulation."""
  mesh = make_mesh(4)
  model = MoE(64, 32, 16, 2, mesh=mesh, activation="swiglu", shared_ffn=32,
              backend="reference", rngs=nnx.Rngs(21))
  _check_against_oracle(model, _tokens(mesh, 64, 64), dict(topk=2), rtol=3e-2)


def test_auto_backend_gives_the_reference_backends_outputs_and_gradients():
  mesh = make_mesh(4)
  x = _tokens(mesh, 64, 64)
  r = jax.random.normal(jax.random.key(5), x.shape, jnp.float32)
  got = [_value_and_grads(MoE(64, 32, 8, 2, mesh=mesh, activation="swiglu", shared_ffn=32,
                              backend=b, rngs=nnx.Rngs(6)), x, r)
         for b in (None, "reference")]
  (ya, ga, gxa), (yb, gb, gxb) = got
  # On CPU both are the reference; allclose, not equal, because backend=None
  # traces a platform_dependent whose CPU branch XLA may compile differently.
  np.testing.assert_allclose(ya, yb, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(gxa, gxb, rtol=1e-5, atol=1e-6)
  for k in gb:
    np.testing.assert_allclose(ga[k], gb[k], rtol=1e-5, atol=1e-6 * np.abs(gb[k]).max(), err_msg=k)


def test_swiglu_is_silu_gate_times_up_and_fuse_gate_up_puts_gate_first():
  rng = np.random.default_rng(0)
  gate, up = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
  w13 = np.asarray(fuse_gate_up(jnp.asarray(gate), jnp.asarray(up)))
  np.testing.assert_array_equal(w13[..., :16], gate)
  np.testing.assert_array_equal(w13[..., 16:], up)
  x = rng.standard_normal((7, 3)).astype(np.float32)
  h13 = np.einsum("th,ehf->etf", x, w13.astype(np.float32))
  got = np.asarray(swiglu(jnp.asarray(h13)))
  g, u = x @ gate.astype(np.float32), x @ up.astype(np.float32)
  np.testing.assert_allclose(got, g * _sigmoid(g) * u, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="same shape"):
    fuse_gate_up(jnp.zeros((3, 4)), jnp.zeros((3, 5)))
  # The shared expert's SwiGLU form against the oracle.
  ws13, ws2 = rng.standard_normal((3, 8)) / 2, rng.standard_normal((4, 3)) / 2
  got = shared_expert(jnp.asarray(x), jnp.asarray(ws13, jnp.float32), jnp.asarray(ws2, jnp.float32),
                      activation="swiglu", dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), _np_swiglu_fwd(x, ws13, ws2)[0], rtol=1e-5,
                             atol=1e-6)


def test_swiglu_between_the_gemms_is_one_bf16_elementwise_pass():
  """The first GEMM's output is bf16 and the activation compiles to a
  single fusion whose only input and output are bf16 (the f32 math lives
  inside it)."""
  mesh = make_mesh(2)
  model = MoE(64, 48, 4, 2, mesh=mesh, activation="swiglu", backend="reference",
              rngs=nnx.Rngs(0))
  x = _tokens(mesh, 16, 64)
  graph, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda state, x: nnx.merge(graph, state)(x))(state, x)
  dots = [e.outvars[0].aval for e in _walk(jaxpr.jaxpr)
          if e.primitive.name.startswith("ragged_dot")]
  assert [d.shape[-1] for d in dots] == [96, 64], dots    # [M, 2F], then [M, H]
  assert all(d.dtype == jnp.bfloat16 for d in dots), dots
  h13 = jnp.zeros((256, 2 * 128), jnp.bfloat16)
  hlo = jax.jit(lambda h: swiglu(h)).lower(h13).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  assert entry.count("fusion(") == 1, entry
  assert re.search(r"parameter\(0\)", entry) and "bf16[256,256]" in entry
  assert "f32[" not in entry.split("ROOT")[1].splitlines()[0], entry


@pytest.mark.skipif(not _native.cuda_built(),
                    reason="the CUDA wrappers need jax_ep built with CUDA")
def test_cuda_lowering_runs_the_swiglu_experts_as_six_bf16_grouped_gemm_calls():
  """Forward + backward of the routed SwiGLU experts lowered for CUDA: two
  forward grouped GEMM calls (the first writing [M, 2F] in bf16) and dx, dw
  for each, no ragged_dot."""
  from jax_ep.nn.moe import _Cfg, _experts
  m, g, h, f = 64, 4, 128, 96
  cfg = _Cfg(8, "ep", 8, None, jnp.bfloat16, False, activation="swiglu")

  def loss(rows, w13, w2, counts):
    return jnp.sum(_experts(rows, w13, w2, counts, cfg).astype(jnp.float32) ** 2)

  args = (jax.ShapeDtypeStruct((m, h), jnp.bfloat16),
          jax.ShapeDtypeStruct((g, h, 2 * f), jnp.bfloat16),
          jax.ShapeDtypeStruct((g, f, h), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32))
  checks = [jax.export.DisabledSafetyCheck.custom_call("jax_ep_grouped_gemm")]
  text = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                           disabled_checks=checks)(*args).mlir_module()
  calls = [l for l in text.splitlines() if "custom_call @jax_ep_grouped_gemm" in l]
  assert len(calls) == 6, len(calls)
  assert "ragged_dot" not in text
  assert any(f"tensor<{m}x{2 * f}xbf16>" in l.split("->")[-1] for l in calls), calls


def _walk(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        while sub is not None and not hasattr(sub, "eqns"):
          sub = getattr(sub, "jaxpr", None)
        if sub is not None:
          yield from _walk(sub)


def test_dp_by_ep_mesh_gives_the_ep_only_swiglu_layer_results():
  cfg = dict(activation="swiglu", score_fn="sigmoid", shared_ffn=32, backend="reference",
             dtype=jnp.float32)
  ep = make_mesh(4)
  dp_ep = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "ep"))
  m_ep = MoE(64, 32, 8, 2, mesh=ep, rngs=nnx.Rngs(5), **cfg)
  m_dp = MoE(64, 32, 8, 2, mesh=dp_ep, data_axis="dp", rngs=nnx.Rngs(5), **cfg)
  assert m_dp.w13[...].sharding.spec == P("ep") and m_dp.shared_w13[...].sharding.spec == P()
  r = jax.random.normal(jax.random.key(8), (64, 64), jnp.float32)
  y_ep, g_ep, gx_ep = _value_and_grads(m_ep, _tokens(ep, 64, 64), r)
  y_dp, g_dp, gx_dp = _value_and_grads(m_dp, _tokens(dp_ep, 64, 64, spec=P(("dp", "ep"))), r)
  np.testing.assert_allclose(y_dp, y_ep, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(gx_dp, gx_ep, rtol=1e-5, atol=1e-6)
  for k in g_ep:
    np.testing.assert_allclose(g_dp[k], g_ep[k], rtol=1e-5, atol=1e-5 * np.abs(g_ep[k]).max(),
                               err_msg=k)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_remat_gives_the_same_gradients(precision):
  mesh = make_mesh(4)
  model = MoE(128, 128, 8, 2, mesh=mesh, activation="swiglu", shared_ffn=128,
              precision=precision, dtype=jnp.float32, rngs=nnx.Rngs(4))
  x = _tokens(mesh, 64, 128)

  def grads(apply):
    f = lambda m: jnp.mean(apply(m, x).astype(jnp.float32) ** 2)
    return {k: np.asarray(v) for k, v in
            nnx.to_pure_dict(nnx.jit(lambda m: nnx.grad(f)(m))(model)).items()}

  plain = grads(lambda m, x: m(x))
  remat = grads(nnx.remat(lambda m, x: m(x)))
  for k in plain:
    assert np.any(plain[k] != 0), k
    np.testing.assert_allclose(remat[k], plain[k], rtol=1e-5, atol=1e-5 * np.abs(plain[k]).max(),
                               err_msg=k)


@pytest.mark.parametrize("extra", [
    dict(),
    dict(precision="fp8", shared_ffn=128, score_fn="sigmoid"),
], ids=["dp-ep-bf16", "dp-ep-fp8-shared"])
def test_swiglu_train_step_compiles_once_and_lowers_the_loss(extra):
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "ep"))
  model = MoE(128, 128, 8, 2, mesh=mesh, data_axis="dp", activation="swiglu", rngs=nnx.Rngs(6),
              **extra)
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  nnx.update(opt, place_replicated(nnx.state(opt), mesh))
  x = _tokens(mesh, 64, 128, spec=P(("dp", "ep")))
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


# ---------------------------------------------------------------- FP8

def _np_block_quantize(w):
  """[G, K, N] -> the e4m3 values times their 128 x 128 block scale, float64
  (s = max(amax, 1e-4) / 448, q = e4m3(clip(w / s)))."""
  g, k, n = w.shape
  b = np.asarray(w, np.float32).reshape(g, k // 128, 128, n // 128, 128)
  s = (np.maximum(np.abs(b).max(axis=(2, 4)), np.float32(1e-4))
       * (np.float32(1) / np.float32(448))).astype(np.float32)
  inv = (np.float32(1) / s)[:, :, None, :, None]
  q = np.clip(b * inv, -448, 448).astype(oracle.FP8)
  return (q.astype(np.float64) * s[:, :, None, :, None]).reshape(g, k, n)


def _np_rows(x):
  q, s = oracle.quantize_fp8(np.asarray(x, np.float32))
  h = x.shape[-1]
  return (q.astype(np.float64).reshape(*x.shape[:-1], h // 128, 128)
          * s[..., None]).reshape(x.shape)


@pytest.mark.parametrize("sizes, tail", [([100, 0, 37, 131], 20), ([256, 0, 0, 0], 0)],
                         ids=["odd-groups-padding", "one-group"])
def test_the_layers_fp8_gemm_matches_the_float64_oracle_of_its_casts(sizes, tail):
  """forward Q(x)·Q(w), dgrad Q(dy)·Q(w)ᵀ, wgrad per group Q_col(x)ᵀ·Q_col(dy)
  (columns cast per 128 tokens of each group); bf16 products."""
  rng = np.random.default_rng(stable_seed(*sizes))
  g, k, n = len(sizes), 256, 384
  m = sum(sizes) + tail
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((g, k, n)) / 16).astype(np.float32)
  dy = rng.standard_normal((m, n)).astype(np.float32)
  sz = jnp.asarray(sizes, jnp.int32)
  out, vjp = jax.vjp(lambda x, w: grouped_matmul_fp8(x, w, sz, backend="reference"),
                     jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(dy, jnp.bfloat16))
  dy = np.asarray(jnp.asarray(dy, jnp.bfloat16), np.float32)  # what reached the backward
  qw = _np_block_quantize(w)
  want_out = oracle.grouped_matmul(_np_rows(x), qw, sizes)
  want_dx, _ = oracle.grouped_matmul_grads(x, qw, sizes, _np_rows(dy))
  _, want_dw = oracle.grouped_matmul_grads(oracle.fp8_token_round_trip(x, sizes), w, sizes,
                                           oracle.fp8_token_round_trip(dy, sizes))
  for got, want, what in ((out, want_out, "out"), (dx, want_dx, "dx"), (dw, want_dw, "dw")):
    _assert_close(got, want, 1e-2, what)  # the products come out in bf16
  # The casts do something: the exact products are further away.
  exact = oracle.grouped_matmul(x, w, sizes)
  assert np.max(np.abs(np.asarray(out) - exact)) > 1e-3 * np.max(np.abs(exact))
  # x given already in FP8 (as a dispatch delivers it): the same product; the
  # wgrad's column tiles are cast from those FP8 rows (the bf16 rows never
  # reached this rank).
  from jax_ep import fp8
  pre_out, pre_vjp = jax.vjp(
      lambda x, w: grouped_matmul_fp8(x, w, sz, x_fp8=fp8.quantize(jnp.asarray(x)),
                                      backend="reference"),
      jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(pre_out), np.asarray(out))
  pre_dx, pre_dw = pre_vjp(jnp.asarray(dy, jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(pre_dx), np.asarray(dx))
  _, want_dw = oracle.grouped_matmul_grads(oracle.fp8_token_round_trip(_np_rows(x), sizes), w,
                                           sizes, oracle.fp8_token_round_trip(dy, sizes))
  _assert_close(pre_dw, want_dw, 1e-2, "dw from FP8 rows")


def test_fp8_gemm_propagates_nan_and_gives_all_zero_blocks_a_defined_scale():
  x = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
  x[:, 128:] = 0.0                     # an all-zero 128-block in every row
  x[5, 7] = np.nan
  x[9, 3] = np.inf
  w = np.random.default_rng(4).standard_normal((2, 256, 128)).astype(np.float32) / 16
  sz = jnp.asarray([40, 24], jnp.int32)
  out = np.asarray(grouped_matmul_fp8(jnp.asarray(x), jnp.asarray(w), sz, backend="reference"),
                   np.float32)
  assert np.all(np.isnan(out[5])) and not np.any(np.isfinite(out[9]))
  ok = np.ones(64, bool)
  ok[[5, 9]] = False
  want = oracle.grouped_matmul(_np_rows(np.where(np.isfinite(x), x, 0)), _np_block_quantize(w),
                               [40, 24])
  _assert_close(out[ok], want[ok], 1e-2, "finite rows")
  zero = grouped_matmul_fp8(jnp.zeros((8, 256)), jnp.zeros((1, 256, 128)),
                            jnp.asarray([8], jnp.int32), backend="reference")
  assert np.all(np.asarray(zero) == 0)


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_fp8_layer_is_within_the_e4m3_bound_of_the_bf16_layer(layout):
  """Same weights and tokens; e4m3 keeps 3 mantissa bits (relative error
  <= 2^-4 per cast), so outputs and gradients agree to a few percent in
  norm, and are not equal (the casts happened)."""
  mesh = make_mesh(4)
  kw = dict(mesh=mesh, activation="swiglu", shared_ffn=128, dtype=jnp.float32,
            combine_layout=layout)
  m8 = MoE(128, 128, 8, 2, precision="fp8", rngs=nnx.Rngs(2), **kw)
  m32 = MoE(128, 128, 8, 2, rngs=nnx.Rngs(2), **kw)
  assert m8.fp8_dispatch and not m32.fp8_dispatch
  x = _tokens(mesh, 64, 128)
  r = jax.random.normal(jax.random.key(7), x.shape, jnp.float32)
  y8, g8, gx8 = _value_and_grads(m8, x, r)
  y32, g32, gx32 = _value_and_grads(m32, x, r)

  def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

  assert 0 < rel(y8, y32) < 0.1, rel(y8, y32)
  assert 0 < rel(gx8, gx32) < 0.15, rel(gx8, gx32)
  for k in g32:
    assert np.all(np.isfinite(g8[k])), k
    assert 0 < rel(g8[k], g32[k]) < 0.15, (k, rel(g8[k], g32[k]))


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, match", [
    (dict(activation="relu"), "activation"),
    (dict(precision="fp16"), "precision"),
    (dict(precision="fp8", hidden=192), "hidden"),
    (dict(precision="fp8", ffn=96), "ffn"),
    (dict(precision="fp8", shared_ffn=64), "shared_ffn"),
    (dict(precision="fp8", param_dtype=jnp.float16), "param_dtype"),
    (dict(precision="fp8", overlap_shared=True, shared_ffn=128), "overlap_shared"),
])
def test_bad_configuration_raises_a_value_error_naming_the_argument(kwargs, match):
  mesh = make_mesh(8)
  args = dict(hidden=128, ffn=128, num_experts=8, topk=2)
  args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
  with pytest.raises(ValueError, match=match):
    MoE(args["hidden"], args["ffn"], args["num_experts"], args["topk"], mesh=mesh,
        activation=kwargs.pop("activation", "swiglu"), rngs=nnx.Rngs(0), **kwargs)


def test_a_loaded_w13_of_the_wrong_shape_or_dtype_raises_a_value_error_naming_it():
  mesh = make_mesh(4)
  model = MoE(128, 128, 8, 2, mesh=mesh, activation="swiglu", shared_ffn=128, rngs=nnx.Rngs(0))
  x = _tokens(mesh, 16, 128)
  split = NamedSharding(mesh, P("ep"))
  good = model.w13[...]
  model.w13 = nnx.Param(jax.device_put(good[..., :128], split))   # [E, H, F]: up missing
  with pytest.raises(ValueError, match=r"w13 must be \[E, H, 2F\].*last axis is 2F"):
    model(x)
  model.w13 = nnx.Param(good)
  model.shared_w13 = nnx.Param(model.shared_w13[...][:, :128])
  with pytest.raises(ValueError, match="shared_w13"):
    model(x)
  fp8 = MoE(128, 128, 8, 2, mesh=mesh, activation="swiglu", precision="fp8", rngs=nnx.Rngs(0))
  fp8.w2 = nnx.Param(fp8.w2[...].astype(jnp.float16))
  with pytest.raises(ValueError, match="w2"):
    fp8(x)
  with pytest.raises(ValueError, match="w_gate"):
    shared_expert(x, good[0], good[0].T, good[0], activation="swiglu")
  with pytest.raises(ValueError, match="multiples of 128"):
    grouped_matmul_fp8(jnp.zeros((8, 64)), jnp.zeros((1, 64, 128)), jnp.asarray([8]))
