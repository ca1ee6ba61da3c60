"""Grouped GEMM on CPU: the reference path (lax.ragged_dot / masked einsum)
against a float64 NumPy oracle over group-size patterns, with gradients;
argument checks; and the CUDA lowering (jax.export for the cuda platform
holds the jax_ep_grouped_gemm custom calls, forward and backward)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import oracle
from jax_ep import _native
from oracle import stable_seed

# (name, G, M, sizes) - sizes sum to <= M; rows past the sum are padding.
PATTERNS = [
    ("uniform", 4, 64, [16, 16, 16, 16]),
    ("empty_groups", 5, 48, [0, 20, 0, 28, 0]),
    ("all_in_one", 4, 40, [0, 0, 40, 0]),
    ("odd_sizes", 3, 64, [7, 33, 13]),
    ("padding_tail", 3, 80, [10, 5, 9]),
    ("all_empty", 3, 16, [0, 0, 0]),
]




def _inputs(seed, G, M, H=32, F=24, dtype=jnp.bfloat16):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (M, H), jnp.float32).astype(dtype)
  w = (jax.random.normal(k2, (G, H, F), jnp.float32) / np.sqrt(H)).astype(dtype)
  return x, w


def _close(got, want, rtol):
  got = np.asarray(got, np.float64)
  err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
  assert np.all(np.isfinite(got))
  assert err < rtol, f"relative error {err:.2e} >= {rtol}"


@pytest.mark.parametrize("name,G,M,sizes", PATTERNS, ids=[p[0] for p in PATTERNS])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_grouped_matmul_matches_oracle(name, G, M, sizes, out_dtype):
  x, w = _inputs(stable_seed(name), G, M)
  out = jax.jit(lambda a, b, s: jax_ep.grouped_matmul(a, b, s, out_dtype=out_dtype))(
      x, w, jnp.asarray(sizes, jnp.int32))
  assert out.shape == (M, w.shape[2]) and out.dtype == out_dtype
  want = oracle.grouped_matmul(x, w, sizes)
  _close(out, want, 1e-2 if out_dtype == jnp.bfloat16 else 1e-5)
  tail = sum(sizes)
  assert np.all(np.asarray(out)[tail:] == 0), "rows past the last group must be zeros"


@pytest.mark.parametrize("name,G,M,sizes", PATTERNS[:5], ids=[p[0] for p in PATTERNS[:5]])
def test_grouped_matmul_gradients_match_oracle(name, G, M, sizes):
  x, w = _inputs(7 + len(name), G, M)
  dy = jax.random.normal(jax.random.key(3), (M, w.shape[2]), jnp.float32).astype(jnp.bfloat16)
  s = jnp.asarray(sizes, jnp.int32)
  _, vjp = jax.vjp(lambda a, b: jax_ep.grouped_matmul(a, b, s), x, w)
  dx, dw = vjp(dy)
  want_dx, want_dw = oracle.grouped_matmul_grads(x, w, sizes, dy)
  _close(dx, want_dx, 1e-2)
  _close(dw, want_dw, 1e-2)


@pytest.mark.parametrize("counts", [[3, 0, 8, 5], [8, 8, 8, 8], [0, 0, 0, 1]])
def test_masked_grouped_matmul_matches_oracle(counts):
  G, S, H, F = 4, 8, 32, 16
  k1, k2 = jax.random.split(jax.random.key(sum(counts)))
  x = jax.random.normal(k1, (G, S, H), jnp.float32).astype(jnp.bfloat16)
  # Rows past the counts are unspecified: fill them with NaN, which must
  # not reach the valid rows.
  rows = np.arange(S)[None, :, None] < np.asarray(counts)[:, None, None]
  x = jnp.where(rows, x, jnp.nan).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (G, H, F), jnp.float32) / np.sqrt(H)).astype(jnp.bfloat16)
  out = jax.jit(jax_ep.masked_grouped_matmul)(x, w, jnp.asarray(counts, jnp.int32))
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  for g, n in enumerate(counts):
    got = np.asarray(out[g, :n], np.float64)
    want = x64[g, :n] @ w64[g]
    if n:
      _close(got, want, 1e-2)
  # Gradient: only valid rows count; NaN padding must not leak into dw.
  dy = jax.random.normal(jax.random.key(5), (G, S, F), jnp.float32).astype(jnp.bfloat16)
  c = jnp.asarray(counts, jnp.int32)
  _, vjp = jax.vjp(lambda a, b: jax_ep.masked_grouped_matmul(a, b, c), x, w)
  dx, dw = vjp(dy)
  dy64 = np.asarray(dy, np.float64)
  for g, n in enumerate(counts):
    want_dw = x64[g, :n].T @ dy64[g, :n]
    if n:
      _close(dw[g], want_dw, 1e-2)
      _close(dx[g, :n], dy64[g, :n] @ w64[g].T, 1e-2)
    else:
      assert np.all(np.asarray(dw[g]) == 0)


def test_grouped_matmul_bad_arguments_name_them():
  x, w = _inputs(0, 2, 8)
  s = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="x must be"):
    jax_ep.grouped_matmul(x[None], w, s)
  with pytest.raises(ValueError, match="w's H"):
    jax_ep.grouped_matmul(x[:, :16], w, s)
  with pytest.raises(ValueError, match="group_sizes must be"):
    jax_ep.grouped_matmul(x, w, jnp.asarray([4, 4, 0], jnp.int32))
  with pytest.raises(ValueError, match="integer"):
    jax_ep.grouped_matmul(x, w, jnp.asarray([4.0, 4.0]))
  with pytest.raises(ValueError, match="backend"):
    jax_ep.grouped_matmul(x, w, s, backend="tpu")
  with pytest.raises(ValueError, match="groups"):
    jax_ep.masked_grouped_matmul(jnp.zeros((3, 4, 32), jnp.bfloat16), w, s)


@pytest.mark.skipif(not _native.cuda_built(), reason="the CUDA wrappers need jax_ep built with CUDA")
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_lowering_holds_three_grouped_gemm_calls(masked):
  """Forward + backward lowered for CUDA: one forward call, and dx and dw as
  two more grouped GEMM calls (no ragged_dot anywhere)."""
  G, H, F = 4, 64, 32
  xs = (G, 16, H) if masked else (64, H)
  op = jax_ep.masked_grouped_matmul if masked else jax_ep.grouped_matmul

  def loss(x, w, s):
    return jnp.sum(op(x, w, s).astype(jnp.float32) ** 2)

  args = (jax.ShapeDtypeStruct(xs, jnp.bfloat16), jax.ShapeDtypeStruct((G, H, F), jnp.bfloat16),
          jax.ShapeDtypeStruct((G,), jnp.int32))
  checks = [jax.export.DisabledSafetyCheck.custom_call("jax_ep_grouped_gemm")]
  exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"],
                          disabled_checks=checks)(*args)
  text = exp.mlir_module()
  assert text.count("custom_call @jax_ep_grouped_gemm") == 3, text.count("@jax_ep_grouped_gemm")
  assert "ragged_dot" not in text


# --- FP8 ----------------------------------------------------------------------


def _fp8_operands(seed, G, M, H=256, F=128, masked_s=None):
  k1, k2 = jax.random.split(jax.random.key(seed))
  shape = (G, masked_s, H) if masked_s else (M, H)
  x = jax.random.normal(k1, shape, jnp.float32) * 3.0
  w = jax.random.normal(k2, (G, H, F), jnp.float32) / np.sqrt(H)
  return jax_ep.quantize(x), jax_ep.quantize_weights_fp8(w), w


def test_weight_quantisation_round_trips_within_e4m3_precision():
  _, (wq, ws), w = _fp8_operands(0, 3, 8)
  assert wq.shape == (3, 128, 256) and wq.dtype == jnp.float8_e4m3fn
  assert ws.shape == (3, 2, 1)
  back = np.asarray(jax_ep.dequantize_weights_fp8(wq, ws))
  err = np.abs(back - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
  assert 0 < err < 2 ** -4, err  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("name,G,M,sizes", PATTERNS[:5], ids=[p[0] for p in PATTERNS[:5]])
def test_grouped_matmul_fp8_matches_dequantised_oracle(name, G, M, sizes):
  (xq, xs), (wq, ws), _ = _fp8_operands(len(name), G, M)
  out = jax.jit(jax_ep.grouped_matmul_fp8)((xq, xs), (wq, ws), jnp.asarray(sizes, jnp.int32))
  assert out.shape == (M, 128) and out.dtype == jnp.bfloat16
  xd = np.asarray(jax_ep.dequantize(xq, xs, jnp.float32), np.float64)
  wd = np.asarray(jax_ep.dequantize_weights_fp8(wq, ws), np.float64)
  want = oracle.grouped_matmul(xd, wd, sizes)
  if sum(sizes):
    _close(out, want, 1e-2)
  assert np.all(np.asarray(out)[sum(sizes):] == 0)


def test_fp8_bad_arguments_name_them():
  (xq, xs), (wq, ws), _ = _fp8_operands(1, 2, 8)
  s = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="pairs"):
    jax_ep.grouped_matmul_fp8(xq, (wq, ws), s)
  with pytest.raises(ValueError, match="x scales"):
    jax_ep.grouped_matmul_fp8((xq, xs[:, :1]), (wq, ws), s)
  with pytest.raises(ValueError, match="w scales"):
    jax_ep.grouped_matmul_fp8((xq, xs), (wq, ws[:, :1]), s)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    jax_ep.grouped_matmul_fp8((xq.astype(jnp.bfloat16), xs), (wq, ws), s)


@pytest.mark.skipif(not _native.cuda_built(), reason="the CUDA wrappers need jax_ep built with CUDA")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("backend", ["cuda", None])
def test_cuda_lowering_of_fp8_holds_the_fp8_call(masked, backend):
  """backend=None picks the kernel on CUDA too (validated on a GPU)."""
  G, H, F = 4, 256, 128
  lead = (G, 16) if masked else (64,)
  op = jax_ep.masked_grouped_matmul_fp8 if masked else jax_ep.grouped_matmul_fp8
  args = ((jax.ShapeDtypeStruct((*lead, H), jnp.float8_e4m3fn),
           jax.ShapeDtypeStruct((*lead, H // 128), jnp.float32)),
          (jax.ShapeDtypeStruct((G, F, H), jnp.float8_e4m3fn),
           jax.ShapeDtypeStruct((G, H // 128, F // 128), jnp.float32)),
          jax.ShapeDtypeStruct((G,), jnp.int32))
  checks = [jax.export.DisabledSafetyCheck.custom_call("jax_ep_grouped_gemm_fp8")]
  f = jax.jit(lambda x, w, s: op(x, w, s, backend=backend))
  text = jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
  assert text.count("custom_call @jax_ep_grouped_gemm_fp8") == 1


# --- FP8 training: forward, dgrad and wgrad through custom_vjp ---------------

FP8_TRAIN_PATTERNS = [
    ("uniform", 4, 512, [128, 128, 128, 128]),
    ("empty_groups", 5, 400, [0, 200, 0, 131, 0]),
    ("all_in_one", 3, 300, [0, 300, 0]),
    ("odd_sizes", 3, 384, [7, 255, 121]),
    ("padding_tail", 3, 320, [100, 5, 90]),
]


def _fp8_train_inputs(seed, G, M, H=256, F=256):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((M, H)) * 2.0).astype(np.float32)
  w = (rng.standard_normal((G, H, F)) / np.sqrt(H)).astype(np.float32)
  dy = rng.standard_normal((M, F)).astype(np.float32)
  return x, w, dy


def _fp8_train_run(x, w, sizes, dy, backend="reference"):
  def f(x, w):
    return jax_ep.grouped_matmul_fp8(x, w, jnp.asarray(sizes, jnp.int32), backend=backend)
  out, pull = jax.vjp(jax.jit(f), jnp.asarray(x, jnp.bfloat16), jnp.asarray(w))
  dx, dw = pull(jnp.asarray(dy, jnp.bfloat16))
  return (np.asarray(out, np.float64), np.asarray(dx, np.float64), np.asarray(dw, np.float64))


@pytest.mark.parametrize("name,G,M,sizes", FP8_TRAIN_PATTERNS,
                         ids=[p[0] for p in FP8_TRAIN_PATTERNS])
def test_fp8_training_matches_the_quantised_float64_oracle(name, G, M, sizes):
  """Forward, dx and dw of the FP8 path equal float64 products of the
  operands cast exactly as the contract says (x per row x 128 channels, w per
  128 x 128 block, dy per row x 128 of F for dx, x and dy per channel x 128
  tokens of one group for dw), up to bf16 output rounding; and they sit
  within e4m3's error of the unquantised product, which a wrong scale breaks."""
  x, w, dy = _fp8_train_inputs(stable_seed("fp8_train", name), G, M)
  xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
  dyb = np.asarray(jnp.asarray(dy, jnp.bfloat16), np.float32)
  out, dx, dw = _fp8_train_run(x, w, sizes, dy)
  n = sum(sizes)
  wq = oracle.fp8_block_round_trip(w)
  want_out = oracle.grouped_matmul(oracle.fp8_round_trip(xb), wq, sizes)
  want_dx, _ = oracle.grouped_matmul_grads(xb, wq, sizes,
                                           oracle.fp8_round_trip(dyb))
  _, want_dw = oracle.grouped_matmul_grads(oracle.fp8_token_round_trip(xb, sizes), w, sizes,
                                           oracle.fp8_token_round_trip(dyb, sizes))
  for got, want in ((out, want_out), (dx, want_dx), (dw, want_dw)):
    _close(got, want, 1e-2)
  exact_out = oracle.grouped_matmul(xb, w, sizes)
  exact_dx, exact_dw = oracle.grouped_matmul_grads(xb, w, sizes, dyb)
  for got, exact in ((out, exact_out), (dx, exact_dx), (dw, exact_dw)):
    # e4m3 keeps 3 mantissa bits: each operand within 2^-4 relative, so a
    # product's norm-wise error stays near 2^-4 (random signs); 0.06 leaves
    # room, a scale off by 2 on one block of two does not fit.
    _close(got, exact, 0.06)
  assert np.all(out[n:] == 0) and np.all(dx[n:] == 0)
  for g, s in enumerate(sizes):
    if s == 0:
      assert np.all(dw[g] == 0)


def test_fp8_training_accepts_a_cached_weight_copy_and_f32_masters():
  x, w, dy = _fp8_train_inputs(3, 3, 256)
  sizes = jnp.asarray([100, 0, 150], jnp.int32)
  cached = jax_ep.fp8_weights(jnp.asarray(w))
  f = lambda x, w, c: jax_ep.grouped_matmul_fp8(x, w, sizes, w_fp8=c, backend="reference")
  g = lambda x, w: jax_ep.grouped_matmul_fp8(x, w, sizes, backend="reference")
  xb = jnp.asarray(x, jnp.bfloat16)
  a, pa = jax.vjp(lambda x, w: f(x, w, cached), xb, jnp.asarray(w))
  b, pb = jax.vjp(g, xb, jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for u, v in zip(pa(jnp.asarray(dy, jnp.bfloat16)), pb(jnp.asarray(dy, jnp.bfloat16))):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
  assert pa(jnp.asarray(dy, jnp.bfloat16))[1].dtype == jnp.float32


def test_fp8_training_propagates_nan_and_handles_zero_blocks():
  x, w, _ = _fp8_train_inputs(4, 2, 256)
  x[:128] = 0.0   # an all-zero block gets the floor scale, not a NaN
  x[200, 5] = np.nan
  sizes = jnp.asarray([128, 128], jnp.int32)
  out = np.asarray(jax_ep.grouped_matmul_fp8(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), sizes,
                                             backend="reference"), np.float32)
  assert np.all(out[:128] == 0)
  assert np.all(np.isnan(out[200]))
  assert np.all(np.isfinite(np.delete(out[128:], 200 - 128, axis=0)))


def test_fp8_training_bad_arguments_name_them():
  x = jnp.zeros((64, 256), jnp.bfloat16)
  s = jnp.asarray([32, 32], jnp.int32)
  with pytest.raises(ValueError, match="multiples of 128"):
    jax_ep.grouped_matmul_fp8(x[:, :200], jnp.zeros((2, 200, 128)), s)
  with pytest.raises(ValueError, match="x must be bf16 or f32"):
    jax_ep.grouped_matmul_fp8(x.astype(jnp.float16), jnp.zeros((2, 256, 128)), s)
  with pytest.raises(ValueError, match="w_fp8"):
    jax_ep.grouped_matmul_fp8(x, jnp.zeros((2, 256, 128)), s, w_fp8=(1, 2))
  with pytest.raises(ValueError, match="w_fp8"):
    jax_ep.grouped_matmul_fp8(x, jnp.zeros((2, 256, 128)), s,
                              w_fp8=jax_ep.fp8_weights(jnp.zeros((2, 256, 256))))


def test_token_major_cast_pads_each_group_to_whole_chunks():
  rng = np.random.default_rng(5)
  x = rng.standard_normal((300, 128)).astype(np.float32)
  sizes = [7, 0, 200, 50]
  q, s, psizes = jax_ep.ops.grouped_gemm.quantize_token_major(jnp.asarray(x),
                                                             jnp.asarray(sizes, jnp.int32))
  assert q.shape == (128, jax_ep.ops.grouped_gemm.padded_token_count(300, 4))
  np.testing.assert_array_equal(np.asarray(psizes), [128, 0, 256, 128])
  v = np.asarray(q, np.float64).T.reshape(-1, 128, 128) * np.asarray(s, np.float64)[:, None, :]
  v = v.reshape(-1, 128)
  want = oracle.fp8_token_round_trip(x, sizes)
  np.testing.assert_array_equal(v[0:7], want[0:7])
  assert np.all(v[7:128] == 0)
  np.testing.assert_array_equal(v[128:328], want[7:207])
  np.testing.assert_array_equal(v[384:434], want[207:257])
  assert np.all(v[434:] == 0)


def test_cuda_lowering_of_fp8_training_holds_forward_dgrad_and_wgrad():
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32)
  s = jax.ShapeDtypeStruct((4,), jnp.int32)

  def loss(x, w, s):
    return jnp.sum(jax_ep.grouped_matmul_fp8(x, w, s, backend="cuda").astype(jnp.float32) ** 2)

  if not _native.cuda_built():
    pytest.skip("backend='cuda' needs the CUDA build to trace")
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _native.TARGETS]
  exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"],
                          disabled_checks=checks)(x, w, s)
  assert exp.mlir_module().count("custom_call @jax_ep_grouped_gemm_fp8") == 3


def test_fp8_training_from_fp8_rows_uses_them_and_sends_the_gradient_to_x():
  """x_fp8: the forward reads the FP8 rows (not x's values), dx goes to x,
  dw is cast from the rows' values; equal to the path from the rows'
  dequantised values."""
  x, w, dy = _fp8_train_inputs(9, 3, 384)
  sizes = jnp.asarray([128, 0, 256], jnp.int32)
  rows = jax_ep.quantize(jnp.asarray(x))
  xd = jax_ep.dequantize(*rows, jnp.float32).astype(jnp.bfloat16)
  junk = jnp.full(x.shape, 7.0, jnp.bfloat16)  # never read
  f = lambda a, b: jax_ep.grouped_matmul_fp8(a, b, sizes, x_fp8=rows, backend="reference")
  out, pull = jax.vjp(f, junk, jnp.asarray(w))
  dx, dw = pull(jnp.asarray(dy, jnp.bfloat16))
  want = oracle.grouped_matmul(oracle.fp8_round_trip(np.asarray(xd, np.float32)),
                               oracle.fp8_block_round_trip(w), [128, 0, 256])
  _close(np.asarray(out, np.float64), want, 1e-2)
  out2, pull2 = jax.vjp(lambda a, b: jax_ep.grouped_matmul_fp8(a, b, sizes, backend="reference"),
                        xd, jnp.asarray(w))
  # x's bf16 copy of the rows re-casts to nearly, not exactly, the rows.
  _close(np.asarray(out, np.float64), np.asarray(out2, np.float64), 1e-2)
  dx2, dw2 = pull2(jnp.asarray(dy, jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx2))
  # Both weight gradients cast along the tokens, from values one bf16
  # rounding apart: e4m3 steps can land on either side.
  _close(np.asarray(dw, np.float64), np.asarray(dw2, np.float64), 3e-2)
