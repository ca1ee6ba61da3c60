"""Plain calls of the small ops' kernels for a kernel profiler (Nsight Compute):
the low-latency dispatch (BF16, FP8) and combine kernels and the Engram fetch
at their docs/design.md §6 shapes, `--calls` times each, nothing else timed
and no jax.profiler (which would hold CUPTI). For example

  ncu --clock-control none -k regex:LlDispatchKernel -s 2 -c 1 --set full \\
      python3 benchmarks/profile_small.py --op ll_dispatch --calls 4

(-s 2 skips the first calls: compile-time warm-up). JAX_EP_BENCH_RANKS=1
runs on one GPU.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

OPS = ("ll_dispatch", "ll_dispatch_fp8", "ll_combine", "engram_fetch")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--op", choices=OPS, required=True)
  ap.add_argument("--calls", type=int, default=4)
  args = ap.parse_args(argv)
  import bench_normal
  if bench_normal.require_two_gpus("profile_small", need=1) is None:
    return 2
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_ep

  if args.op == "engram_fetch":
    import bench_engram
    from jax_ep._ffi import engram as _ffi_engram
    import jax.numpy as jnp
    shape = bench_engram.Shape()
    mesh = Mesh(np.array(jax.devices()[:shape.ranks]), ("ep",))
    smap = functools.partial(jax_ep.shard_map, mesh=mesh)
    table, _, _ = bench_engram._tables(shape, mesh)
    idx = jax.device_put(bench_engram._indices(shape), NamedSharding(mesh, P("ep")))
    with jax_ep.Communicator.create(mesh, "ep", num_bytes=bench_engram.window_bytes(shape)) as comm:
      tok = jax.jit(smap(lambda t: _ffi_engram.publish(t, comm_id=comm.comm_id)))(table)
      f = jax.jit(smap(lambda t, i: _ffi_engram.fetch(
          t, i, rows_per_rank=shape.rows_per_rank, dim=shape.dim, dtype=jnp.bfloat16,
          comm_id=comm.comm_id)))
      for _ in range(args.calls):
        jax.block_until_ready(f(tok, idx))
    return 0

  import bench_low_latency as bll
  shape = bench_normal.Shape(tokens=bll.MAX_TOKENS)
  mesh = Mesh(np.array(jax.devices()[:shape.ranks]), ("ep",))
  smap = functools.partial(jax_ep.shard_map, mesh=mesh)
  x, topk_idx, w = bench_normal._routing(jax.random.PRNGKey(1), shape)
  kw = dict(num_experts=shape.experts, max_tokens=bll.MAX_TOKENS, axis_name="ep")
  reserved, nbytes = bll.windows(shape)  # the benchmark's window, so the same layout
  with jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes):
    fp8 = args.op == "ll_dispatch_fp8"
    d = jax.jit(smap(lambda x, i: jax_ep.low_latency_dispatch(
        x, i, fp8=fp8, reserved_bytes=reserved, backend="cuda", **kw)))
    if args.op != "ll_combine":
      for _ in range(args.calls):
        jax.block_until_ready(d(x, topk_idx))
      return 0
    o = jax.jit(smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, backend="reference", **kw)))(
        x, topk_idx)
    c = jax.jit(smap(lambda y, i, w, hd: jax_ep.low_latency_combine(
        y, i, w, hd, reserved_bytes=reserved, backend="cuda")))
    for _ in range(args.calls):
      jax.block_until_ready(c(o.recv_x, topk_idx, w, o.handle))
  return 0


if __name__ == "__main__":
  sys.exit(main())
