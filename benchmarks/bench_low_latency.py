"""docs/design.md §6 "Low-latency" benchmark: decode-sized dispatch / combine at EP=2.

128 tokens/rank, H=7168, top-8 of 256 experts (uniform random, distinct),
max_tokens = 128, FP8 (cast in the op) and BF16 dispatch, BF16 combine.
Measured in the same process run:
  jax_ep          low_latency_dispatch / low_latency_combine(backend="cuda"):
                  the low-latency kernels (docs/low_latency.md), fused, and
  jax_ep_split    as *_start + *_done; each first checked against the
                  reference (counts, valid rows, combine bits) and left out,
                  saying why, if it disagrees
  jax_ep_checked  the fused ops on a checked Communicator (docs/errors.md),
                  for checked mode's cost
  reference       low_latency_*(backend="reference")
  jax_all_to_all  one row per (token, rank) + dense lax.all_to_all (the
                  strongest JAX-native pipeline of bench_normal), dispatch and
                  combine at the same token count

The reference writes the whole [E_l, R * max_tokens, H] grid (470 MB per
rank at this shape in BF16); the kernels write only the valid rows (rows
past the counts are unspecified by contract). Times are medians of
jitted steps of chained calls (bench_normal._time_step: 50 calls per step
for the kernels, with the profiler's kernel time per call and
`digest_us`, the chain returning one digest of its outputs
(bench_normal.digest_times), beside them; at most 8 for the others, whose
grids are large); the L2 is not
flushed between calls. JAX_EP_BENCH_RANKS=1 runs it on one GPU (EP1: local
rows only, launch and kernel overheads; no copy-engine ceiling).

  python benchmarks/bench_low_latency.py [--quick] [--out DIR]

Exits 2 (measuring nothing, writing nothing) without the GPUs or the CUDA build.
"""
from __future__ import annotations

import functools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_normal  # noqa: E402

MAX_TOKENS = 128
KERNEL_CHAIN = 50   # calls per jitted step on the kernels, as a decode loop sees them


def run(shape: bench_normal.Shape, *, quick: bool) -> list[dict]:
  import jax
  from jax.sharding import Mesh
  import jax_ep

  devices = jax.devices()[:shape.ranks]
  mesh = Mesh(np.array(devices), ("ep",))
  x, topk_idx, w = bench_normal._routing(jax.random.PRNGKey(1), shape)
  idx_np = np.asarray(topk_idx)
  smap = functools.partial(jax_ep.shard_map, mesh=mesh)
  e, h = shape.experts, shape.hidden
  kw = dict(num_experts=e, max_tokens=MAX_TOKENS, axis_name="ep")
  results: list[dict] = []

  def bench(name, impl, dtype, fn, args, row_bytes, *, chain=8, kernel=None):
    """`chain` calls per jitted step (the kernels: KERNEL_CHAIN); `kernel`: the kernel-name substring whose
    profiler time per call is recorded next to the wall time."""
    t = bench_normal.time_or_none(f"{name}/{impl}/{dtype}", fn, args, quick, max_iters=chain)
    if t is None:
      return
    nv, lg = bench_normal._bytes(idx_np, shape, row_bytes)
    rec = dict(bench=name, impl=impl, dtype=dtype, tokens_per_rank=shape.tokens,
               hidden=h, topk=shape.topk, experts=e, ranks=shape.ranks,
               max_tokens=MAX_TOKENS, time_us=t * 1e6, nvlink_gbps=nv / t / 1e9,
               logical_gbps=lg / t / 1e9, sms=None, calls_per_step=chain)
    if kernel is not None:
      tr = bench_normal.trace_us(fn, args, kernel, shape.ranks)
      rec.update(sms=ll_sms(shape), kernel_us=tr["kernel_us"], chain_gap_us=tr["gap_us"],
                 kernel_parts=tr["kernel_parts"], kernels_per_call=tr["kernels_per_call"],
                 **bench_normal.digest_times(fn, args, mesh, kernel, shape.ranks, iters=chain))
    results.append(rec)
    f1 = bench_normal.fmt
    extra = "" if kernel is None else (f"  kernel {f1(rec['kernel_us'])} us, {f1(rec['chain_gap_us'])} us "
                                       f"apart in the chain, {rec['sms']} SMs; digest chain "
                                       f"{f1(rec['digest_us'])} us/call, "
                                       f"{f1(rec['digest_kernels_per_call'], '.2f')} kernels/call")
    print(f"  {name:20s} {impl:22s} {dtype:5s} {t * 1e6:10.1f} us{extra}", flush=True)

  bf16_row, fp8_row = h * 2, h + (h // 128) * 4
  reserved, nbytes = windows(shape)
  comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes)
  bench_normal.run_records.note_communicator(comm)
  try:
    _kernel_records(bench, smap, kw, x, topk_idx, w, reserved, fp8_row, bf16_row)
    for dtype, fp8, row in (("fp8", True, fp8_row), ("bf16", False, bf16_row)):
      f = smap(lambda x, i, q=fp8: jax_ep.low_latency_dispatch(
          x, i, fp8=q, backend="reference", **kw).recv_x)
      bench("low_latency_dispatch", "reference", dtype, f, (x, topk_idx), row)
    o = jax.jit(smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, backend="reference", **kw)))(
        x, topk_idx)
    y = o.recv_x  # [R * E_l, R * max_tokens, H] bf16, a stand-in for expert outputs
    fc = smap(lambda y, i, w, hd: jax_ep.low_latency_combine(
        y, i, w, hd, axis_name="ep", backend="reference"))
    bench("low_latency_combine", "reference", "bf16", fc, (y, topk_idx, w, o.handle), bf16_row)
    fd = smap(functools.partial(bench_normal._dense_all_to_all_dispatch, shape=shape, axis="ep"))
    bench("low_latency_dispatch", "jax_all_to_all", "bf16", fd, (x, topk_idx), bf16_row)
    yd = jax.jit(fd)(x, topk_idx)
    fdc = smap(functools.partial(bench_normal._dense_all_to_all_combine, shape=shape, axis="ep"))
    bench("low_latency_combine", "jax_all_to_all", "bf16", fdc, (yd, topk_idx, w), bf16_row)
    comm.check()
  finally:
    comm.close()
  # Checked mode (docs/errors.md): the fused ops again on a checked
  # Communicator (every op waits for its kernels and fails the program that
  # caused an error); their cost against jax_ep above.
  comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes, checked=True)
  try:
    kd = dict(kw, reserved_bytes=reserved, backend="cuda")
    bench("low_latency_dispatch", "jax_ep_checked", "bf16",
          smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, **kd).recv_x), (x, topk_idx),
          bf16_row, chain=KERNEL_CHAIN, kernel="LlDispatchKernel")
    o = jax.jit(smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, **kd)))(x, topk_idx)
    y = jax.jit(smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, backend="reference", **kw).recv_x))(
        x, topk_idx)
    bench("low_latency_combine", "jax_ep_checked", "bf16",
          smap(lambda y, i, w, hd: jax_ep.low_latency_combine(
              y, i, w, hd, reserved_bytes=reserved, backend="cuda")),
          (y, topk_idx, w, o.handle), bf16_row, chain=KERNEL_CHAIN, kernel="LlCombineKernel")
    comm.check()
  finally:
    comm.close()
  return results


def _kernel_records(bench, smap, kw, x, topk_idx, w, reserved, fp8_row, bf16_row) -> None:
  """The public ops on the kernels (backend="cuda"), fused and split, after
  an agreement check with the reference at this shape (a disagreement is
  reported and that form left out, not timed)."""
  import jax
  import numpy as np
  import jax_ep

  def bits(a):  # raw bytes, so NaN patterns compare too
    return np.ascontiguousarray(a).view(np.uint8)

  ref_o = jax.jit(smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, backend="reference", **kw)))
  kd = dict(kw, reserved_bytes=reserved, backend="cuda")
  for dtype, fp8, row in (("fp8", True, fp8_row), ("bf16", False, bf16_row)):
    fused = lambda x, i, q=fp8: jax_ep.low_latency_dispatch(x, i, fp8=q, **kd)
    split = lambda x, i, q=fp8: jax_ep.low_latency_dispatch_done(
        jax_ep.low_latency_dispatch_start(x, i, fp8=q, **kd))
    want = jax.jit(smap(lambda x, i, q=fp8: jax_ep.low_latency_dispatch(
        x, i, fp8=q, backend="reference", **kw)))(x, topk_idx)
    for impl, f in (("jax_ep", fused), ("jax_ep_split", split)):
      try:
        got = jax.jit(smap(f))(x, topk_idx)
        counts = np.asarray(want.recv_count).reshape(-1)
        ok = np.array_equal(np.asarray(got.recv_count), np.asarray(want.recv_count)) and \
            np.array_equal(np.asarray(got.handle.src_entry), np.asarray(want.handle.src_entry))
        m = np.asarray(jax.tree.leaves(want.recv_x)[0]).shape[1]
        valid = np.arange(m)[None, :] < counts[:, None]
        for a, b in zip(jax.tree.leaves(got.recv_x), jax.tree.leaves(want.recv_x)):
          ok &= np.array_equal(bits(np.asarray(a))[valid], bits(np.asarray(b))[valid])
      except Exception as e:  # noqa: BLE001 - a new kernel must not hide the others
        print(f"  low_latency_dispatch {impl} {dtype}: FAILED: {type(e).__name__}: {str(e)[:300]}",
              flush=True)
        continue
      if not ok:
        print(f"  low_latency_dispatch {impl} {dtype}: DISAGREES with the reference; not timed",
              flush=True)
        continue
      bench("low_latency_dispatch", impl, dtype, smap(lambda x, i, f=f: f(x, i).recv_x),
            (x, topk_idx), row, chain=KERNEL_CHAIN, kernel="LlDispatchKernel")
  o = ref_o(x, topk_idx)
  y = o.recv_x
  want = jax.jit(smap(lambda y, i, w, hd: jax_ep.low_latency_combine(
      y, i, w, hd, axis_name="ep", backend="reference")))(y, topk_idx, w, o.handle)
  ckw = dict(axis_name="ep", reserved_bytes=reserved, backend="cuda")
  fused = lambda y, i, w, hd: jax_ep.low_latency_combine(y, i, w, hd, **ckw)
  split = lambda y, i, w, hd: jax_ep.low_latency_combine_done(
      jax_ep.low_latency_combine_start(y, i, w, hd, **ckw))
  for impl, f in (("jax_ep", fused), ("jax_ep_split", split)):
    try:
      got = jax.jit(smap(f))(y, topk_idx, w, o.handle)
      ok = np.array_equal(bits(np.asarray(got)), bits(np.asarray(want)))
    except Exception as e:  # noqa: BLE001
      print(f"  low_latency_combine {impl}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    if not ok:
      print(f"  low_latency_combine {impl}: DISAGREES with the reference; not timed", flush=True)
      continue
    bench("low_latency_combine", impl, "bf16", smap(f), (y, topk_idx, w, o.handle), bf16_row,
          chain=KERNEL_CHAIN, kernel="LlCombineKernel")


def windows(shape: bench_normal.Shape) -> tuple[int, int]:
  """(reserved_bytes, the Communicator's num_bytes) at this shape: nothing
  else here uses the window, so the kernels' area starts at its base, as
  with the ops' default reserved_bytes."""
  from jax_ep import _window
  reserved = 0
  nbytes = _window.low_latency_bytes(
      num_ranks=shape.ranks, max_tokens=MAX_TOKENS, hidden=shape.hidden, topk=shape.topk,
      num_experts=shape.experts, reserved_bytes=reserved)
  return reserved, nbytes


def ll_sms(shape: bench_normal.Shape) -> int:
  """CTAs (one per SM) of a low-latency kernel at this shape: the handler's
  rule (ffi/kernels/low_latency.cu, Blocks) with the default num_sms, i.e.
  one per local expert or per 16 tokens, at most the device's SMs."""
  import jax
  sms = getattr(jax.devices()[0], "core_count", None) or 132
  work = max(-(-shape.tokens // 16), shape.experts // shape.ranks)
  return max(1, min(sms, work))


# What each impl ran, beside the record's `path` ("cuda" for all three).
PATH_DETAIL = {
    "jax_ep": "the public ops, fused: the dedicated low-latency kernels",
    "jax_ep_split": "the public ops as *_start + *_done",
    "jax_ep_checked": "the public ops, fused, on a checked Communicator",
}


def _with_path_detail(records: list[dict]) -> list[dict]:
  for r in records:
    if r.get("impl") in PATH_DETAIL:
      r["path_detail"] = PATH_DETAIL[r["impl"]]
  return records


def main(argv=None) -> int:
  args = bench_normal.simple_args(__doc__, argv)
  status, records, _ = bench_normal.measure_and_write(
      "bench_low_latency", "low_latency",
      lambda: _with_path_detail(run(bench_normal.Shape(tokens=128), quick=args.quick)), args.out)
  if status:
    return status
  print(bench_normal._table(records))
  return 0


if __name__ == "__main__":
  sys.exit(main())
