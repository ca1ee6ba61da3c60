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
  jax_ep_fp8         grouped_matmul_fp8 (up projection), beside the bf16 kernel

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
  from jax_ep import _ffi
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
        "kernel_fwd": (lambda a, b, s=sizes, m=m: _ffi.grouped_gemm_cuda(
            a, b, s, kind=_ffi.GG_FORWARD, out_shape=(m, n), out_dtype=jnp.bfloat16), (x, w)),
        "kernel_dx": (lambda d, b, s=sizes, m=m: _ffi.grouped_gemm_cuda(
            d, b, s, kind=_ffi.GG_TRANS_W, out_shape=(m, k), out_dtype=jnp.bfloat16), (dy, w)),
        "kernel_dw": (lambda a, d, s=sizes: _ffi.grouped_gemm_cuda(
            a, d, s, kind=_ffi.GG_WEIGHT_GRAD, out_shape=(EXPERTS, k, n),
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
                 ("ZeroTailRows", "ZeroTailRows"), ("ZeroEmptyGroups", "ZeroEmptyGroups"),
                 ("RegroupScales", "RegroupScales"))


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


def _fp8_records(quick, rec, sizes_np, key, dense_fwd_t) -> None:
  """grouped_matmul_fp8 (e4m3 rows with per-128 scales x e4m3 weights with
  128 x 128 block scales), up projection, routed and uniform groups, next to
  the bf16 kernel on the same groups; ratio_to_bf16 = bf16 time / fp8 time."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  k, n = _products("up")
  k1, k2 = jax.random.split(key)
  w = jax.random.normal(k2, (EXPERTS, k, n), jnp.float32) / np.sqrt(k)
  wq, ws = jax.jit(jax_ep.quantize_weights_fp8)(w)
  wb = w.astype(jnp.bfloat16)
  del w
  flops = 2.0 * ROWS * k * n
  for routing, sz in (("random", sizes_np), ("uniform", np.full(EXPERTS, ROWS // EXPERTS,
                                                                 np.int32))):
    m = int(sz.sum())
    sizes = jnp.asarray(sz)
    x = jax.random.normal(k1, (m, k), jnp.float32)
    xq, xs = jax.jit(jax_ep.quantize)(x)
    xb = x.astype(jnp.bfloat16)
    del x
    f8 = lambda a, b, c, d: jax_ep.grouped_matmul_fp8((a, b), (c, d), sizes, backend="cuda")
    bf = lambda a, b: jax_ep.grouped_matmul(a, b, sizes, backend="cuda")
    try:
      jax.block_until_ready(jax.jit(f8)(xq, xs, wq, ws))
      jax.block_until_ready(jax.jit(bf)(xb, wb))
    except Exception as e:  # noqa: BLE001
      print(f"  fp8 {routing}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    t8 = bn.time_or_none(f"fp8 {routing}", f8, (xq, xs, wq, ws), quick, max_iters=10)
    tb = bn.time_or_none(f"bf16 {routing}", bf, (xb, wb), quick, max_iters=10)
    rec("up", "fwd", "jax_ep", tb, flops, dense_fwd_t, routing=routing, padded_rows=m)
    rec("up", "fwd", "jax_ep_fp8", t8, flops, dense_fwd_t, routing=routing, padded_rows=m,
        dtype="fp8", ratio_to_bf16=None if (t8 is None or tb is None) else tb / t8)


def run(quick: bool) -> list[dict]:
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
          if direction == "up" and mode == "fwd":
            dense_up_fwd = t
            dense_call = (f, a, flops, t)
        rec(direction, mode, impl, t, mult * flops, dense_t.get(mode),
            padded_rows=m_pad if impl.startswith("jax_ep") or slow else
            (EXPERTS * CAPACITY if impl == "jax_padded_einsum" else ROWS))

  profile = {}
  _product_records(quick, rec, sizes_np, key, dense_up_fwd, profile)
  _fp8_records(quick, rec, sizes_np, key, dense_up_fwd)
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
  args = bn.simple_args(__doc__, argv)
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
  records = run(args.quick)
  for r in records:
    r.update(ranks=1, tokens_per_rank=ROWS // 8, hidden=HIDDEN, topk=8)
  bn.run_records.stamp(records, bn._machine(gpus[:1]))
  bn.write_records(records, args.out, "grouped_gemm")
  return 0


if __name__ == "__main__":
  sys.exit(main())
