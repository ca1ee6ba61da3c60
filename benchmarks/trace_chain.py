"""Where a chain of small calls spends its time (one GPU): for a chain of
Engram fetches, a chain of jax_ep layout calls and a chain of XLA
elementwise ops, the wall time per call, the GPU's busy time per call, the
median gap between the starts of consecutive kernels on the GPU, the wall
time each call added to a chain twice as long, and the
host-side trace events that occur once per call (name, mean µs). Wall well
above busy with kernels spaced by the host's per-call time means the host
enqueues no further ahead than one call: the per-call host cost is then on
the critical path.

  python benchmarks/trace_chain.py [--out DIR]   (writes trace_chain.json)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_normal as bn  # noqa: E402

ITERS = 50


def _profile(fn, args, kernel: Optional[str]) -> dict:
  wall = bn._time_step(fn, args, iters=ITERS, repeats=7)
  # The step's fixed cost drops out of the difference of two chain lengths;
  # what each returned output costs does not.
  slope = (bn._time_step(fn, args, iters=2 * ITERS, repeats=7) * 2 * ITERS - wall * ITERS) / ITERS
  evs, names = bn.profile_step(fn, args, ITERS)
  calls = 3 * ITERS  # profile_step's three steps
  t = bn.chain_times(bn._gpu_events(evs, names), kernel, calls)
  gpu = {p for p, n in names.items() if "GPU" in str(n)}
  host: dict[str, list[float]] = {}
  for e in evs:
    if e.get("ph") == "X" and e.get("pid") not in gpu and "dur" in e:
      host.setdefault(e.get("name", "?"), []).append(float(e["dur"]))
  per_call = sorted(((n, len(d), statistics.mean(d)) for n, d in host.items()
                     if calls <= len(d) <= 4 * calls), key=lambda t: -t[2])[:12]
  return dict(wall_us=wall * 1e6, slope_us=slope * 1e6, gpu_busy_us=t["gpu_us"],
              kernel_us=t["kernel_us"], start_gap_us=t["gap_us"],
              host_per_call=[dict(name=n[:80], count=c, mean_us=m) for n, c, m in per_call])


def main(argv=None) -> int:
  args = bn.simple_args(__doc__, argv)
  gpus = bn.require_two_gpus("trace_chain", need=1)
  if gpus is None:
    return 2
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_ep
  from jax_ep import _ffi_engram

  mesh = Mesh(np.array(gpus[:1]), ("ep",))
  smap = lambda f: jax_ep.shard_map(f, mesh=mesh)  # noqa: E731
  rng = np.random.default_rng(0)
  VL, D, T, E = 524288, 128, 512, 24
  table = jax.device_put(jnp.asarray(rng.standard_normal((VL, D)), jnp.bfloat16),
                         NamedSharding(mesh, P("ep")))
  idx = jax.device_put(rng.integers(0, VL, (T, E)).astype(np.int32), NamedSharding(mesh, P("ep")))
  nbytes = _ffi_engram.window_bytes_needed(rows_per_rank=VL, dim=D, dtype=jnp.bfloat16) + (8 << 20)
  out = {}
  with jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes) as comm:
    cid = comm.comm_id
    token = jax.block_until_ready(jax.jit(smap(lambda t: _ffi_engram.publish_cuda(t, comm_id=cid)))(table))
    fetch = smap(lambda tok, i: _ffi_engram.fetch_cuda(tok, i, rows_per_rank=VL, dim=D,
                                                       dtype=jnp.bfloat16, comm_id=cid))
    out["engram_fetch"] = _profile(fetch, (token, idx), "EngramFetchKernel")
    topk = jax.device_put(np.stack([rng.permutation(256)[:8] for _ in range(4096)]).astype(np.int32),
                          NamedSharding(mesh, P("ep")))
    layout = smap(lambda i: jax_ep.get_dispatch_layout(i, num_experts=256, axis_name="ep",
                                                       backend="cuda"))
    out["dispatch_layout"] = _profile(layout, (topk,), "Layout")
    comm.check()
  x = jax.device_put(jnp.asarray(rng.standard_normal((T, E, D)), jnp.bfloat16),
                     NamedSharding(mesh, P("ep")))
  out["xla_elementwise"] = _profile(smap(lambda v: v * 1.0001), (x,), None)
  for k, r in out.items():
    print(f"{k}: wall {r['wall_us']:.1f} us/call ({r['slope_us']:.1f} per added call), GPU busy {r['gpu_busy_us']:.1f}, kernel "
          f"{r['kernel_us'] if r['kernel_us'] is None else round(r['kernel_us'], 1)}, start gap "
          f"{r['start_gap_us'] if r['start_gap_us'] is None else round(r['start_gap_us'], 1)}")
    for h in r["host_per_call"]:
      print(f"    host {h['mean_us']:8.1f} us x{h['count']:5d}  {h['name']}")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "trace_chain.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"json: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
