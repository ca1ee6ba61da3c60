"""Which step after linear 1 of the FP8 path does XLA:GPU compute differently
from XLA:CPU? On a GPU the reference backend's mega_moe sits 0.20-0.24 of
the FP8 casts' effect from the float64 oracle, against 0.04 on the CPU, while
its linear 1 equals the rounded exact product. This runs the steps that
follow (SwiGLU to bf16, the 1 x 128 e4m3 cast of h, combine's weighted
fixed-order f32 sum) as the package writes them, jitted once on the default
device and once on the CPU, on the same bf16 inputs, and counts the outputs
that differ, next to float64 NumPy. Needs no jax_ep build.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

from jax_ep import fp8  # noqa: E402
from jax_ep.ops.mega_moe import swiglu  # noqa: E402
from jax_ep.reference import _ordered_sum, _weighted  # noqa: E402

M, F, H, K = 4096, 2048, 7168, 8
rng = np.random.default_rng(7)
# GEMM 1 outputs of the tests' scale: a few units, both signs.
h13 = (rng.standard_normal((M, 2 * F)) * 2.0).astype(ml_dtypes.bfloat16)
y = (rng.standard_normal((M // K, K, H)) * 0.5).astype(ml_dtypes.bfloat16)
w = rng.uniform(0.05, 1.0, (M // K, K)).astype(np.float32)

cpu = jax.devices("cpu")[0]
dev = jax.devices()[0]


def combine_sum(y, w):
  p = _weighted(y, w)
  mask = jnp.ones((y.shape[0], 1), bool)
  return _ordered_sum([(mask, p[:, k]) for k in range(y.shape[1])], (y.shape[0], y.shape[2]),
                      jnp.bfloat16)


steps = {
    "swiglu -> bf16": (lambda a: swiglu(a, jnp.bfloat16), (h13,)),
    "h -> e4m3 (1 x 128)": (lambda a: fp8.quantize(swiglu(a, jnp.bfloat16))[0], (h13,)),
    "h scales": (lambda a: fp8.quantize(swiglu(a, jnp.bfloat16))[1], (h13,)),
    "combine sum -> bf16": (combine_sum, (y, w)),
}
print(f"default device: {dev.device_kind} ({dev.platform})")
outs = {}
for name, (f, args) in steps.items():
  for d in (dev, cpu):
    got = jax.jit(f)(*[jax.device_put(a, d) for a in args])
    outs[name, d.platform] = np.asarray(got).astype(np.float64)
  a, b = outs[name, dev.platform], outs[name, "cpu"]
  diff = a != b
  rel = np.abs(a - b)[diff] / np.maximum(np.abs(b[diff]), 1e-30) if diff.any() else np.zeros(1)
  print(f"{name:<22} {dev.platform} vs cpu: {diff.mean():.2e} of {a.size} differ, "
        f"max rel {rel.max():.2e}, median rel of those {np.median(rel):.2e}", flush=True)

# SwiGLU against float64 NumPy, each backend: how often its bf16 is not the
# correctly rounded value.
g, u = h13[:, :F].astype(np.float64), h13[:, F:].astype(np.float64)
want = (g / (1.0 + np.exp(-g)) * u).astype(ml_dtypes.bfloat16).astype(np.float64)
for d in (dev, cpu):
  print(f"swiglu on {d.platform}: {np.mean(outs['swiglu -> bf16', d.platform] != want):.2e} "
        "of the bf16 outputs are not float64's rounded", flush=True)
