"""jax_ep.mega_moe: the routed SwiGLU experts of an FP8 layer as one op.

Checked against a float64 NumPy oracle of its casts (x per token and 128
channels, the weights per 128 x 128 block, the SwiGLU output per row and 128
channels), against the layer's unfused FP8 path (forward and gradients,
bitwise), with held FP8 weights, and for bad input. CPU, virtual devices.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import oracle
from conftest import RANKS, make_mesh
import jax_ep
from jax_ep.nn import MoE
from jax_ep.ops.grouped_gemm import quantize_weights_fp8

T, H, F, K, E_PER_RANK = 16, 256, 128, 3, 4


def _sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def _bf16(a):
  return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), np.float64)


def np_mega_moe(x, idx, w, w13, w2, *, casts: bool = True):
  """float64: sum_k w[t, k] * swiglu(x_t @ w13[e]) @ w2[e] over the valid k,
  with the op's FP8 casts and its bf16 roundings of the first product and of
  the SwiGLU output (casts=True), or none of them."""
  same = lambda a: np.asarray(a, np.float64)  # noqa: E731
  rt = oracle.fp8_round_trip if casts else same
  blocks = oracle.fp8_block_round_trip if casts else same
  bf16 = _bf16 if casts else same
  xq, w13q, w2q = rt(x), blocks(w13), blocks(w2)
  f = w2.shape[1]
  out = np.zeros(x.shape, np.float64)
  for e in range(w13.shape[0]):
    t, k = np.nonzero(idx == e)
    if not len(t):
      continue
    a = bf16(xq[t] @ w13q[e])
    g, u = a[:, :f], a[:, f:]
    h = rt(bf16(g * _sigmoid(g) * u))
    np.add.at(out, t, w[t, k][:, None] * (h @ w2q[e]))
  return out


def _inputs(R, mode, seed=0):
  rng = np.random.default_rng(seed)
  E = E_PER_RANK * R
  idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
  x = rng.standard_normal((R * T, H)).astype(np.float32)
  x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # exactly bf16 values
  w13 = (rng.standard_normal((E, H, 2 * F)) / np.sqrt(H)).astype(np.float32)
  w2 = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)
  return x, idx.reshape(R * T, K), w.reshape(R * T, K), w13, w2


def _run(mesh, x, idx, w, w13, w2, **kw):
  E = w13[0].shape[0] if isinstance(w13, tuple) else w13.shape[0]
  f = jax_ep.shard_map(functools.partial(jax_ep.mega_moe, num_experts=E, **kw), mesh)
  return jax.jit(f)(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(w), w13, w2)


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("mode", ["random", "skewed", "empty_rank"])
@pytest.mark.parametrize("R", RANKS)
def test_mega_moe_is_within_fp8_rounding_of_the_float64_oracle_of_its_casts(R, mode):
  x, idx, w, w13, w2 = _inputs(R, mode, seed=R)
  got = np.asarray(_run(make_mesh(R), x, idx, w, jnp.asarray(w13), jnp.asarray(w2)),
                   np.float64)
  want = np_mega_moe(x, idx, np.where(idx >= 0, w, 0), w13, w2)
  plain = np_mega_moe(x, idx, np.where(idx >= 0, w, 0), w13, w2, casts=False)
  # The casts and roundings move the result by a few percent; what is left
  # against the oracle that makes them too is the f32 accumulation, the
  # final bf16 rounding and a rare e4m3 or bf16 rounding flip: far smaller.
  assert np.isfinite(got).all()
  # Tokens with no valid expert get exactly zero (at R = 1, "empty_rank"
  # leaves no token any expert).
  assert np.all(got[(idx < 0).all(-1)] == 0)
  if not (idx >= 0).any():
    return
  cast_effect = _rel(want, plain)
  assert cast_effect > 5e-3, "the inputs are too tame to tell the casts apart"
  assert _rel(got, want) < 0.1 * cast_effect, (_rel(got, want), cast_effect)


def _layer(R, fused, seed=3):
  mesh = make_mesh(R)
  return MoE(H, F, E_PER_RANK * R, K, mesh=mesh, activation="swiglu", precision="fp8",
             combine_layout="expert", fused=fused, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("R", [1, 2, 8])
def test_fused_layer_gives_the_unfused_fp8_layers_outputs_and_gradients_bitwise(R):
  rng = np.random.default_rng(R)
  x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
  r = jnp.asarray(rng.standard_normal((R * T, H)), jnp.float32)

  def value_and_grads(model):
    def loss(m, x):
      return jnp.sum(m(x).astype(jnp.float32) * r)
    v, (gm, gx) = nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=(0, 1))(m, x))(model, x)
    return np.asarray(v), nnx.to_pure_dict(gm), np.asarray(gx, np.float32)

  v_f, g_f, dx_f = value_and_grads(_layer(R, True))
  v_u, g_u, dx_u = value_and_grads(_layer(R, False))
  assert v_f == v_u
  np.testing.assert_array_equal(dx_f, dx_u)
  assert set(g_f) == set(g_u)
  for name in g_f:
    a, b = np.asarray(g_f[name], np.float32), np.asarray(g_u[name], np.float32)
    assert np.abs(a).max() > 0, name
    np.testing.assert_array_equal(a, b, err_msg=name)


def test_held_fp8_weights_give_the_master_weights_forward():
  R = 2
  mesh = make_mesh(R)
  x, idx, w, w13, w2 = _inputs(R, "random", seed=11)
  master = _run(mesh, x, idx, w, jnp.asarray(w13), jnp.asarray(w2))
  held = _run(mesh, x, idx, w, quantize_weights_fp8(jnp.asarray(w13)),
              quantize_weights_fp8(jnp.asarray(w2)))
  np.testing.assert_array_equal(np.asarray(held, np.float32), np.asarray(master, np.float32))


def test_one_compiled_program_for_new_inputs_of_the_same_shapes():
  R = 4
  mesh = make_mesh(R)
  f = jax.jit(jax_ep.shard_map(functools.partial(jax_ep.mega_moe, num_experts=E_PER_RANK * R),
                               mesh))
  for seed in (0, 1):
    x, idx, w, w13, w2 = _inputs(R, "random", seed=seed)
    f(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(w13),
      jnp.asarray(w2)).block_until_ready()
  assert f._cache_size() == 1


def _bad(**change):
  x, idx, w, w13, w2 = _inputs(1, "random")
  args = dict(x=jnp.asarray(x, jnp.bfloat16), topk_idx=jnp.asarray(idx), topk_weights=jnp.asarray(w),
              w13=jnp.asarray(w13), w2=jnp.asarray(w2))
  kw = dict(num_experts=E_PER_RANK)
  for k, v in change.items():
    (args if k in args else kw)[k] = v(args[k]) if k in args and callable(v) else v
  f = jax_ep.shard_map(lambda *a: jax_ep.mega_moe(*a, **kw), make_mesh(1))
  return f(*args.values())


@pytest.mark.parametrize("change,match", [
    (dict(x=lambda a: a[:, :200]), "x: the hidden size H=200"),
    (dict(w13=lambda a: a[..., :2 * F - 2]), "w13"),
    (dict(w13=lambda a: a[..., :F]), "w13 .* F a multiple of 128"),
    (dict(w2=lambda a: a[:, :, :128]), "w2 must be"),
    (dict(w13=lambda a: a.astype(jnp.int8)), "w13 must be bfloat16 or float32"),
    (dict(w13=lambda a: quantize_weights_fp8(a)), "must both be master weights or both held"),
    (dict(topk_weights=None), "topk_weights is required"),
    (dict(num_experts=3 * E_PER_RANK), "local experts"),
    (dict(backend="cuda"), "fused kernels are not in this build"),
    (dict(num_sms=-1), "num_sms"),
])
def test_bad_input_raises_a_value_error_naming_the_argument(change, match):
  with pytest.raises(ValueError, match=match):
    _bad(**change)


def test_fused_layer_needs_swiglu_and_fp8():
  mesh = make_mesh(2)
  with pytest.raises(ValueError, match="fused=True"):
    MoE(H, F, 4, 2, mesh=mesh, activation="swiglu", fused=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="combine_layout"):
    MoE(H, F, 4, 2, mesh=mesh, activation="swiglu", precision="fp8", fused=True,
        combine_layout="rank", rngs=nnx.Rngs(0))
