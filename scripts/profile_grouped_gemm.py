"""One grouped GEMM forward at the issue-17 shape (uniform 256-row groups),
for a profiler: `ncu --clock-control none -k regex:device_kernel -c 1
--section SpeedOfLight python3 scripts/profile_grouped_gemm.py`
(docs/grouped_gemm.md has what it showed)."""
import jax
import jax.numpy as jnp

import jax_ep

G, M, H, F = 128, 32768, 7168, 2048
x = jax.random.normal(jax.random.key(0), (M, H), jnp.float32).astype(jnp.bfloat16)
w = (jax.random.normal(jax.random.key(1), (G, H, F), jnp.float32) / 84).astype(jnp.bfloat16)
s = jnp.full((G,), M // G, jnp.int32)
f = jax.jit(lambda a, b: jax_ep.grouped_matmul(a, b, s, backend="cuda"))
jax.block_until_ready(f(x, w))
