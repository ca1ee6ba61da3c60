"""Diagnoses test_gpu_low_latency's FP8 mismatch (docs/design.md §6 shape, fused): runs
the low-latency dispatch on the kernels (backend="cuda") and the reference on 2 GPUs,
and for each byte that differs recomputes the quantisation in numpy (IEEE
float32 steps, ml_dtypes rounding) to say which side follows jax_ep/fp8.py."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import gpu_helpers as h  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep.comm import Communicator  # noqa: E402

T, H, K, E, mt = 128, 7168, 8, 256, 128
devs = jax.devices("cuda")[:2]
mesh = jax.sharding.Mesh(np.array(devs), (h.AXIS,))
R = 2
rng = np.random.default_rng(T + H + K + E + mt + 1)
idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
_ = rng.uniform(0.25, 1.5, size=(R, T, K))
x = (rng.standard_normal((R, T, H)) * 3).astype(jnp.bfloat16)
with Communicator.create(mesh, h.AXIS, 1 << 30):
  def per_rank(x, i):
    return [jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, fp8=True, backend=b)
            for b in ("cuda", "reference")]
  got, want = jax.block_until_ready(h.per_rank_jit(mesh, per_rank)(h.put(mesh, x), h.put(mesh, idx)))
  # Also the plain quantiser on GPU and on CPU, for the same tokens.
  qg = jax.block_until_ready(jax.jit(jax_ep.quantize)(jax.device_put(x.reshape(-1, H), devs[0])))
gq, gs = (np.asarray(a) for a in got.recv_x)
wq, ws = (np.asarray(a) for a in want.recv_x)
entry = np.asarray(want.handle.src_entry)
gb, wb = gq.view(np.uint8), wq.view(np.uint8)
# The kernels leave rows at or past recv_count unwritten (docs/design.md §2):
# compare the valid rows only.
counts = np.asarray(want.recv_count)                                # [R, E_l]
valid = np.arange(gq.shape[2])[None, None, :] < counts[:, :, None]  # [R, E_l, R*mt]
bad = np.argwhere((gb != wb) & valid[..., None])
print("mismatched bytes:", len(bad), "scales equal:",
      np.array_equal(gs.view(np.uint32)[valid], ws.view(np.uint32)[valid]))
for r_, l, row, ch in bad[:8]:
  e = entry[r_, l, row]
  src, tok = divmod(int(e) // K, T)
  xb = x[src, tok].astype(np.float32)
  blk = xb[ch // 128 * 128:(ch // 128 + 1) * 128]
  s = np.float32(max(np.abs(blk).max(), np.float32(1e-4))) * (np.float32(1.0) / np.float32(448.0))
  inv = np.float32(1.0) / s
  v = np.float32(xb[ch]) * inv
  ref_bits = np.array([v]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0]
  gpu_q = np.asarray(qg[0][src * T + tok, ch:ch + 1]).view(np.uint8)[0]
  print(f"rank {r_} expert {l} row {row} ch {ch}: src {src} tok {tok} x {xb[ch]!r} s {s!r} inv {inv!r} "
        f"x*inv {v!r} ({v.view(np.uint32):#x}) numpy->{ref_bits} cuda {gb[r_, l, row, ch]} "
        f"reference {wb[r_, l, row, ch]} jit(quantize) on GPU {gpu_q}")
