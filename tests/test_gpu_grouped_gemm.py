"""Grouped GEMM kernels on one GPU against a float64 NumPy oracle: group-size
patterns (uniform, empty groups, one group with every row, sizes that are not
multiples of the 128-row tile, padding rows past the last group), bf16 and
f32 outputs, gradients, the masked form with garbage (NaN) past the counts,
an SM limit, and agreement with XLA's own lax.ragged_dot on the GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import oracle
from jax_ep import _native
from oracle import stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and a GPU"),
]

H, F = 256, 384  # F not a multiple of the 256-wide tile


def _sizes(pattern: str, G: int, rng) -> list[int]:
  if pattern == "uniform":
    return [128] * G
  if pattern == "empty_groups":
    return [0 if g % 3 == 0 else int(rng.integers(1, 300)) for g in range(G)]
  if pattern == "all_in_one":
    return [0] * (G - 2) + [777, 0]
  if pattern == "odd":
    return [int(v) for v in rng.integers(1, 260, G)]
  raise ValueError(pattern)


def _operands(rng, M, G, h=H, f=F):
  x = jnp.asarray(rng.standard_normal((M, h), np.float32)).astype(jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((G, h, f), np.float32) / np.sqrt(h)).astype(jnp.bfloat16)
  return x, w




def _rel(got, want):
  got = np.asarray(got, np.float64)
  assert np.all(np.isfinite(got)), "non-finite output"
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("pattern", ["uniform", "empty_groups", "all_in_one", "odd"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tail", [0, 200])
def test_grouped_matmul_matches_oracle(pattern, out_dtype, tail):
  rng = np.random.default_rng(stable_seed(pattern, tail))
  G = 8
  sizes = _sizes(pattern, G, rng)
  M = sum(sizes) + tail
  x, w = _operands(rng, M, G)
  f = jax.jit(lambda a, b, s: jax_ep.grouped_matmul(a, b, s, out_dtype=out_dtype, backend="cuda"))
  out = f(x, w, jnp.asarray(sizes, jnp.int32))
  assert out.dtype == out_dtype
  err = _rel(out, oracle.grouped_matmul(x, w, sizes))
  assert err < (1e-2 if out_dtype == jnp.bfloat16 else 1e-5), err
  assert np.all(np.asarray(out[sum(sizes):]) == 0), "rows past the last group must be zeros"


def test_grouped_matmul_agrees_with_xla_ragged_dot():
  rng = np.random.default_rng(11)
  G = 16
  sizes = _sizes("odd", G, rng)
  x, w = _operands(rng, sum(sizes) + 64, G, h=512, f=256)
  s = jnp.asarray(sizes, jnp.int32)
  ours = jax.jit(lambda a, b, c: jax_ep.grouped_matmul(a, b, c, backend="cuda",
                                                       out_dtype=jnp.float32))(x, w, s)
  xla = jax.jit(lambda a, b, c: jax.lax.ragged_dot(a, b, c, preferred_element_type=jnp.float32))(
      x, w, s)
  assert _rel(ours, np.asarray(xla, np.float64)) < 1e-5


@pytest.mark.parametrize("pattern", ["empty_groups", "odd", "all_in_one"])
def test_grouped_matmul_gradients_match_oracle(pattern):
  rng = np.random.default_rng(stable_seed(pattern, "grads"))
  G = 6
  sizes = _sizes(pattern, G, rng)[:G]
  M = sum(sizes) + 40
  x, w = _operands(rng, M, G)
  dy = jnp.asarray(rng.standard_normal((M, F), np.float32)).astype(jnp.bfloat16)
  s = jnp.asarray(sizes, jnp.int32)

  @jax.jit
  def grads(a, b, d):
    _, vjp = jax.vjp(lambda p, q: jax_ep.grouped_matmul(p, q, s, backend="cuda"), a, b)
    return vjp(d)

  dx, dw = grads(x, w, dy)
  want_dx, want_dw = oracle.grouped_matmul_grads(x, w, sizes, dy)
  st = sum(sizes)
  assert _rel(dx, want_dx) < 1e-2
  assert np.all(np.asarray(dx[st:]) == 0)
  for g, n in enumerate(sizes):
    if n == 0:
      assert np.all(np.asarray(dw[g]) == 0), f"empty group {g} must have a zero gradient"
    else:
      assert _rel(dw[g], want_dw[g]) < 1e-2, g


def test_masked_grouped_matmul_reads_only_valid_rows():
  rng = np.random.default_rng(5)
  G, S = 8, 256
  counts = [0, 1, 8, 130, 256, 3, 0, 77]
  x = rng.standard_normal((G, S, H), np.float32)
  valid = np.arange(S)[None, :, None] < np.asarray(counts)[:, None, None]
  x = jnp.asarray(np.where(valid, x, np.nan)).astype(jnp.bfloat16)  # garbage past the counts
  w = jnp.asarray(rng.standard_normal((G, H, F), np.float32) / np.sqrt(H)).astype(jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((G, S, F), np.float32)).astype(jnp.bfloat16)
  c = jnp.asarray(counts, jnp.int32)

  @jax.jit
  def run(a, b, d):
    out, vjp = jax.vjp(lambda p, q: jax_ep.masked_grouped_matmul(p, q, c, backend="cuda"), a, b)
    return (out, *vjp(d))

  out, dx, dw = run(x, w, dy)
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  for g, n in enumerate(counts):
    if n == 0:
      assert np.all(np.asarray(dw[g]) == 0)
      continue
    assert _rel(out[g, :n], x64[g, :n] @ w64[g]) < 1e-2, g
    assert _rel(dx[g, :n], dy64[g, :n] @ w64[g].T) < 1e-2, g
    assert _rel(dw[g], x64[g, :n].T @ dy64[g, :n]) < 1e-2, g


def test_sm_limit_gives_the_same_result():
  rng = np.random.default_rng(9)
  sizes = _sizes("odd", 8, rng)
  x, w = _operands(rng, sum(sizes), 8)
  s = jnp.asarray(sizes, jnp.int32)
  full = jax.jit(lambda a, b: jax_ep.grouped_matmul(a, b, s, backend="cuda"))(x, w)
  few = jax.jit(lambda a, b: jax_ep.grouped_matmul(a, b, s, backend="cuda", num_sms=16))(x, w)
  np.testing.assert_array_equal(np.asarray(full, np.float32), np.asarray(few, np.float32))


def test_repeated_calls_in_one_program_are_stable():
  """Many products in one jitted program, each on fresh operands, against the
  oracle: scratch reuse between calls must not leak stale group arrays."""
  rng = np.random.default_rng(21)
  G = 8
  all_sizes = [_sizes(p, G, rng) for p in ("odd", "empty_groups", "uniform", "all_in_one")]
  M = max(sum(s) for s in all_sizes)
  xs, ws = zip(*[_operands(rng, M, G) for _ in all_sizes])

  @jax.jit
  def run(xs, ws, ss):
    return [jax_ep.grouped_matmul(a, b, s, backend="cuda") for a, b, s in zip(xs, ws, ss)]

  outs = run(list(xs), list(ws), [jnp.asarray(s, jnp.int32) for s in all_sizes])
  for o, a, b, s in zip(outs, xs, ws, all_sizes):
    assert _rel(o, oracle.grouped_matmul(a, b, s)) < 1e-2


def test_moe_layer_on_the_kernels_matches_the_reference_backend():
  """jax_ep.nn.MoE's forward + backward with the grouped kernels (backend
  None on GPU) against the same layer on the reference backend (ragged_dot),
  one GPU: loss and every gradient within bf16 tolerance."""
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_ep.nn import MoE

  mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("ep",))
  rng = np.random.default_rng(2)
  n, hidden, ffn, experts, topk = 512, 512, 256, 16, 4
  x = jax.device_put(jnp.asarray(rng.standard_normal((n, hidden)), jnp.float32),
                     NamedSharding(mesh, P("ep")))

  def loss_and_grads(backend):
    model = MoE(hidden, ffn, experts, topk, mesh=mesh, backend=backend, rngs=nnx.Rngs(0))

    @nnx.jit
    def f(model, x):
      return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)

    loss, grads = f(model, x)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    return float(loss), {jax.tree_util.keystr(p): np.asarray(v, np.float64) for p, v in leaves}

  loss_k, g_k = loss_and_grads(None)
  loss_r, g_r = loss_and_grads("reference")
  assert abs(loss_k - loss_r) <= 1e-2 * abs(loss_r), (loss_k, loss_r)
  assert g_k.keys() == g_r.keys()
  for k in g_r:
    assert _rel(g_k[k], g_r[k]) < 3e-2, k


def _fp8(rng, lead, G, h=512, f=256):
  x = jnp.asarray(rng.standard_normal((*lead, h), np.float32) * 2)
  w = jnp.asarray(rng.standard_normal((G, h, f), np.float32) / np.sqrt(h))
  return jax_ep.quantize(x), jax_ep.quantize_weights_fp8(w)


@pytest.mark.parametrize("pattern", ["uniform", "empty_groups", "all_in_one", "odd"])
def test_grouped_matmul_fp8_matches_dequantised_oracle(pattern):
  rng = np.random.default_rng(stable_seed("fp8", pattern))
  G = 8
  sizes = _sizes(pattern, G, rng)
  M = sum(sizes) + 100
  (xq, xs), (wq, ws) = _fp8(rng, (M,), G)
  out = jax.jit(lambda a, b, s: jax_ep.grouped_matmul_fp8(a, b, s, backend="cuda"))(
      (xq, xs), (wq, ws), jnp.asarray(sizes, jnp.int32))
  xd = np.asarray(jax_ep.dequantize(xq, xs, jnp.float32), np.float64)
  wd = np.asarray(jax_ep.dequantize_weights_fp8(wq, ws), np.float64)
  assert _rel(out, oracle.grouped_matmul(xd, wd, sizes)) < 1e-2
  assert np.all(np.asarray(out[sum(sizes):], np.float32) == 0)


@pytest.mark.parametrize("num_sms", [1, 3, 16])
def test_fp8_sm_limit_gives_the_same_result(num_sms):
  """An SM limit (one SM, an odd count, a few) still computes every tile of
  the FP8 forward, to the same bits: no split-K, so the grid only changes
  which SM runs a tile."""
  rng = np.random.default_rng(stable_seed("fp8_sms", num_sms))
  sizes = _sizes("odd", 8, rng)
  (xq, xs), (wq, ws) = _fp8(rng, (sum(sizes),), 8)
  s = jnp.asarray(sizes, jnp.int32)
  run = lambda n: jax.jit(lambda a, b: jax_ep.grouped_matmul_fp8(
      a, b, s, backend="cuda", num_sms=n))((xq, xs), (wq, ws))
  np.testing.assert_array_equal(np.asarray(run(0), np.float32),
                                np.asarray(run(num_sms), np.float32))


def test_masked_grouped_matmul_fp8_reads_only_valid_rows():
  rng = np.random.default_rng(17)
  G, S = 8, 256
  counts = [0, 1, 8, 130, 256, 3, 0, 77]
  (xq, xs), (wq, ws) = _fp8(rng, (G, S), G)
  valid = np.arange(S)[None, :, None] < np.asarray(counts)[:, None, None]
  xq = jnp.where(valid, xq, jnp.asarray(np.nan, jnp.float8_e4m3fn))  # garbage past the counts
  xs = jnp.where(valid[..., 0:1], xs, jnp.nan)
  out = jax.jit(lambda a, b, c: jax_ep.masked_grouped_matmul_fp8(a, b, c, backend="cuda"))(
      (xq, xs), (wq, ws), jnp.asarray(counts, jnp.int32))
  xd = np.asarray(jax_ep.dequantize(xq, xs, jnp.float32), np.float64)
  wd = np.asarray(jax_ep.dequantize_weights_fp8(wq, ws), np.float64)
  for g, n in enumerate(counts):
    if n:
      assert _rel(out[g, :n], xd[g, :n] @ wd[g]) < 1e-2, g


@pytest.mark.parametrize("pattern", ["uniform", "empty_groups", "all_in_one", "odd"])
def test_fp8_training_kernels_match_the_reference_and_the_oracle(pattern):
  """jax.vjp through grouped_matmul_fp8 from bf16 x and f32 master weights:
  forward, dgrad and wgrad on the kernels equal the reference backend (the
  same casts, dequantised products in f32) within bf16 output rounding, and
  the float64 oracle of the quantised operands; rows past the groups and
  empty groups' weight gradients are zeros."""
  rng = np.random.default_rng(stable_seed("fp8_train", pattern))
  G = 8
  sizes = _sizes(pattern, G, rng)
  M = sum(sizes) + 100
  h, f = 512, 256
  x = jnp.asarray(rng.standard_normal((M, h), np.float32) * 2).astype(jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((G, h, f), np.float32) / np.sqrt(h))
  dy = jnp.asarray(rng.standard_normal((M, f), np.float32)).astype(jnp.bfloat16)
  s = jnp.asarray(sizes, jnp.int32)

  def run(backend):
    out, pull = jax.vjp(jax.jit(lambda a, b: jax_ep.grouped_matmul_fp8(a, b, s, backend=backend)),
                        x, w)
    return (out, *pull(dy))

  got = [np.asarray(a, np.float64) for a in run("cuda")]
  ref = [np.asarray(a, np.float64) for a in run("reference")]
  xb, dyb = np.asarray(x, np.float32), np.asarray(dy, np.float32)
  wq = oracle.fp8_block_round_trip(np.asarray(w))
  want_out = oracle.grouped_matmul(oracle.fp8_round_trip(xb), wq, sizes)
  want_dx, _ = oracle.grouped_matmul_grads(xb, wq, sizes, oracle.fp8_round_trip(dyb))
  _, want_dw = oracle.grouped_matmul_grads(oracle.fp8_token_round_trip(xb, sizes), wq, sizes,
                                           oracle.fp8_token_round_trip(dyb, sizes))
  for name, g_, r_, o_ in zip(("out", "dx", "dw"), got, ref, (want_out, want_dx, want_dw)):
    assert _rel(g_, r_) < 1e-2, name
    assert _rel(g_, o_) < 1e-2, name
  n = sum(sizes)
  assert np.all(got[0][n:] == 0) and np.all(got[1][n:] == 0)
  for g, c in enumerate(sizes):
    if c == 0:
      assert np.all(got[2][g] == 0), g


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_weight_cast_kernel_is_bitwise_the_reference(dtype):
  """Both orientations and the block scales, a zero block, a NaN block."""
  rng = np.random.default_rng(stable_seed("cast_w", str(dtype)))
  w = rng.standard_normal((3, 384, 256)).astype(np.float32) * 0.05
  w[1, :128, 128:] = 0.0
  w[2, 200, 7] = np.nan
  w = jnp.asarray(w, dtype)
  got = jax.jit(lambda a: jax_ep.fp8_weights(a, backend="cuda"))(w)
  want = jax.jit(lambda a: jax_ep.fp8_weights(a, backend="reference"))(w)
  for name, a, b in zip(got._fields, got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype != jnp.float32
                                  else np.asarray(a), np.asarray(b).view(np.uint8)
                                  if b.dtype != jnp.float32 else np.asarray(b), err_msg=name)


@pytest.mark.parametrize("pattern", ["uniform", "empty_groups", "all_in_one", "odd"])
def test_fp8_token_cast_kernel_is_bitwise_the_reference(pattern):
  from jax_ep.ops.grouped_gemm import quantize_token_major
  rng = np.random.default_rng(stable_seed("cast_t", pattern))
  G = 8
  sizes = _sizes(pattern, G, rng)
  M = sum(sizes) + 50
  x = jnp.asarray(rng.standard_normal((M, 256)).astype(np.float32) * 3, jnp.bfloat16)
  s = jnp.asarray(sizes, jnp.int32)
  got = jax.jit(lambda a, b: quantize_token_major(a, b, backend="cuda"))(x, s)
  want = jax.jit(lambda a, b: quantize_token_major(a, b, backend="reference"))(x, s)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                np.asarray(want[0]).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
