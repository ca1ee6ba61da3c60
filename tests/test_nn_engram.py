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
from jax_ep.nn.engram import _MULTIPLIERS, causal_depthwise_conv, ngram_row_ids, sub_table_sizes

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


def _numpy_layer(model, h, ids):
  """The layer's math (module docstring) in float64 NumPy, independent of
  the module's code: hash ids -> rows -> k, v -> gate -> conv -> residual."""
  p = {n: np.asarray(getattr(model, n)[...], np.float64)
       for n in ("table", "w_k", "w_v", "norm_h", "norm_k", "norm_u", "conv")}
  tok = np.asarray(ids).astype(np.int64)
  b, s = tok.shape
  cols, offset, c = [], 0, 0
  for n in model.orders:
    for j in range(model.heads):
      col = np.full((b, s), -1, np.int64)
      for t in range(n - 1, s):
        gram = tok[:, t - n + 1:t + 1][:, ::-1]        # token at t - i for i = 0 .. n-1
        hv = np.zeros(b, np.uint64)
        for i in range(n):
          mult = np.uint64(_MULTIPLIERS[(j * 5 + i) % len(_MULTIPLIERS)])
          hv = ((hv ^ gram[:, i].astype(np.uint64)) * mult) & np.uint64(0xFFFFFFFF)
        hv ^= hv >> np.uint64(15)
        ok = np.all(gram >= 0, axis=1)
        col[:, t] = np.where(ok, (hv % np.uint64(model.sizes[c])).astype(np.int64) + offset, -1)
      cols.append(col)
      offset += model.sizes[c]
      c += 1
  idx = np.stack(cols, axis=-1)
  rows = np.where(idx[..., None] >= 0, p["table"][np.maximum(idx, 0)], 0.0)
  m = rows.reshape(b, s, -1)
  k, v = m @ p["w_k"], m @ p["w_v"]

  def rms(x, scale):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

  hh = np.asarray(h, np.float64)
  gate = np.sum(rms(hh, p["norm_h"]) * rms(k, p["norm_k"]), -1, keepdims=True) / np.sqrt(H)
  u = v / (1 + np.exp(-gate))
  un = rms(u, p["norm_u"])
  conv = np.zeros_like(un)
  for t in range(s):
    for j in range(p["conv"].shape[0]):
      if t - j >= 0:
        conv[:, t] += p["conv"][j] * un[:, t - j]
  return hh + conv / (1 + np.exp(-conv)) + u, idx


def test_layer_equals_an_independent_numpy_oracle():
  """Float32 layer against the float64 NumPy oracle of its math, hash
  included, with a non-zero convolution so every term counts."""
  model, h, ids = _setup(seed=6, dtype=jnp.float32)
  model.conv[...] = jnp.asarray(np.random.default_rng(7).standard_normal(model.conv.shape),
                                jnp.float32)
  want, want_idx = _numpy_layer(model, h, ids)
  np.testing.assert_array_equal(np.asarray(model.row_ids(ids)), want_idx)
  got = np.asarray(nnx.jit(lambda m, h, i: m(h, i))(model, h, ids), np.float64)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_published_once_equals_publishing_each_call_and_trains_the_same():
  """publish() then calls with it: the same outputs and gradients as the
  layer publishing by itself; and a training loop in the order fetch ->
  loss -> grad -> optax update -> publish gives the same losses as
  publishing inside every step."""
  model, h, ids = _setup(seed=8)
  target = jnp.zeros_like(h)
  pub = nnx.jit(lambda m: m.publish())(model)
  a = nnx.jit(lambda m, h, i: m(h, i))(model, h, ids)
  b = nnx.jit(lambda m, h, i, p: m(h, i, p))(model, h, ids, pub)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ga = nnx.jit(nnx.grad(lambda m: jnp.mean((m(h, ids) - target) ** 2)))(model)
  gb = nnx.jit(nnx.grad(lambda m, p: jnp.mean((m(h, ids, p) - target) ** 2)))(model, pub)
  for name in ("table", "w_k", "w_v", "conv"):
    np.testing.assert_array_equal(np.asarray(getattr(ga, name)[...]),
                                  np.asarray(getattr(gb, name)[...]), err_msg=name)

  def losses(carry_publication: bool):
    m, _, _ = _setup(seed=8)
    opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt, p):
      loss, gr = nnx.value_and_grad(lambda m: jnp.mean((m(h, ids, p) - target) ** 2))(m)
      opt.update(m, gr)
      return loss, (m.publish() if carry_publication else None)

    p = nnx.jit(lambda m: m.publish())(m) if carry_publication else None
    out = []
    for _ in range(5):
      loss, p = step(m, opt, p)
      out.append(float(loss))
    return out

  assert losses(True) == losses(False)
  with pytest.raises(ValueError, match="published"):
    model(h, ids, published=pub.table)
