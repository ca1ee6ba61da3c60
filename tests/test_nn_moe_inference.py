"""jax_ep.nn.MoE's FP8 weight forms and its decode form on CPU virtual devices
(reference backend): the cached FP8 blocks of `fp8_weights()` give the same
outputs and gradients as the blocks cast inside the step; `to_fp8_inference`
holds the blocks (no longer Params) and gives the same forward; `decode`
(low-latency dispatch -> masked grouped GEMMs -> low-latency combine) agrees
with the layer's forward, against a float64 oracle too; bad uses raise
ValueErrors naming the cause."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import make_mesh
from jax_ep import fp8 as _fp8
from jax_ep.nn import MoE
from jax_ep.nn.moe import route
from jax_ep.ops.grouped_gemm import Fp8Weights

H, F, E, K = 256, 128, 8, 2


def _model(mesh, *, activation="swiglu", precision="fp8", seed=0, **kw):
  kw.setdefault("shared_ffn", 128)
  return MoE(H, F, E, K, mesh=mesh, activation=activation, precision=precision,
             rngs=nnx.Rngs(seed), **kw)


def _tokens(mesh, n, seed=1):
  x = jax.random.normal(jax.random.key(seed), (n, H), jnp.float32).astype(jnp.bfloat16)
  return jax.device_put(x, NamedSharding(mesh, P("ep")))


def _forward(m, x, **kw):
  return np.asarray(nnx.jit(lambda m, x: m(x, **kw))(m, x), np.float32)


def _decode(m, x):
  return np.asarray(nnx.jit(lambda m, x: m.decode(x))(m, x), np.float32)


def _grads(m, x, **kw):
  r = jax.random.normal(jax.random.key(5), x.shape, jnp.float32)
  g = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, **kw).astype(jnp.float32) * r)))(m)
  return {k: np.asarray(v, np.float32) for k, v in nnx.to_pure_dict(g).items()}


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("R", [1, 4])
def test_cached_fp8_blocks_give_the_steps_outputs_and_gradients_bitwise(R, activation):
  mesh = make_mesh(R)
  m = _model(mesh, activation=activation, **({} if activation == "swiglu" else
                                              dict(shared_gated=True)))
  x = _tokens(mesh, 16 * R)
  q = nnx.jit(lambda m: m.fp8_weights())(m)
  names = {"swiglu": {"w13", "w2", "shared_w13", "shared_w2"},
           "gelu": {"w_in", "w_out", "shared_w_in", "shared_w_out", "shared_w_gate"}}[activation]
  assert set(q) == names and all(isinstance(v, Fp8Weights) for v in q.values())
  assert q["w2" if activation == "swiglu" else "w_out"].q.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(_forward(m, x, fp8_weights=q), _forward(m, x))
  g_cached, g_step = _grads(m, x, fp8_weights=q), _grads(m, x)
  assert set(g_cached) == set(g_step)
  for k in g_step:
    assert np.any(g_step[k] != 0), k
    np.testing.assert_array_equal(g_cached[k], g_step[k], err_msg=k)


def test_the_cached_step_compiles_once():
  """A fresh copy of the blocks (as after each optimizer update) reuses the
  step's program: the function is traced once."""
  mesh = make_mesh(2)
  m = _model(mesh)
  x = _tokens(mesh, 32)
  traces = []

  def f(m, x, q):
    traces.append(1)
    return m(x, fp8_weights=q)

  step = nnx.jit(f)
  cast = nnx.jit(lambda m: m.fp8_weights())
  step(m, x, cast(m))
  step(m, x + 1, cast(m))
  assert len(traces) == 1


@pytest.mark.parametrize("R", [1, 2])
def test_held_inference_blocks_give_the_same_forward_and_leave_the_params(R):
  mesh = make_mesh(R)
  m = _model(mesh)
  x = _tokens(mesh, 16 * R)
  want, want_decode = _forward(m, x), _decode(m, x)
  m.to_fp8_inference()
  assert [k for k, _ in nnx.state(m, nnx.Param).flat_state()] == [("router",)]
  assert m.w13 is None and m.fp8_blocks["w13"][0][...].dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(_forward(m, x), want)
  np.testing.assert_array_equal(_decode(m, x), want_decode)
  with pytest.raises(ValueError, match="to_fp8_inference"):
    m.fp8_weights()


def _np_swiglu_layer(x, router, w13, w2, s13, s2, *, fp8_rows: bool):
  """float64 dense oracle of the routed SwiGLU experts plus the shared
  expert; fp8_rows: the routed experts' inputs and hidden rows go through
  the e4m3 row cast and the weights through the block cast, as the FP8
  layer does (the casts' values from jax_ep.fp8, the arithmetic here)."""
  logits = x @ router
  idx = np.argsort(-logits, axis=-1, kind="stable")[:, :K]
  top = np.take_along_axis(logits, idx, axis=-1)
  w = np.exp(top - top.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)

  def rows(a):
    if not fp8_rows:
      return a
    q, s = _fp8.quantize(jnp.asarray(a, jnp.float32))
    return np.asarray(_fp8.dequantize(q, s, jnp.float32), np.float64)

  def blocks(wt):
    if not fp8_rows:
      return wt
    from jax_ep.ops.grouped_gemm import dequantize_weights_fp8, quantize_weights_fp8
    return np.asarray(dequantize_weights_fp8(*quantize_weights_fp8(jnp.asarray(wt[None]))),
                      np.float64)[0]

  def ffn(a, up, down):
    h = rows(a) @ blocks(up)
    f = h.shape[-1] // 2
    g = h[:, :f]
    return rows(g / (1 + np.exp(-g)) * h[:, f:]) @ blocks(down)

  out = ffn(x, s13, s2)
  for t in range(x.shape[0]):
    for k in range(K):
      e = idx[t, k]
      out[t] += w[t, k] * ffn(x[t:t + 1], w13[e], w2[e])[0]
  return out


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_decode_matches_the_forward_and_a_float64_oracle(R, precision):
  """decode sums a token's top-k rows in the low-latency combine's order and
  casts its hidden rows on the [E_l, R * T] grid: the same values as the
  forward up to a few bf16 roundings."""
  mesh = make_mesh(R)
  m = _model(mesh, precision=precision, dtype=jnp.float32 if precision == "bf16" else jnp.bfloat16,
             param_dtype=jnp.float32)
  x = _tokens(mesh, 8 * R, seed=R)
  got, fwd = _decode(m, x), _forward(m, x)
  scale = np.max(np.abs(fwd))
  assert np.max(np.abs(got - fwd)) <= 2e-2 * scale, np.max(np.abs(got - fwd)) / scale
  xs = np.asarray(x, np.float64)
  want = _np_swiglu_layer(xs, np.asarray(m.router[...], np.float64),
                          *(np.asarray(getattr(m, n)[...], np.float64)
                            for n in ("w13", "w2", "shared_w13", "shared_w2")),
                          fp8_rows=precision == "fp8")
  assert np.max(np.abs(got - want)) <= 3e-2 * np.max(np.abs(want)), \
      np.max(np.abs(got - want)) / np.max(np.abs(want))


def test_decode_with_every_token_on_one_expert_and_nan_propagating():
  mesh = make_mesh(4)
  m = _model(mesh, shared_ffn=None)
  # A router that sends every token to experts 0 and 1: the low-latency grid
  # holds all R * T rows in one group.
  r = np.zeros((H, E), np.float32)
  r[:, 0], r[:, 1] = 1.0, 0.5
  m.router = nnx.Param(jnp.asarray(r))
  x = jnp.abs(_tokens(mesh, 32))
  got, fwd = _decode(m, x), _forward(m, x)
  idx, _ = route(jnp.asarray(x, jnp.float32) @ m.router[...], topk=K)
  assert set(np.unique(np.asarray(idx))) == {0, 1}
  assert np.max(np.abs(got - fwd)) <= 2e-2 * np.max(np.abs(fwd))
  bad = x.at[3, 0].set(jnp.nan)
  out = _decode(m, bad)
  assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, axis=0)))


def test_bad_uses_raise_value_errors_naming_the_cause():
  mesh = make_mesh(2)
  x = _tokens(mesh, 16)
  bf16 = _model(mesh, precision="bf16")
  with pytest.raises(ValueError, match="precision='fp8'"):
    bf16.fp8_weights()
  m = _model(mesh)
  q = nnx.jit(lambda m: m.fp8_weights())(m)
  with pytest.raises(ValueError, match="precision='fp8'"):
    bf16(x, fp8_weights=q)
  with pytest.raises(ValueError, match="fp8_weights must hold"):
    m(x, fp8_weights={k: v for k, v in q.items() if k != "w2"})
  m.to_fp8_inference()
  with pytest.raises(ValueError, match="already holds FP8 blocks"):
    m(x, fp8_weights=q)
  dp = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "ep"))
  with pytest.raises(ValueError, match="data_axis"):
    _model(dp, data_axis="dp").decode(_tokens(dp, 16))
