"""jax_ep.nn.MoE on 8 CPU devices (reference backend): shapes, a gradient
step, and bf16 parameter storage computing exactly what f32 storage cast to
bf16 computes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ep.nn import MoE


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
