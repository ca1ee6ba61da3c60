"""Where a chain of small calls spends its time (one GPU): for a chain of
Engram fetches, a chain of jax_ep layout calls and a chain of XLA
elementwise ops (and Engram publishes), the wall time per call, the GPU's
busy time per call, the median gap between the starts of consecutive
kernels on the GPU, the wall time each call added to a chain twice as long
and the kernels the profile saw per call (1.00: no call was dropped). Each
in two forms: the step returns every call's output (`all`, the benchmarks'
form), or one digest of them all (`digest`, bench_normal._digest: every
call stays live and the step returns one buffer).

  python benchmarks/trace_chain.py [--out DIR]   (writes trace_chain.json)
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_normal as bn  # noqa: E402

ITERS = 50


def _profile(fn, args, kernel: Optional[str], digest=None) -> dict:
  wall = bn._time_step(fn, args, iters=ITERS, repeats=7, digest=digest)
  # The step's fixed cost drops out of the difference of two chain lengths;
  # what each returned output costs does not (unless `digest` returns one).
  twice = bn._time_step(fn, args, iters=2 * ITERS, repeats=7, digest=digest)
  slope = (twice * 2 * ITERS - wall * ITERS) / ITERS
  t = bn.trace_us(fn, args, kernel, 1, ITERS, digest=digest)
  return dict(wall_us=wall * 1e6, slope_us=slope * 1e6, gpu_busy_us=t["gpu_us"],
              kernel_us=t["kernel_us"], start_gap_us=t["gap_us"],
              kernels_per_call=t["kernels_per_call"])


def _both(fn, args, kernel: Optional[str], mesh) -> dict:
  return dict(all=_profile(fn, args, kernel), digest=_profile(fn, args, kernel, digest=mesh))


def main(argv=None) -> int:
  args = bn.simple_args(__doc__, argv)
  gpus = bn.require_two_gpus("trace_chain", need=1)
  if gpus is None:
    return 2
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_ep
  from jax_ep._ffi import engram as _ffi_engram

  mesh = Mesh(np.array(gpus[:1]), ("ep",))
  smap = lambda f: jax_ep.shard_map(f, mesh=mesh)  # noqa: E731
  rng = np.random.default_rng(0)
  VL, D, T, E = 524288, 128, 512, 24
  table = jax.device_put(jnp.asarray(rng.standard_normal((VL, D)), jnp.bfloat16),
                         NamedSharding(mesh, P("ep")))
  idx = jax.device_put(rng.integers(0, VL, (T, E)).astype(np.int32), NamedSharding(mesh, P("ep")))
  import bench_engram
  nbytes = bench_engram.window_bytes(bench_engram.Shape(rows_per_rank=VL, dim=D))
  out = {}
  with jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes) as comm:
    cid = comm.comm_id
    token = jax.block_until_ready(jax.jit(smap(lambda t: _ffi_engram.publish(t, comm_id=cid)))(table))
    fetch = smap(lambda tok, i: _ffi_engram.fetch(tok, i, rows_per_rank=VL, dim=D,
                                                       dtype=jnp.bfloat16, comm_id=cid))
    out["engram_fetch"] = _both(fetch, (token, idx), "EngramFetchKernel", mesh)
    publish = smap(lambda t: _ffi_engram.publish(t, comm_id=cid))
    out["engram_publish"] = _both(publish, (table,), "memcpy", mesh)
    topk = jax.device_put(np.stack([rng.permutation(256)[:8] for _ in range(4096)]).astype(np.int32),
                          NamedSharding(mesh, P("ep")))
    layout = smap(lambda i: jax_ep.get_dispatch_layout(i, num_experts=256, axis_name="ep",
                                                       backend="cuda"))
    out["dispatch_layout"] = _both(layout, (topk,), "Layout", mesh)
    comm.check()
  x = jax.device_put(jnp.asarray(rng.standard_normal((T, E, D)), jnp.bfloat16),
                     NamedSharding(mesh, P("ep")))
  out["xla_elementwise"] = _both(smap(lambda v: v * 1.0001), (x,), None, mesh)
  print(f"{'chain of ' + str(ITERS):25s} {'wall/call':>9s} {'added':>7s} "
        f"{'busy':>7s} {'kernel':>7s} {'gap':>7s} {'k/call':>6s}  (us)")
  for k, forms in out.items():
    for form, r in forms.items():
      print(f"{k + ' ' + form:25s} {bn.fmt(r['wall_us']):>9s} {bn.fmt(r['slope_us']):>7s} {bn.fmt(r['gpu_busy_us']):>7s} "
            f"{bn.fmt(r['kernel_us']):>7s} {bn.fmt(r['start_gap_us']):>7s} {bn.fmt(r['kernels_per_call'], '6.2f')}")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "trace_chain.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"json: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
