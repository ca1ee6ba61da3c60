"""An Engram memory layer (Flax NNX): hashed n-gram lookups into a table
split over the EP ranks, gated into the residual stream (docs/design.md §2).

Per position t of each sequence, for every n-gram order n (default 2 and 3)
and head j, the n tokens ending at t are hashed into their own sub-table of
prime size p[n, j]; the rows of all (n, j) pairs live in one table [V, D]
split contiguously over the EP axis, so a lookup is one `engram_fetch` of
e = len(orders) * heads global row ids per token. n-grams that start before
the sequence (t < n - 1) fetch id -1, i.e. zeros. Then, with m_t the e rows
concatenated:

    k, v  = m_t W_k, m_t W_v
    alpha = sigmoid(<RMSNorm(h_t), RMSNorm(k_t)> / sqrt(H))
    u     = alpha * v
    y     = SiLU(CausalDepthwiseConv(RMSNorm(u))) + u
    out   = h + y

Publishing (engram_publish: on GPU the shard is copied into the
Communicator's window, then the rows are NVLink loads from their owners;
elsewhere the reference all_to_all) is paid once per table update, not once
per lookup: `published = layer.publish()` after each optimizer step (or once
for inference), then `layer(h, token_ids, published)` any number of times.
Called without `published`, the layer publishes its table itself first (one
publish per call). Either way the gradient flows to the owners' shards of
the layer's own table parameter.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ep import mesh as _mesh
from jax_ep._types import PublishedTable
from jax_ep.ops.engram import engram_fetch, engram_publish

# Odd 32-bit multipliers for the n-gram hash (one per (head, position in the
# n-gram)); any distinct odd constants with mixed bits will do.
_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C | 1,
                0xFD7046C5, 0xB55A4F09, 0x7FEB352D, 0x846CA68B, 0x2C1B3C6D, 0x297A2D39)


def _is_prime(n: int) -> bool:
  if n < 2:
    return False
  if n % 2 == 0:
    return n == 2
  for d in range(3, math.isqrt(n) + 1, 2):
    if n % d == 0:
      return False
  return True


def sub_table_sizes(rows_per_head: int, count: int) -> list[int]:
  """`count` distinct primes, the largest <= rows_per_head: one modulus per
  (n-gram order, head), so that two heads rarely collide on the same pairs."""
  out, n = [], rows_per_head
  while len(out) < count:
    if n < 2:
      raise ValueError(f"rows_per_head={rows_per_head} leaves fewer than {count} primes")
    if _is_prime(n):
      out.append(n)
    n -= 1
  return out


def ngram_row_ids(token_ids: jax.Array, *, orders: Sequence[int], heads: int,
                  sizes: Sequence[int]) -> jax.Array:
  """Global table rows [B, S, len(orders) * heads] of each position's n-grams:
  sub-table (order i, head j) is rows [offset, offset + sizes[i * heads + j])
  with offsets the running sum of sizes; -1 where the n-gram would start
  before the sequence or holds a negative (padding) token."""
  ids = token_ids.astype(jnp.int32)
  b, s = ids.shape
  cols, offset, c = [], 0, 0
  for n in orders:
    # shifted[i] = token at t - i (i = 0 .. n-1), -1 before the sequence.
    shifted = [jnp.pad(ids, ((0, 0), (i, 0)), constant_values=-1)[:, :s] for i in range(n)]
    valid = functools.reduce(jnp.logical_and, [x >= 0 for x in shifted])
    for j in range(heads):
      hval = jnp.zeros((b, s), jnp.uint32)
      for i, x in enumerate(shifted):
        mult = jnp.uint32(_MULTIPLIERS[(j * 5 + i) % len(_MULTIPLIERS)])
        hval = (hval ^ x.astype(jnp.uint32)) * mult
      hval = hval ^ (hval >> 15)
      p = sizes[c]
      row = (hval % jnp.uint32(p)).astype(jnp.int32) + offset
      cols.append(jnp.where(valid, row, -1))
      offset += p
      c += 1
  return jnp.stack(cols, axis=-1)


def _rms_norm(x, scale=None, eps: float = 1e-6):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if scale is None else y * scale


def causal_depthwise_conv(x: jax.Array, w: jax.Array) -> jax.Array:
  """y[:, t] = sum_j w[j] * x[:, t - j] over the sequence axis (1), per
  channel; w [K, C]; positions before the sequence count as zero."""
  k = w.shape[0]
  s = x.shape[1]
  xp = jnp.pad(x, ((0, 0), (k - 1, 0), (0, 0)))
  return sum(w[j] * xp[:, k - 1 - j:k - 1 - j + s] for j in range(k))


class Engram(nnx.Module):
  """Hashed n-gram memory with a gated residual (module docstring).

  Args:
    hidden: model width H.
    mesh, axis_name: the table's rows and the batch are split over it.
    rows_per_head: size bound of each (order, head) sub-table (a prime at or
      below it is used).
    head_dim: D, the width of one table row (a multiple of 8 for bf16 rows,
      so the GPU kernels can move them).
    orders: n-gram orders; heads: hash heads per order.
    conv_kernel: taps of the causal depthwise convolution.
    backend: passed to engram_publish / engram_fetch (None: kernels on GPU
      when the Communicator's window holds the table, else the reference).
    dtype: compute dtype (and the dtype of the rows moved); param_dtype: the
      parameters' storage dtype.
  """

  def __init__(self, hidden: int, *, mesh: Mesh, axis_name: str = "ep",
               rows_per_head: int = 4099, head_dim: int = 32, orders: Sequence[int] = (2, 3),
               heads: int = 4, conv_kernel: int = 4, backend: Optional[str] = None,
               dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not orders or any(n < 1 for n in orders):
      raise ValueError(f"orders must be n-gram orders >= 1, got {orders}")
    if heads < 1 or conv_kernel < 1 or head_dim < 1:
      raise ValueError("heads, conv_kernel and head_dim must be >= 1")
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    self.mesh, self.axis_name, self.backend, self.dtype = mesh, axis_name, backend, dtype
    self.orders, self.heads = tuple(int(n) for n in orders), int(heads)
    self.sizes = tuple(sub_table_sizes(rows_per_head, len(self.orders) * self.heads))
    r = mesh.shape[axis_name]
    self.num_rows = -(-sum(self.sizes) // r) * r  # rows past the sub-tables stay unused
    e = len(self.sizes)
    table = jax.random.normal(rngs.params(), (self.num_rows, head_dim), jnp.float32)
    self.table = nnx.Param(jax.device_put((table / math.sqrt(head_dim)).astype(param_dtype),
                                          NamedSharding(mesh, P(axis_name))))
    init = jax.nn.initializers.lecun_normal()
    self.w_k = nnx.Param(init(rngs.params(), (e * head_dim, hidden), param_dtype))
    self.w_v = nnx.Param(init(rngs.params(), (e * head_dim, hidden), param_dtype))
    self.norm_h = nnx.Param(jnp.ones((hidden,), param_dtype))
    self.norm_k = nnx.Param(jnp.ones((hidden,), param_dtype))
    self.norm_u = nnx.Param(jnp.ones((hidden,), param_dtype))
    self.conv = nnx.Param(jnp.zeros((conv_kernel, hidden), param_dtype))

  def row_ids(self, token_ids: jax.Array) -> jax.Array:
    """[B, S, e] global table rows (ngram_row_ids with this layer's sizes)."""
    return ngram_row_ids(token_ids, orders=self.orders, heads=self.heads, sizes=self.sizes)

  def publish(self) -> PublishedTable:
    """Publishes the table as it is now (global arrays, split over the EP
    axis) for later calls; call it again after every update of the table."""
    pub = _mesh.shard_map(functools.partial(engram_publish, axis_name=self.axis_name,
                                            backend=self.backend),
                          self.mesh, axis_name=self.axis_name)
    return pub(self.table[...].astype(self.dtype))

  def __call__(self, h: jax.Array, token_ids: jax.Array,
               published: Optional[PublishedTable] = None) -> jax.Array:
    """h: [B, S, H]; token_ids: [B, S] (negative = padding); B split over
    the EP axis; published: this layer's `publish()` since the table last
    changed (None: publish now). Returns [B, S, H] in h's dtype."""
    if h.ndim != 3 or token_ids.shape != h.shape[:2]:
      raise ValueError(f"h must be [B, S, H] and token_ids [B, S]; got {list(h.shape)} and "
                       f"{list(token_ids.shape)}")
    if published is not None and not isinstance(published, PublishedTable):
      raise ValueError(f"published must be this layer's publish(), got {type(published).__name__}")
    b, s, _ = h.shape
    idx = self.row_ids(token_ids)
    e = idx.shape[-1]
    table = self.table[...].astype(self.dtype)
    if published is None:
      fetch = _mesh.shard_map(functools.partial(_publish_and_fetch, axis_name=self.axis_name,
                                                backend=self.backend),
                              self.mesh, axis_name=self.axis_name)
      rows = fetch(table, idx.reshape(b * s, e))
    else:
      if published.table.shape != table.shape or published.table.dtype != table.dtype:
        raise ValueError(f"published holds a {published.table.dtype}{list(published.table.shape)}"
                         f" table, this layer a {table.dtype}{list(table.shape)} one")
      fetch = _mesh.shard_map(_fetch_published, self.mesh, axis_name=self.axis_name)
      rows = fetch(table, published, idx.reshape(b * s, e))
    return self.mix(h, rows.reshape(b, s, e, -1))

  def mix(self, h: jax.Array, rows: jax.Array) -> jax.Array:
    """The layer after the lookup: h [B, S, H], rows [B, S, e, D]."""
    b, s, hidden = h.shape
    m = rows.reshape(b, s, -1).astype(self.dtype)
    k = m @ self.w_k[...].astype(self.dtype)
    v = m @ self.w_v[...].astype(self.dtype)
    gate = jnp.sum(_rms_norm(h, self.norm_h[...]) * _rms_norm(k, self.norm_k[...]), axis=-1,
                   keepdims=True) / math.sqrt(hidden)
    u = jax.nn.sigmoid(gate) * v.astype(jnp.float32)
    y = jax.nn.silu(causal_depthwise_conv(_rms_norm(u, self.norm_u[...]), self.conv[...])) + u
    return (h.astype(jnp.float32) + y).astype(h.dtype)


def _publish_and_fetch(table, idx, *, axis_name, backend):
  published = engram_publish(table, axis_name=axis_name, backend=backend)
  return engram_fetch(published, idx, axis_name=axis_name)


def _fetch_published(table, published, idx):
  # The rows come from the publication; the gradient goes to `table`, the
  # layer's parameter, which holds the published values.
  return engram_fetch(dataclasses.replace(published, table=table), idx)
