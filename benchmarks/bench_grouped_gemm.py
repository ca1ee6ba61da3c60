"""Expert GEMMs on one GPU: jax_ep.grouped_matmul against what JAX offers.

Shape (docs/design.md §6): M = 32768 rows (4096 tokens x top-8) over 128
local experts, bf16, H = 7168 -> F = 2048 (up) and F -> H (down). Group sizes
come from uniform random routing, padded to 8 rows, and are read on the
device. In one run, every implementation warmed up before it is timed:

  jax_ep             grouped_matmul (CUTLASS grouped kernels)
  jax_dense_matmul   x @ w of the same FLOPs with one weight: the rate to beat
  jax_padded_einsum  [128, 384, H] x [128, H, F] (capacity 1.5x the mean)
  jax_batched_einsum [128, 256, H] x [128, H, F]: the same FLOPs and the same
                     128 weights with no raggedness, XLA's batched GEMM; the
                     rate the hardware gives this data movement
  jax_ragged_dot     lax.ragged_dot (XLA's own)
  jax_ep_masked      masked_grouped_matmul at the low-latency decode grid
  jax_ep_fp8*        the FP8 products (forward, dgrad, wgrad, masked, casts and
                     the whole vjp), beside the bf16 kernels (_fp8_records)

and each kernel alone (kernel_fwd / kernel_dx / kernel_dw) on the routed
sizes and on uniform 256-row groups, where the 128-row tiles waste nothing.

for the forward (`fwd`) and forward + backward (`fwd_bwd`: out, dx, dw).
TFLOP/s count the useful FLOPs (2 * 32768 * H * F per product, three products
for fwd_bwd) over the median time. Records: bench = grouped_gemm.
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_normal as bn  # noqa: E402

ROWS, EXPERTS, HIDDEN, FFN, ALIGN, CAPACITY = 32768, 128, 7168, 2048, 8, 384


def _group_sizes(rng) -> np.ndarray:
  sizes = rng.multinomial(ROWS, np.full(EXPERTS, 1.0 / EXPERTS))
  return ((sizes + ALIGN - 1) // ALIGN * ALIGN).astype(np.int32)


def _products(direction: str):
  """(k, n) of the product: up H -> F, down F -> H."""
  return (HIDDEN, FFN) if direction == "up" else (FFN, HIDDEN)


def _product_records(quick, rec, sizes_np, key, dense_fwd_t, profile: dict) -> None:
  """Each of the three kernels alone (forward, dx, dw; up projection), on the
  routed sizes and on uniform 256-row groups (the stock CUTLASS example's
  case, where 128-row tiles waste nothing)."""
  import jax
  import jax.numpy as jnp
  from jax_ep._ffi import grouped_gemm as gg_ffi
  k, n = _products("up")
  for routing, sz in (("random", sizes_np), ("uniform", np.full(EXPERTS, ROWS // EXPERTS,
                                                                 np.int32))):
    m = int(sz.sum())
    sizes = jnp.asarray(sz)
    k1, k2, k3 = jax.random.split(key, 3)
    x = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (EXPERTS, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(k3, (m, n), jnp.float32).astype(jnp.bfloat16)
    flops = 2.0 * ROWS * k * n
    # Default arguments bind this iteration's sizes and m: the forward call
    # is profiled after the loop has moved on.
    calls = {
        "kernel_fwd": (lambda a, b, s=sizes, m=m: gg_ffi.grouped_gemm(
            a, b, s, kind=gg_ffi.FORWARD, out_shape=(m, n), out_dtype=jnp.bfloat16), (x, w)),
        "kernel_dx": (lambda d, b, s=sizes, m=m: gg_ffi.grouped_gemm(
            d, b, s, kind=gg_ffi.TRANS_W, out_shape=(m, k), out_dtype=jnp.bfloat16), (dy, w)),
        "kernel_dw": (lambda a, d, s=sizes: gg_ffi.grouped_gemm(
            a, d, s, kind=gg_ffi.WEIGHT_GRAD, out_shape=(EXPERTS, k, n),
            out_dtype=jnp.bfloat16), (x, dy)),
    }
    for prod, (f, a) in list(calls.items()):
      try:
        jax.block_until_ready(jax.jit(f)(*a))
      except Exception as e:  # noqa: BLE001 - an experimental kernel must not hide the others
        print(f"  {routing} {prod}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        calls.pop(prod)
    for prod, (f, a) in calls.items():
      t = bn.time_or_none(f"{routing} {prod}", f, a, quick, max_iters=10)
      rec("up", prod, "jax_ep", t, flops, dense_fwd_t, routing=routing, padded_rows=m)
      if prod == "kernel_fwd":
        profile[f"jax_ep_fwd_{routing}"] = (f, a, flops, t)


GEMM_FAMILIES = (("GemmUniversal", "GemmUniversal"), ("PrepGroups", "PrepGroups"),
                 ("ZeroTailRows", "ZeroTailRows"), ("ZeroEmptyGroups", "ZeroEmptyGroups"))


def kernel_summary(events: list[dict], calls: int, families=GEMM_FAMILIES) -> dict:
  """GPU time per call (µs): each kernel family's total over `calls`, and
  all kernels together. `families`: (substring, family) pairs, first match
  wins; a kernel matching none is its own family (first 40 characters)."""
  def family(name: str) -> str:
    for key, fam in families:
      if key in name:
        return fam
    return name[:40]
  per = {}
  for e in events:
    per[family(e["name"])] = per.get(family(e["name"]), 0.0) + e["dur"]
  out = {k: v / calls for k, v in per.items()}
  out["all_kernels"] = sum(per.values()) / calls
  return out


def _profile_records(rec, calls_of: dict, quick: bool) -> None:
  """Per-call GPU kernel time (jax.profiler / CUPTI) of each call in
  `calls_of` ({label: (fn, args, flops, wall_s)}), next to its wall time:
  the difference is what happens outside the kernels (launch gaps, host
  work, waiting)."""
  import tempfile
  import jax
  iters, repeats = (5, 1) if quick else (10, 2)
  for label, (fn, args, flops, wall) in calls_of.items():
    try:
      tdir = tempfile.mkdtemp(prefix="jax_ep_gg_prof_")
      with jax.profiler.trace(tdir, create_perfetto_trace=True):
        bn._time_step(fn, args, iters=iters, repeats=repeats)
      # _time_step runs the step twice to warm up, then `repeats` times.
      summ = kernel_summary(bn.gpu_kernel_events(tdir), calls=iters * (2 + repeats))
    except Exception as e:  # noqa: BLE001 - the profile must not hide the timings
      print(f"  profile {label}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    busy = summ["all_kernels"] * 1e-6
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(summ.items(), key=lambda kv: -kv[1])[:5])
    print(f"  profile {label}: GPU kernels {busy * 1e3:.3f} ms per call against "
          f"{'-' if wall is None else f'{wall * 1e3:.3f}'} ms wall ({parts} µs)", flush=True)
    rec("up", "kernel_time", label, busy, flops, None, wall_us=None if wall is None else wall * 1e6,
        kernels_us=summ)


def _fp8_records(quick, rec, sizes_np, key, dense_t: dict) -> None:
  """The FP8 products beside their bf16 kernels on the same groups, both
  projections, routed and uniform groups; ratio_to_bf16 = bf16 time / fp8
  time, ratio_to_dense against the dense bf16 matmul of the direction.

    jax_ep_fp8        forward on FP8 operands as dispatch and fp8_weights
                      give them (inference / prefill)
    jax_ep_fp8_dgrad  dx = dy @ w^T: dy cast 1 x 128 (its cast timed apart,
                      jax_ep_fp8_cast_rows), the weights' transposed blocks
    jax_ep_fp8_wgrad  dw = x^T dy on the token-major FP8 operands (their
                      casts timed apart, jax_ep_fp8_cast_tokens)
    jax_ep_wgrad      the bf16 weight-gradient kernel, for comparison
    jax_ep_fp8 fwd_bwd / jax_ep fwd_bwd: jax.vjp through the whole op from
                      bf16 x and master weights (all casts included)
  """
  import jax
  import jax.numpy as jnp
  import jax_ep
  from jax_ep import fp8
  from jax_ep._ffi import grouped_gemm as gg_ffi
  from jax_ep.ops import grouped_gemm as gg
  uniform = np.full(EXPERTS, ROWS // EXPERTS, np.int32)
  for direction in ("up", "down"):
    k, n = _products(direction)
    k1, k2, k3, key = jax.random.split(key, 4)
    w = jax.random.normal(k2, (EXPERTS, k, n), jnp.float32) / np.sqrt(k)
    wf = jax.jit(jax_ep.fp8_weights)(w)
    wb = w.astype(jnp.bfloat16)
    del w
    flops = 2.0 * ROWS * k * n
    t_cast_w = bn.time_or_none(f"{direction} fp8_weights", jax_ep.fp8_weights, (wb,), quick,
                               max_iters=10)
    rec(direction, "cast", "jax_ep_fp8_cast_weights", t_cast_w, 0.0, None, dtype="fp8",
        hbm_gbps=None if t_cast_w is None else EXPERTS * k * n * (2 + 2) / t_cast_w / 1e9)
    for routing, sz in (("random", sizes_np), ("uniform", uniform)):
      m = int(sz.sum())
      sizes = jnp.asarray(sz)
      xb = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
      dyb = jax.random.normal(k3, (m, n), jnp.float32).astype(jnp.bfloat16)
      xq, xs = jax.jit(fp8.quantize)(xb)
      dq, ds = jax.jit(fp8.quantize)(dyb)
      tok = jax.jit(gg.quantize_token_major)
      xt, xts, psz = tok(xb, sizes)
      dt, dts, _ = tok(dyb, sizes)
      calls = {
          ("fwd", "jax_ep_fp8"): (lambda a, b, c, d, s=sizes: jax_ep.grouped_matmul_fp8(
              (a, b), (c, d), s, backend="cuda"), (xq, xs, wf.q, wf.s)),
          ("fwd", "jax_ep"): (lambda a, b, s=sizes: jax_ep.grouped_matmul(
              a, b, s, backend="cuda"), (xb, wb)),
          ("dgrad", "jax_ep_fp8_dgrad"): (lambda a, b, c, d, s=sizes: gg_ffi.grouped_gemm_fp8(
              a, b, c, d, s), (dq, ds, wf.q_t, wf.s_t)),
          ("dgrad", "jax_ep_dgrad"): (lambda d, b, s=sizes, m=m: gg_ffi.grouped_gemm(
              d, b, s, kind=gg_ffi.TRANS_W, out_shape=(m, k), out_dtype=jnp.bfloat16),
              (dyb, wb)),
          ("wgrad", "jax_ep_fp8_wgrad"): (lambda a, b, c, d, s=psz: gg_ffi.grouped_gemm_fp8(
              a, b, c, d, s, kind=gg_ffi.WEIGHT_GRAD_FP8), (xt, xts, dt, dts)),
          ("wgrad", "jax_ep_wgrad"): (lambda a, d, s=sizes: gg_ffi.grouped_gemm(
              a, d, s, kind=gg_ffi.WEIGHT_GRAD, out_shape=(EXPERTS, k, n),
              out_dtype=jnp.bfloat16), (xb, dyb)),
          ("cast", "jax_ep_fp8_cast_rows"): (fp8.quantize, (dyb,)),
          ("cast", "jax_ep_fp8_cast_tokens"): (lambda a, s=sizes: tok(a, s), (xb,)),
      }

      def vjp_of(f):
        def g(a, b, d):
          out, back = jax.vjp(f, a, b)
          return (out, *back(d))
        return g
      calls[("fwd_bwd", "jax_ep_fp8")] = (vjp_of(
          lambda a, b, s=sizes: jax_ep.grouped_matmul_fp8(a, b, s, backend="cuda")), (xb, wb, dyb))
      calls[("fwd_bwd", "jax_ep")] = (vjp_of(
          lambda a, b, s=sizes: jax_ep.grouped_matmul(a, b, s, backend="cuda")), (xb, wb, dyb))
      # Correctness at this shape before timing: each FP8 product against
      # its bf16 kernel (e4m3 operands: a few percent).
      pairs = ((("fwd", "jax_ep_fp8"), ("fwd", "jax_ep")),
               (("dgrad", "jax_ep_fp8_dgrad"), ("dgrad", "jax_ep_dgrad")),
               (("wgrad", "jax_ep_fp8_wgrad"), ("wgrad", "jax_ep_wgrad")))
      outs = {}
      for key_, (f, a) in list(calls.items()):
        try:
          outs[key_] = jax.block_until_ready(jax.jit(f)(*a))
        except Exception as e:  # noqa: BLE001 - one failure must not hide the others
          print(f"  fp8 {direction} {routing} {key_}: FAILED: {type(e).__name__}: "
                f"{str(e)[:300]}", flush=True)
          calls.pop(key_)
      for f8, bf in pairs:
        if f8 in outs and bf in outs:
          a8 = jnp.asarray(outs[f8], jnp.float32)
          ab = jnp.asarray(outs[bf], jnp.float32)
          err = float(jnp.linalg.norm(a8 - ab) / jnp.linalg.norm(ab))
          print(f"  fp8 {direction} {routing} {f8[1]}: relative difference to bf16 {err:.3e}",
                flush=True)
          assert err < 0.08, f"{f8} {direction} {routing}: {err:.3e} from the bf16 kernel"
      outs.clear()
      times = {}
      for (mode, impl), (f, a) in calls.items():
        times[(mode, impl)] = bn.time_or_none(f"fp8 {direction} {routing} {impl}", f, a, quick,
                                              max_iters=10)
      base = {"fwd": "jax_ep", "dgrad": "jax_ep_dgrad", "wgrad": "jax_ep_wgrad"}
      for (mode, impl), t in times.items():
        bf = times.get((mode, "jax_ep" if mode == "fwd_bwd" else base.get(mode, "")))
        mult = 3 if mode == "fwd_bwd" else (0 if mode == "cast" else 1)
        dense = dense_t.get((direction, "fwd_bwd" if mode == "fwd_bwd" else "fwd"))
        extra = {}
        if mode == "cast" and t is not None:
          rows_bytes = m * (k if impl.endswith("tokens") else n)
          extra["hbm_gbps"] = rows_bytes * (2 + 1) / t / 1e9
        rec(direction, mode, impl, t, mult * flops, dense if mult else None,
            dtype="fp8" if "fp8" in impl else "bf16", routing=routing, padded_rows=m,
            ratio_to_bf16=None if (t is None or bf is None or "fp8" not in impl or mult == 0)
            else bf / t, **extra)

    # Decode: the masked FP8 form over the low-latency grid (8 rows per
    # expert on average), weight bytes per second as the figure.
    if direction == "up":
      S = 2 * 128
      rng = np.random.default_rng(7)
      counts = jnp.asarray(rng.multinomial(S * 8 // 2, np.full(EXPERTS, 1.0 / EXPERTS)),
                           jnp.int32)
      xg = jax.random.normal(k1, (EXPERTS, S, k), jnp.float32)
      gq, gs = jax.jit(fp8.quantize)(xg)
      del xg
      f = lambda a, b, c, d: jax_ep.masked_grouped_matmul_fp8((a, b), (c, d), counts,
                                                              backend="cuda")
      jax.block_until_ready(jax.jit(f)(gq, gs, wf.q, wf.s))
      t = bn.time_or_none("decode jax_ep_fp8_masked", f, (gq, gs, wf.q, wf.s), quick, max_iters=20)
      valid = float(counts.sum())
      rec("up", "decode", "jax_ep_fp8_masked", t, 2.0 * valid * k * n, None, dtype="fp8",
          valid_rows=valid, weight_read_gbps=None if t is None else EXPERTS * k * n / t / 1e9)
    del wf, wb


def _cast_records(quick, rec, sizes_np, key) -> None:
  """The FP8 casts alone, up projection (weights [128, 7168, 2048] in both
  orientations; x [M, 7168] token-major), with the bytes each moves."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  from jax_ep.ops import grouped_gemm as gg
  k, n = _products("up")
  k1, k2 = jax.random.split(key)
  wb = (jax.random.normal(k2, (EXPERTS, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  t = bn.time_or_none("fp8_weights", jax_ep.fp8_weights, (wb,), quick, max_iters=10)
  rec("up", "cast", "jax_ep_fp8_cast_weights", t, 0.0, None, dtype="fp8",
      hbm_gbps=None if t is None else EXPERTS * k * n * (2 + 2) / t / 1e9)
  del wb
  sizes = jnp.asarray(sizes_np)
  m = int(sizes_np.sum())
  xb = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
  p = gg.padded_token_count(m, EXPERTS)
  tok = jax.jit(gg.quantize_token_major)
  t = bn.time_or_none("token-major cast", lambda a, s=sizes: tok(a, s), (xb,), quick, max_iters=10)
  rec("up", "cast", "jax_ep_fp8_cast_tokens", t, 0.0, None, dtype="fp8", routing="random",
      padded_rows=m, hbm_gbps=None if t is None else (m * k * 2 + p * k) / t / 1e9)


def run(quick: bool, fp8_only: bool = False, casts_only: bool = False) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import jax_ep

  rng = np.random.default_rng(0)
  sizes_np = _group_sizes(rng)
  m_pad = int(sizes_np.sum())
  print(f"group sizes: min {sizes_np.min()} max {sizes_np.max()} padded rows {m_pad}", flush=True)
  sizes = jnp.asarray(sizes_np)
  records = []
  key = jax.random.key(1)

  def rec(direction, mode, impl, t, flops, dense_t=None, dtype="bf16", **extra):
    r = dict(bench="grouped_gemm", impl=impl, dtype=dtype, direction=direction, mode=mode,
             rows=ROWS, experts=EXPERTS, k=_products(direction)[0], n=_products(direction)[1],
             time_us=None if t is None else t * 1e6,
             tflops=None if t is None else flops / t / 1e12,
             ratio_to_dense=None if (t is None or dense_t is None) else dense_t / t, **extra)
    records.append(r)
    timing = "-" if t is None else f"{t * 1e3:9.3f} ms {flops / t / 1e12:7.1f} TFLOP/s"
    ratio = "" if r["ratio_to_dense"] is None else f"  x{r['ratio_to_dense']:.2f} of dense"
    if extra.get("ratio_to_bf16") is not None:
      ratio += f"  x{extra['ratio_to_bf16']:.2f} of bf16"
    tag = extra.get("routing", "")
    print(f"  {direction:4s} {mode:7s} {impl:18s} {tag:8s}{timing}{ratio}", flush=True)

  dense_up_fwd = None
  dense_call = batched_call = None
  dense_by = {}
  if casts_only:
    _cast_records(quick, rec, sizes_np, key)
    return records
  if fp8_only:
    # The dense bf16 matmul of each direction (forward, and forward +
    # backward) is the one baseline the FP8 records need.
    for direction in ("up", "down"):
      k, n = _products(direction)
      k1, k2, k3, key = jax.random.split(key, 4)
      xd = jax.random.normal(k1, (ROWS, k), jnp.float32).astype(jnp.bfloat16)
      wd = (jax.random.normal(k2, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
      dyd = jax.random.normal(k3, (ROWS, n), jnp.float32).astype(jnp.bfloat16)
      def dense_bwd(a, b, d):
        out, back = jax.vjp(lambda a, b: a @ b, a, b)
        return (out, *back(d))
      # The FP8 tensor-core rate of the same run: XLA's dense e4m3 matmul
      # (cuBLASLt), the floor the FP8 products are measured against.
      xf8, wf8 = xd.astype(jnp.float8_e4m3fn), wd.astype(jnp.float8_e4m3fn)
      f8dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16)
      try:
        jax.block_until_ready(jax.jit(f8dot)(xf8, wf8))
        t8 = bn.time_or_none(f"{direction} fwd dense fp8", f8dot, (xf8, wf8), quick, max_iters=10)
      except Exception as e:  # noqa: BLE001 - a missing baseline must not hide the rest
        print(f"  {direction} dense fp8: FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
        t8 = None
      del xf8, wf8
      for mode, f, a, mult in (("fwd", lambda a, b: a @ b, (xd, wd), 1),
                               ("fwd_bwd", dense_bwd, (xd, wd, dyd), 3)):
        jax.block_until_ready(jax.jit(f)(*a))
        t = bn.time_or_none(f"{direction} {mode} dense", f, a, quick, max_iters=10)
        dense_by[(direction, mode)] = t
        rec(direction, mode, "jax_dense_matmul", t, mult * 2.0 * ROWS * k * n, t,
            padded_rows=ROWS)
      rec(direction, "fwd", "jax_dense_matmul_fp8", t8, 2.0 * ROWS * k * n,
          dense_by.get((direction, "fwd")), dtype="fp8", padded_rows=ROWS)
    _fp8_records(quick, rec, sizes_np, key, dense_by)
    return records
  for direction in ("up", "down"):
    k, n = _products(direction)
    k1, k2, k3, key = jax.random.split(key, 4)
    x = jax.random.normal(k1, (m_pad, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (EXPERTS, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(k3, (m_pad, n), jnp.float32).astype(jnp.bfloat16)
    xd = x[:ROWS]
    wd = w[0]
    dyd = dy[:ROWS]
    xp = jax.random.normal(k1, (EXPERTS, CAPACITY, k), jnp.float32).astype(jnp.bfloat16)
    dyp = jax.random.normal(k3, (EXPERTS, CAPACITY, n), jnp.float32).astype(jnp.bfloat16)
    xb = xd.reshape(EXPERTS, ROWS // EXPERTS, k)
    dyb = dyd.reshape(EXPERTS, ROWS // EXPERTS, n)
    flops = 2.0 * ROWS * k * n

    fwd = {
        "jax_dense_matmul": (lambda a, b: a @ b, (xd, wd)),
        "jax_ep": (lambda a, b: jax_ep.grouped_matmul(a, b, sizes, backend="cuda"), (x, w)),
        "jax_padded_einsum": (lambda a, b: jnp.einsum("gch,ghf->gcf", a, b), (xp, w)),
        "jax_batched_einsum": (lambda a, b: jnp.einsum("gch,ghf->gcf", a, b), (xb, w)),
        "jax_ragged_dot": (lambda a, b: jax.lax.ragged_dot(a, b, sizes), (x, w)),
    }

    def vjp_of(f):
      def g(a, b, d):
        out, back = jax.vjp(f, a, b)
        return (out, *back(d))
      return g

    bwd = {
        "jax_dense_matmul": (vjp_of(lambda a, b: a @ b), (xd, wd, dyd)),
        "jax_ep": (vjp_of(lambda a, b: jax_ep.grouped_matmul(a, b, sizes, backend="cuda")),
                   (x, w, dy)),
        "jax_padded_einsum": (vjp_of(lambda a, b: jnp.einsum("gch,ghf->gcf", a, b)), (xp, w, dyp)),
        "jax_batched_einsum": (vjp_of(lambda a, b: jnp.einsum("gch,ghf->gcf", a, b)),
                               (xb, w, dyb)),
        "jax_ragged_dot": (vjp_of(lambda a, b: jax.lax.ragged_dot(a, b, sizes)), (x, w, dy)),
    }
    # ragged_dot's backward materialises [G, M, H] (56.8 GiB here) and runs
    # out of memory on a 141 GB H200 (measured 2026-12-01); its forward
    # is timed on the up projection only (~0.2 s a call).
    bwd.pop("jax_ragged_dot")
    if quick or direction == "down":
      fwd.pop("jax_ragged_dot")

    # Correctness at this shape before timing: the kernel against the padded
    # einsum's products of the same rows (an independent XLA path).
    got = jax.jit(fwd["jax_ep"][0])(x, w)
    starts = np.concatenate([[0], np.cumsum(sizes_np)[:-1]])
    for g in (0, EXPERTS // 2, EXPERTS - 1):
      s, c = int(starts[g]), int(sizes_np[g])
      want = jnp.dot(x[s:s + c], w[g], preferred_element_type=jnp.float32)
      err = float(jnp.linalg.norm(got[s:s + c].astype(jnp.float32) - want) / jnp.linalg.norm(want))
      assert err < 1e-2, f"{direction} group {g}: relative error {err:.2e}"

    # Warm every implementation before timing any; one that fails is
    # reported and left out, not allowed to hide the others.
    for table in (fwd, bwd):
      for impl, (f, a) in list(table.items()):
        try:
          jax.block_until_ready(jax.jit(f)(*a))
        except Exception as e:  # noqa: BLE001
          print(f"  {direction} {impl}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
          table.pop(impl)
    dense_t = {}
    for mode, table, mult in (("fwd", fwd, 1), ("fwd_bwd", bwd, 3)):
      for impl, (f, a) in table.items():
        slow = impl == "jax_ragged_dot"
        t = bn.time_or_none(f"{direction} {mode} {impl}", f, a, quick, max_iters=1 if slow else 10)
        if impl == "jax_batched_einsum" and direction == "up" and mode == "fwd":
          batched_call = (f, a, flops, t)
        if impl == "jax_dense_matmul":
          dense_t[mode] = t
          dense_by[(direction, mode)] = t
          if direction == "up" and mode == "fwd":
            dense_up_fwd = t
            dense_call = (f, a, flops, t)
        rec(direction, mode, impl, t, mult * flops, dense_t.get(mode),
            padded_rows=m_pad if impl.startswith("jax_ep") or slow else
            (EXPERTS * CAPACITY if impl == "jax_padded_einsum" else ROWS))

  profile = {}
  _product_records(quick, rec, sizes_np, key, dense_up_fwd, profile)
  _fp8_records(quick, rec, sizes_np, key, dense_by)
  if dense_call is not None:
    profile["jax_dense_matmul"] = dense_call
  if batched_call is not None:
    profile["jax_batched_einsum"] = batched_call
  _profile_records(rec, profile, quick)

  # Decode: the masked form over the low-latency grid [E_l, R * max_tokens, H]
  # (EP2, 128 tokens/rank, top-8 of 256: 8 rows per expert on average).
  S = 2 * 128
  counts = jnp.asarray(rng.multinomial(2 * 128 * 8 // 2, np.full(EXPERTS, 1.0 / EXPERTS)),
                       jnp.int32)
  xg = jax.random.normal(key, (EXPERTS, S, HIDDEN), jnp.float32).astype(jnp.bfloat16)
  wg = (jax.random.normal(key, (EXPERTS, HIDDEN, FFN), jnp.float32) / 84.0).astype(jnp.bfloat16)
  valid = float(counts.sum())
  flops = 2.0 * valid * HIDDEN * FFN
  masked = {
      "jax_ep_masked": lambda a, b: jax_ep.masked_grouped_matmul(a, b, counts, backend="cuda"),
      "jax_padded_einsum": lambda a, b: jnp.einsum("gch,ghf->gcf", a, b),
  }
  for f in masked.values():
    jax.block_until_ready(jax.jit(f)(xg, wg))
  weights_bytes = EXPERTS * HIDDEN * FFN * 2
  for impl, f in masked.items():
    t = bn.time_or_none(f"decode {impl}", f, (xg, wg), quick, max_iters=20)
    rec("up", "decode", impl, t, flops, None, valid_rows=valid,
        weight_read_gbps=None if t is None else weights_bytes / t / 1e9)
  return records


def main(argv=None) -> int:
  args = bn.simple_args(__doc__, argv, flags=(
      ("--fp8-only", "the dense baselines and the FP8 records only"),
      ("--fp8-casts-only", "the FP8 casts alone")))
  try:
    import jax
    gpus = jax.devices("gpu")
  except (ImportError, RuntimeError):
    gpus = []
  import jax_ep
  if not gpus or not jax_ep.cuda_available():
    print("bench_grouped_gemm: needs a GPU and jax_ep's CUDA build; nothing measured",
          file=sys.stderr)
    return 2
  records = run(args.quick, args.fp8_only, args.fp8_casts_only)
  for r in records:
    r.update(ranks=1, tokens_per_rank=ROWS // 8, hidden=HIDDEN, topk=8)
  bn.run_records.stamp(records, bn._machine(gpus[:1]))
  bn.write_records(records, args.out, "grouped_gemm")
  return 0


if __name__ == "__main__":
  sys.exit(main())
