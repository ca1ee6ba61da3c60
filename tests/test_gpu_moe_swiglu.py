"""jax_ep.nn.MoE with SwiGLU experts on one GPU: the grouped GEMM kernels
(backend None) against the reference backend, forward and gradients; no f32
[M, 2F] or [M, F] array between the two expert GEMMs in the compiled
program; precision="fp8" on the FP8 kernels against the same casts on the
reference backend; both train without NaN; one program per step."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ep import _native
from jax_ep.mesh import place_replicated
from jax_ep.nn import MoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and a GPU"),
]

H, F, E = 256, 384, 8  # 2F = 768 and F = 384 appear in no other array of the layer


def _mesh():
  return Mesh(np.array(jax.devices("cuda")[:1]), ("ep",))


@pytest.fixture(scope="module", autouse=True)
def _communicator():
  """A Communicator on the layer's axis, so backend None runs the dispatch,
  combine and low-latency kernels too, not only the grouped GEMMs."""
  from jax_ep.comm import Communicator
  c = Communicator.create(_mesh(), "ep", 256 << 20)
  yield c
  c.close()


def _model(backend, **kw):
  kw.setdefault("shared_ffn", F)
  return MoE(H, F, E, 2, mesh=_mesh(), activation="swiglu", backend=backend,
             rngs=nnx.Rngs(3), **kw)


def _x(n=512):
  x = jax.random.normal(jax.random.key(1), (n, H), jnp.float32).astype(jnp.bfloat16)
  return jax.device_put(x, NamedSharding(_mesh(), P("ep")))


def _value_and_grads(model, x):
  r = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  f = nnx.jit(lambda m, x: nnx.value_and_grad(
      lambda m, x: jnp.sum(m(x).astype(jnp.float32) * r), argnums=(0, 1))(m, x))
  loss, (gm, gx) = f(model, x)
  return float(loss), {k: np.asarray(v, np.float32) for k, v in nnx.to_pure_dict(gm).items()}, \
      np.asarray(gx, np.float32)


def _rel(a, b):
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_swiglu_layer_on_the_kernels_matches_the_reference_backend():
  x = _x()
  lk, gk, gxk = _value_and_grads(_model(None), x)
  lr, gr, gxr = _value_and_grads(_model("reference"), x)
  assert abs(lk - lr) <= 1e-2 * abs(lr)
  assert _rel(gxk, gxr) < 2e-2
  for k in gr:
    assert np.all(np.isfinite(gk[k])), k
    assert _rel(gk[k], gr[k]) < 2e-2, (k, _rel(gk[k], gr[k]))


def test_fp8_swiglu_layer_on_the_fp8_kernels_matches_the_reference_backend():
  """The same casts on both backends (dispatch in FP8, the FP8 products
  forward, dgrad and wgrad), so only f32 accumulation order and bf16
  rounding of the products differ; and the FP8 kernels did run."""
  x = _x()
  lk, gk, gxk = _value_and_grads(_model(None, precision="fp8"), x)
  lr, gr, gxr = _value_and_grads(_model("reference", precision="fp8"), x)
  assert abs(lk - lr) <= 1e-2 * abs(lr)
  assert _rel(gxk, gxr) < 3e-2
  for k in gr:
    assert np.all(np.isfinite(gk[k])), k
    assert _rel(gk[k], gr[k]) < 3e-2, (k, _rel(gk[k], gr[k]))
  model = _model(None, precision="fp8", shared_ffn=None)
  graph, state = nnx.split(model)
  hlo = jax.jit(lambda s, x: nnx.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32)),
                                      argnums=(0, 1))(nnx.merge(graph, s), x)).lower(
                                          state, x).as_text()
  assert hlo.count("jax_ep_grouped_gemm_fp8") >= 6, "forward, dgrad and wgrad of both GEMMs"


def test_no_f32_hidden_array_between_the_expert_gemms():
  # Routed experts only: the shared expert's XLA dot may keep an f32 output
  # of its own, which says nothing about the grouped GEMMs.
  model = _model(None, shared_ffn=None)
  graph, state = nnx.split(model)
  x = _x()
  hlo = jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, x).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  assert "jax_ep_grouped_gemm" in hlo
  assert not re.search(r"f32\[\d+,(768|384)\]", entry), "an f32 hidden array reaches memory"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_train_step_compiles_once_and_stays_finite(precision):
  mesh = _mesh()
  model = _model(None, precision=precision)
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  nnx.update(opt, place_replicated(nnx.state(opt), mesh))
  x = _x()
  graph, state = nnx.split((model, opt))
  # The state comes back with the shardings it went in with, so the second
  # step's inputs look like the first's (on a one-device mesh jit would
  # otherwise hand back single-device shardings, a new signature).
  shardings = jax.tree.map(lambda a: a.sharding, state)

  @functools.partial(jax.jit, out_shardings=(NamedSharding(mesh, P()), shardings))
  def step(state, x):
    model, opt = nnx.merge(graph, state)
    loss, grads = nnx.value_and_grad(
        lambda m: jnp.mean((m(x).astype(jnp.float32) - 0.5 * x.astype(jnp.float32)) ** 2))(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  losses = []
  for _ in range(5):
    loss, state = step(state, x)
    losses.append(float(loss))
  assert step._cache_size() == 1
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def _forward(model, x, **kw):
  return np.asarray(nnx.jit(lambda m, x: m(x, **kw))(model, x), np.float32)


def _decode(model, x):
  return np.asarray(nnx.jit(lambda m, x: m.decode(x))(model, x), np.float32)


def test_fp8_inference_forms_on_the_kernels_match_the_reference_backend():
  """Cached blocks (the weight-cast kernel), held blocks and the decode
  path (low-latency FP8 dispatch -> masked FP8 GEMMs -> low-latency
  combine) on the kernels against the same forms on the reference backend,
  and the cached step equal to the in-step cast on the kernels."""
  x = _x(256)
  kern, ref = _model(None, precision="fp8"), _model("reference", precision="fp8")
  want = _forward(ref, x)
  step = _forward(kern, x)
  assert _rel(step, want) < 3e-2
  q = nnx.jit(lambda m: m.fp8_weights())(kern)
  np.testing.assert_array_equal(_forward(kern, x, fp8_weights=q), step)
  want_decode, got_decode = _decode(ref, x), _decode(kern, x)
  assert np.all(np.isfinite(got_decode))
  assert _rel(got_decode, want_decode) < 3e-2
  assert _rel(got_decode, step) < 3e-2
  kern.to_fp8_inference()
  np.testing.assert_array_equal(_forward(kern, x), step)
  assert _rel(_decode(kern, x), want_decode) < 3e-2
  graph, state = nnx.split(kern)
  hlo = jax.jit(lambda s, x: nnx.merge(graph, s).decode(x)).lower(state, x).as_text()
  assert "jax_ep_ll_dispatch" in hlo and "jax_ep_grouped_gemm_fp8" in hlo


def test_bf16_decode_on_the_kernels_matches_the_forward():
  x = _x(256)
  model = _model(None)
  assert _rel(_decode(model, x), _forward(model, x)) < 2e-2
