"""Which float32 step of the reference FP8 quantiser does XLA:GPU compute
differently from IEEE (numpy)? Counts, over the low-latency test's x, the
elements whose reciprocal, product or e4m3 byte differ, for formulations that
fence XLA's rewrites with optimization_barrier. Needs no jax_ep build."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from jax import lax  # noqa: E402

from jax_ep import fp8  # noqa: E402

T, H, K, E, mt = 128, 7168, 8, 256, 128
rng = np.random.default_rng(T + H + K + E + mt + 1)
for _ in range(2):  # the test draws both ranks' top-k first
  if T:
    np.argsort(rng.random((T, E)), axis=1)
    rng.random((T, K))
rng.uniform(0.25, 1.5, size=(2, T, K))
x = (rng.standard_normal((2 * T, H)) * 3).astype(jnp.bfloat16)

xb = x.astype(np.float32).reshape(2 * T, H // 128, 128)
s = np.maximum(np.abs(xb).max(-1), np.float32(1e-4)) * fp8.INV_E4M3_MAX
inv = (np.float32(1.0) / s).astype(np.float32)
v = np.clip(xb * inv[..., None], -448, 448).astype(np.float32)
q = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def variant(barrier_inv, barrier_v):
  def f(x):
    xb = x.astype(jnp.float32).reshape(2 * T, H // 128, 128)
    s = jnp.maximum(jnp.max(jnp.abs(xb), -1), jnp.float32(1e-4)) * fp8.INV_E4M3_MAX
    inv = jnp.float32(1.0) / s
    if barrier_inv:
      inv = lax.optimization_barrier(inv)
    v = jnp.clip(xb * inv[..., None], -448, 448)
    if barrier_v:
      v = lax.optimization_barrier(v)
    return fp8.to_e4m3(v), inv, v
  return f


dev = jax.devices()[0]
xd = jax.device_put(x, dev)
gq, _ = jax.jit(fp8.quantize)(xd.reshape(2 * T, H))
print(dev.platform, "fp8.quantize: bytes off", int((np.asarray(gq).view(np.uint8).reshape(q.shape) != q).sum()))
for bi in (False, True):
  for bv in (False, True):
    gq, ginv, gv = (np.asarray(a) for a in jax.jit(variant(bi, bv))(xd))
    print(f"barrier inv={bi} v={bv}: inv off {int((ginv.view(np.uint32) != inv.view(np.uint32)).sum())}"
          f"/{inv.size}, v off {int((gv.view(np.uint32) != v.view(np.uint32)).sum())}, "
          f"bytes off {int((gq.view(np.uint8) != q).sum())}", flush=True)
