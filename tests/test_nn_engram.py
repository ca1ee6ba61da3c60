"""jax_ep.nn.Engram on 4 CPU devices (reference backend): the sharded lookup
against a plain gather of the whole table, the hash's ranges, causality,
padding, gradients into the table's fetched rows only, and a few training
steps that lower the loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ep.nn import Engram
from jax_ep.nn.engram import causal_depthwise_conv, ngram_row_ids, sub_table_sizes

B, S, H, VOCAB = 8, 12, 32, 50


def _setup(seed=0, **kw):
  mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
  model = Engram(H, mesh=mesh, rows_per_head=61, head_dim=8, heads=2, rngs=nnx.Rngs(seed), **kw)
  rng = np.random.default_rng(seed)
  shard = NamedSharding(mesh, P("ep"))
  h = jax.device_put(jnp.asarray(rng.standard_normal((B, S, H)), jnp.float32), shard)
  ids = jax.device_put(jnp.asarray(rng.integers(0, VOCAB, (B, S)), jnp.int32), shard)
  return model, h, ids


def _oracle(model, h, ids):
  """The same layer with the lookup done as one gather of the whole table
  (jitted too, so XLA fuses the rest of the layer the same way)."""
  idx = np.asarray(model.row_ids(ids))
  table = np.asarray(model.table[...].astype(model.dtype), np.float32)
  rows = np.where(idx[..., None] >= 0, table[np.maximum(idx, 0)], 0)
  return nnx.jit(lambda m, h, r: m.mix(h, r))(model, h, jnp.asarray(rows, model.dtype))


def test_sub_tables_are_distinct_primes_and_ids_stay_inside_their_own():
  sizes = sub_table_sizes(61, 4)
  assert sizes == [61, 59, 53, 47]
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 10_000, (3, 40)), jnp.int32)
  rows = np.asarray(ngram_row_ids(ids, orders=(2, 3), heads=2, sizes=sizes))
  assert rows.shape == (3, 40, 4)
  offsets = np.cumsum([0] + sizes)
  for c in range(4):
    col = rows[:, :, c]
    n = (2, 2, 3, 3)[c]
    assert np.all(col[:, :n - 1] == -1), "n-grams that start before the sequence fetch -1"
    live = col[:, n - 1:]
    assert np.all((live >= offsets[c]) & (live < offsets[c + 1]))
  # The hash depends on the whole n-gram, not only on its last token.
  a = np.asarray(ngram_row_ids(jnp.asarray([[1, 2, 3]]), orders=(2,), heads=1, sizes=[61]))
  b = np.asarray(ngram_row_ids(jnp.asarray([[4, 2, 3]]), orders=(2,), heads=1, sizes=[61]))
  assert a[0, 2, 0] == b[0, 2, 0] and a[0, 1, 0] != b[0, 1, 0]


def test_padding_tokens_fetch_nothing():
  ids = jnp.asarray([[5, -1, 7, 8]], jnp.int32)
  rows = np.asarray(ngram_row_ids(ids, orders=(2,), heads=1, sizes=[61]))[0, :, 0]
  assert rows[0] == -1 and rows[1] == -1 and rows[2] == -1 and rows[3] >= 0


def test_layer_equals_a_plain_gather_of_the_whole_table():
  model, h, ids = _setup()
  got = nnx.jit(lambda m, h, i: m(h, i))(model, h, ids)
  assert got.shape == h.shape and got.dtype == h.dtype
  np.testing.assert_allclose(np.asarray(got), np.asarray(_oracle(model, h, ids)), rtol=0,
                             atol=0)


def test_causal_depthwise_conv():
  x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 6, 3)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(3).standard_normal((3, 3)), jnp.float32)
  y = np.asarray(causal_depthwise_conv(x, w))
  xn, wn = np.asarray(x), np.asarray(w)
  for t in range(6):
    want = sum(wn[j] * xn[:, t - j] for j in range(3) if t - j >= 0)
    np.testing.assert_allclose(y[:, t], want, rtol=1e-6, atol=1e-6)


def test_output_is_causal_in_the_tokens():
  model, h, ids = _setup(seed=4)
  model.conv[...] = jnp.ones_like(model.conv[...]) * 0.5  # make the conv mix positions
  f = nnx.jit(lambda m, h, i: m(h, i))
  y0 = np.asarray(f(model, h, ids))
  ids2 = np.asarray(ids).copy()
  ids2[:, 7] = (ids2[:, 7] + 1) % VOCAB
  y1 = np.asarray(f(model, h, jnp.asarray(ids2)))
  np.testing.assert_array_equal(y0[:, :7], y1[:, :7])
  assert not np.array_equal(y0[:, 7:], y1[:, 7:])


def test_gradient_reaches_only_the_fetched_rows_and_training_lowers_the_loss():
  model, h, ids = _setup(seed=5)
  target = jnp.zeros_like(h)

  def loss_fn(m):
    return jnp.mean((m(h, ids) - target) ** 2)

  grads = nnx.jit(lambda m: nnx.grad(loss_fn)(m))(model)
  g = np.asarray(grads.table[...])
  used = np.unique(np.asarray(model.row_ids(ids)))
  used = used[used >= 0]
  touched = np.flatnonzero(np.any(g != 0, axis=1))
  assert set(touched) <= set(used) and len(touched) > 0
  for name in ("w_k", "w_v", "norm_h", "norm_k", "conv"):
    assert np.any(np.asarray(getattr(grads, name)[...]) != 0), name

  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(m, opt):
    loss, gr = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, gr)
    return loss

  losses = [float(step(model, opt)) for _ in range(20)]
  assert losses[-1] < 0.8 * losses[0], losses


def test_bad_arguments_are_named():
  mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
  with pytest.raises(ValueError, match="axis_name"):
    Engram(H, mesh=mesh, axis_name="tp", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="orders"):
    Engram(H, mesh=mesh, orders=(), rngs=nnx.Rngs(0))
  model, h, ids = _setup()
  with pytest.raises(ValueError, match="token_ids"):
    model(h, ids[:, :3])
