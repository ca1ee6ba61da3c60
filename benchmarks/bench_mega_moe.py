"""jax_ep.mega_moe's forward (bench = moe_forward): the routed SwiGLU experts
of an FP8 layer as one op, at the DESIGN §6 MoE shape, over every GPU found
(one GPU: EP1).

Shape: T = 4096 tokens per rank, H = 7168, F = 2048, top-8 of 256 experts
drawn uniformly (distinct per token), held FP8 weights (inference: w13
[E_l, 7168, 4096] and w2 [E_l, 2048, 7168] as e4m3 blocks). Impls:

  jax_ep_fp8    the op's automatic choice: the unfused FP8 path (FP8
                dispatch -> grouped FP8 GEMM 1 -> SwiGLU -> h's cast ->
                grouped FP8 GEMM 2 -> combine), the baseline a fused
                forward must beat (docs/mega_moe.md asks for <= 0.90 x)
  jax_ep_fused  backend="cuda": the fused kernels; while the build lacks
                them the record carries time_us None and the refusal

Per record: floor_us, the GEMMs' FLOPs at the dense e4m3 rate measured in
the same run (share_of_floor = floor_us / time_us); bytes_floor_us, the FP8
weights read once at the copy rate measured in the same run; gemm_us, the
grouped GEMM kernels' GPU time per call and outside_gemms_us, the GPU time
of everything else (dispatch, SwiGLU, the casts, combine): at EP1 the most
a fused forward that keeps the GEMMs' speed can save. fused_target_us is
0.90 x the unfused time.

  python benchmarks/bench_mega_moe.py [--out DIR] [--quick] [--tokens T]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_moe as bm  # noqa: E402
import bench_normal as bn  # noqa: E402
import moe_swiglu as sw  # noqa: E402

IMPLS = ("jax_ep_fp8", "jax_ep_fused")
FUSED_BAR = 0.90


def _held_weights(shape: "bm.MoEShape", experts: int, key):
  """(wq, ws) blocks of random bf16 w13 [experts, H, 2F] and w2 [experts, F, H]
  (the scale of a unit-variance row through them stays ~1),
  quantised a few experts at a time so that the bf16 masters of all
  experts never sit in memory at once."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  step = min(experts, 16)
  quant = jax.jit(jax_ep.quantize_weights_fp8)
  out = []
  for j, (k, n) in enumerate(((shape.hidden, 2 * shape.ffn), (shape.ffn, shape.hidden))):
    parts = []
    for g0 in range(0, experts, step):
      g = min(step, experts - g0)
      w = jax.random.normal(jax.random.fold_in(key, 2 * g0 + j), (g, k, n), jnp.bfloat16)
      parts.append(quant((w * (1.0 / np.sqrt(k))).astype(jnp.bfloat16)))
    out.append(tuple(jnp.concatenate([p[i] for p in parts]) for i in range(2)))
  return tuple(out)


def _routing(shape: "bm.MoEShape", r_count: int, key):
  """topk_idx [R*T, K] (distinct experts per token, uniform) and softmax
  weights."""
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(key)
  m = r_count * shape.tokens
  idx = jnp.argsort(jax.random.uniform(k1, (m, shape.experts)), axis=-1)[:, :shape.topk]
  w = jax.nn.softmax(jax.random.normal(k2, (m, shape.topk), jnp.float32), axis=-1)
  return idx.astype(jnp.int32), w


def _gpu_split(fn, args) -> tuple[Optional[float], Optional[float], Optional[dict]]:
  """(grouped GEMM µs, everything else µs, the largest kernels) per call
  from a profile; Nones when the trace cannot be read."""
  got = sw.profile_parts(fn, args)
  if got is None:
    return None, None, None
  parts = got[1]
  gemm = sum(v for k, v in parts.items() if is_grouped_gemm(k))
  return gemm, sum(parts.values()) - gemm, sw.top_parts(parts)


def is_grouped_gemm(kernel: str) -> bool:
  """The grouped GEMMs' kernels: CUTLASS's grouped kernel (and, once built,
  the fused linear kernels, named FusedLinear*)."""
  return "GemmUniversal" in kernel or "FusedLinear" in kernel


def run(shape: "bm.MoEShape", *, quick: bool, impls=IMPLS) -> list[dict]:
  import jax
  import jax_ep
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("ep",))
  r_count = mesh.size
  bm.ensure_communicator(mesh, shape)
  key = jax.random.key(7)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
  x = put(jax.random.normal(key, (r_count * shape.tokens, shape.hidden), jax.numpy.bfloat16))
  idx, wts = (put(a) for a in _routing(shape, r_count, jax.random.fold_in(key, 1)))
  # All experts' blocks, sharded over "ep" (each rank holds its e_l); they
  # are drawn on the first device, which holds them all at EP1 anyway.
  w13, w2 = jax.tree.map(put, _held_weights(shape, shape.experts, jax.random.fold_in(key, 2)))
  rates = sw.dense_rates(shape, quick)
  hbm = sw.hbm_rate(quick)
  flops = sw.gemm_flops(shape)
  wbytes = sw.weight_bytes(shape, r_count, "forward", "fp8")
  records, times = [], {}
  for impl in impls:
    backend = "cuda" if impl == "jax_ep_fused" else None
    op = functools.partial(jax_ep.mega_moe, num_experts=shape.experts,
                           expert_alignment=shape.align, backend=backend)
    t = gemm = rest = parts = failed = None
    try:
      fn = jax.jit(jax_ep.shard_map(op, mesh))
      args = (x, idx, wts, w13, w2)
      jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - a refusal is a record, not a crash
      failed = f"{type(e).__name__}: {str(e)[:300]}"
      print(f"  {impl}: {failed}", flush=True)
    else:
      t = bn.time_or_none(impl, fn, args, quick, max_iters=20)
      if t is not None and not quick:
        gemm, rest, parts = _gpu_split(fn, args)
    times[impl] = t
    rate = rates.get("fp8")
    floor = None if rate is None else flops / rate
    records.append(dict(
        bench="moe_forward", impl=impl, activation="swiglu", dtype="fp8",
        tokens_per_rank=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, topk=shape.topk,
        experts=shape.experts, ranks=r_count, virtual_ranks=None,
        time_us=None if t is None else t * 1e6, failed=failed,
        gemm_tflops=flops / 1e12, floor_us=None if floor is None else floor * 1e6,
        share_of_floor=None if (floor is None or t is None) else floor / t,
        dense_tflops_per_s=None if rate is None else rate / 1e12,
        weight_gbytes=wbytes / 1e9, hbm_gbps=None if hbm is None else hbm / 1e9,
        bytes_floor_us=None if hbm is None else wbytes / hbm * 1e6,
        gemm_us=gemm, outside_gemms_us=rest, kernel_parts=parts))
  base = times.get("jax_ep_fp8")
  for r in records:
    t = times[r["impl"]]
    r["fused_target_us"] = None if base is None else FUSED_BAR * base * 1e6
    r["ratio_to_unfused"] = None if (t is None or base is None) else t / base
    timing = "-" if t is None else f"{t * 1e3:8.3f} ms"
    print(f"  T={shape.tokens:5d} R={r_count} {r['impl']:14s} {timing:>11s}"
          + ("" if r["share_of_floor"] is None else f"  {r['share_of_floor']:.2f} of its FLOP floor")
          + ("" if r["gemm_us"] is None else
             f"  GEMMs {r['gemm_us']:.0f} us, the rest {r['outside_gemms_us']:.0f} us"), flush=True)
    for name, us in (r["kernel_parts"] or {}).items():
      print(f"      {us:9.1f} us  {name}", flush=True)
  return records


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
  ap.add_argument("--quick", action="store_true", help="fewer iterations")
  ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
  args = ap.parse_args(argv)
  gpus = bn.require_two_gpus("bench_mega_moe", need=1)
  if gpus is None:
    return 2
  records = run(bm.MoEShape(tokens=args.tokens), quick=args.quick)
  bn.run_records.stamp(records, bn._machine(gpus))
  bn.write_records(records, args.out, "mega_moe")
  return 0


if __name__ == "__main__":
  sys.exit(main())
