"""Per-token, per-128-channel FP8 (e4m3) quantisation.

The CUDA kernels implement exactly these float32 steps, so the in-kernel cast
is bitwise equal to this one. The scale is applied as a multiplication by its
IEEE reciprocal (inv = 1 / s; q = x * inv): XLA rewrites a division by a
broadcast value into exactly that, on every backend, so that is the form that
can be matched bit for bit. The reciprocal and the e4m3 rounding are computed
explicitly (reciprocal_rn, to_e4m3), because XLA:GPU's own division and
convert do not round correctly in every case.
"""
from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

BLOCK = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
INV_E4M3_MAX = np.float32(1.0) / np.float32(E4M3_MAX)  # float32(1/448)
FP8_DTYPE = jnp.float8_e4m3fn


def ue8m0_round_up(s: jax.Array) -> jax.Array:
  """Smallest power of two >= s (s > 0, finite), from the float32 bits."""
  bits = lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
  exp = bits & jnp.uint32(0x7F800000)
  has_mantissa = (bits & jnp.uint32(0x007FFFFF)) != 0
  exp = jnp.where(has_mantissa, exp + jnp.uint32(0x00800000), exp)
  return lax.bitcast_convert_type(exp, jnp.float32)


def quantize(x: jax.Array, *, ue8m0: bool = False) -> tuple[jax.Array, jax.Array]:
  """x [..., H] -> (q [..., H] e4m3, scales [..., H // 128] f32); x ≈ q * scale."""
  *lead, h = x.shape
  if h % BLOCK:
    raise ValueError(f"hidden size {h} must be a multiple of {BLOCK} for FP8")
  xb = x.astype(jnp.float32).reshape(*lead, h // BLOCK, BLOCK)
  s = scale_of(jnp.max(jnp.abs(xb), axis=-1), ue8m0=ue8m0)
  return cast(xb, s, -1).reshape(*lead, h), s


def scale_of(amax: jax.Array, *, ue8m0: bool = False) -> jax.Array:
  """The scale of a block whose largest magnitude is amax (f32)."""
  # x / 448 would become x * (1/448) inside XLA anyway; say so explicitly.
  s = jnp.maximum(amax, jnp.float32(AMAX_FLOOR)) * INV_E4M3_MAX
  return ue8m0_round_up(s) if ue8m0 else s


def cast(xb: jax.Array, s: jax.Array, axis) -> jax.Array:
  """xb (f32) in e4m3 with the scales s, which lack xb's block axes `axis`
  (an int or a tuple): q = e4m3(clip(x * (1/s), +-448))."""
  inv = jnp.expand_dims(reciprocal_rn(s), axis)
  return to_e4m3(jnp.clip(xb * inv, -E4M3_MAX, E4M3_MAX))


def reciprocal_rn(s: jax.Array) -> jax.Array:
  """1 / s for float32 s > 0, correctly rounded (IEEE), the same bits on every
  backend.

  XLA:GPU's float32 division is not correctly rounded: on H200 15% of the
  reciprocals of the low-latency test's scales were one ulp off numpy's (and
  the kernels' __fdiv_rn), which flipped an e4m3 byte (scripts/diag_fp8_xla.py).
  So the mantissa comes from an integer long division, exact anywhere:
  s = m * 2**(E - 150) with m in [2**23, 2**24), 1/s = (2**47 / m) * 2**(103 - E),
  and 2**47 / m is rounded to 24 bits from its quotient bits and remainder.
  Non-finite or subnormal s (no finite bf16/f32 input gives one) take XLA's
  division.
  """
  s = s.astype(jnp.float32)
  bits = lax.bitcast_convert_type(s, jnp.uint32)
  biased = (bits >> 23) & jnp.uint32(0xFF)
  m = (bits & jnp.uint32(0x7FFFFF)) | jnp.uint32(0x800000)
  # Restoring division of 2**47 by m: 25 quotient bits (24 + a rounding bit).
  rem = jnp.full_like(m, 1 << 23)
  q = jnp.zeros_like(m)
  for _ in range(25):
    rem = rem << 1
    bit = rem >= m
    rem = jnp.where(bit, rem - m, rem)
    q = (q << 1) | bit.astype(jnp.uint32)
  # q is in [2**24, 2**25): drop the rounding bit, round to nearest even.
  round_bit, sticky = q & 1, rem != 0
  q = q >> 1
  q = q + ((round_bit == 1) & (sticky | ((q & 1) == 1))).astype(jnp.uint32)
  carry = q >> 24  # rounded up to 2**24
  exp = jnp.uint32(253) + carry - biased
  r = lax.bitcast_convert_type((exp << 23) | ((q >> carry) & jnp.uint32(0x7FFFFF)), jnp.float32)
  # A power of two (m == 2**23) breaks the division's rem < m start; its
  # reciprocal is exact: 2**(127 - e).
  pow2 = lax.bitcast_convert_type((jnp.uint32(254) - biased) << 23, jnp.float32)
  r = jnp.where((bits & jnp.uint32(0x7FFFFF)) == 0, pow2, r)
  usable = (biased >= 1) & (biased <= 252)
  return jnp.where(usable, r, jnp.float32(1.0) / s)


def to_e4m3(v: jax.Array) -> jax.Array:
  """float32 in [-448, 448] -> e4m3, rounded to nearest even, the same bits
  on every backend.

  XLA's own f32 -> e4m3 convert does not round every tie to even on GPU (a
  subnormal tie, 3.5 * 2**-9, became 3 * 2**-9 there and 4 * 2**-9 on CPU and
  in the kernels' cvt.rn), so the reference rounds explicitly: scaling by the
  e4m3 quantum of v's binade (a power of two) is exact, as is jnp.round's
  half-to-even, so the value handed to the convert is already an e4m3 number
  and the convert has nothing left to round.
  """
  v = v.astype(jnp.float32)
  biased = (lax.bitcast_convert_type(v, jnp.uint32) >> 23) & jnp.uint32(0xFF)
  # Quantum 2**qe: 2**(e - 3) for normals (e >= -6), 2**-9 for subnormals.
  qe = jnp.maximum(biased.astype(jnp.int32) - 127, -6) - 3
  scale_down = lax.bitcast_convert_type(((127 - qe) << 23).astype(jnp.uint32), jnp.float32)
  scale_up = lax.bitcast_convert_type(((127 + qe) << 23).astype(jnp.uint32), jnp.float32)
  return (jnp.round(v * scale_down) * scale_up).astype(FP8_DTYPE)


def dequantize(q: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """Inverse of `quantize` (up to FP8 rounding)."""
  *lead, h = q.shape
  xb = q.astype(jnp.float32).reshape(*lead, h // BLOCK, BLOCK) * scales[..., None]
  return xb.reshape(*lead, h).astype(dtype)
