"""Where the normal dispatch's setup kernel spends its time, phase by phase
(the 14-25 µs of prep and control per dispatch at EP1, 20-33 µs at EP2,
benchmarks/RESULTS.md; the setup kernel: docs/design.md §1). Runs a chain of dispatches per layout at the Normal shape (BF16,
24 SMs) in a child process of a jax_ep built with JAX_EP_SETUP_STAMPS=ON
(pip install -e . -Ccmake.define.JAX_EP_SETUP_STAMPS=ON), whose setup kernels
note the global timer after each phase of the control block and at the
start and end of every prep block (ffi/kernels/dispatch_setup.cu, `Stamp`); the
median over the chain's calls, µs from the control block's start, per phase.

  JAX_EP_BENCH_RANKS=1 python benchmarks/setup_stamps.py [--out DIR] [--calls N]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LINE = re.compile(r"jax_ep setup stamps \((rank|expert) layout\), us:(.*)")


def parse(text: str) -> dict[str, dict[str, float]]:
  """{layout: {phase: median µs}} of the stamp lines in `text` (the first
  call of each layout, the compile-time warm-up, left out)."""
  per: dict[str, dict[str, list[float]]] = {}
  seen: dict[str, int] = {}
  for m in LINE.finditer(text):
    layout, rest = m.group(1), m.group(2)
    seen[layout] = seen.get(layout, 0) + 1
    if seen[layout] == 1:
      continue
    vals = per.setdefault(layout, {})
    for part in rest.split("|"):
      part = part.strip()
      if part.startswith(("rank prep", "expert prep")):
        head, _, tail = part.partition(":")
        kind = head.split()[0]
        for item in tail.split(","):
          key, num = item.strip().rsplit(" ", 1)
          vals.setdefault(f"{kind}_prep_{key.replace(' ', '_')}", []).append(float(num))
      else:
        toks = part.split()
        for key, num in zip(toks[0::2], toks[1::2]):
          vals.setdefault(key, []).append(float(num))
  return {lay: {k: statistics.median(v) for k, v in d.items()} for lay, d in per.items()}


def child(calls: int) -> None:
  import functools
  import jax
  import numpy as np
  from jax.sharding import Mesh
  import jax_ep
  import bench_normal as bn
  from jax_ep._window import normal_bytes as window_bytes_needed
  shape = bn.Shape()
  mesh = Mesh(np.array(jax.devices()[:shape.ranks]), ("ep",))
  x, idx, w = bn._routing(jax.random.PRNGKey(0), shape)
  nbytes = max(1 << 30, window_bytes_needed(num_ranks=shape.ranks, tokens_per_rank=shape.tokens,
                                            hidden=shape.hidden, topk=shape.topk,
                                            num_experts=shape.experts))
  comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes)
  try:
    for layout in ("rank", "expert"):
      f = jax.jit(jax_ep.shard_map(functools.partial(
          lambda x, i, w, layout: jax_ep.dispatch(x, i, w, num_experts=shape.experts, layout=layout,
                                                  num_sms=24, backend="cuda").recv_x,
          layout=layout), mesh=mesh))
      jax.block_until_ready(f(x, idx, w))
      outs = [f(x, idx, w) for _ in range(calls)]
      jax.block_until_ready(outs)
      del outs
  finally:
    comm.close()
  sys.stderr.flush()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
  ap.add_argument("--calls", type=int, default=30)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    child(args.calls)
    return 0
  import bench_normal as bn
  gpus = bn.require_two_gpus("setup_stamps", need=1)
  if gpus is None:
    return 2
  import jax_ep
  if not jax_ep.build_info().get("setup_stamps"):
    print("setup_stamps: this jax_ep was built without the stamps; rebuild with "
          "pip install -e . -Ccmake.define.JAX_EP_SETUP_STAMPS=ON", file=sys.stderr)
    return 2
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--calls", str(args.calls)],
                        capture_output=True, text=True, timeout=600)
  got = parse(proc.stderr)
  if proc.returncode != 0 or not got:
    print(f"setup_stamps: child exited {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}", file=sys.stderr)
    return 1
  for layout, phases in got.items():
    print(f"  {layout:6s} " + "  ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
  rec = dict(bench="setup_stamps", impl="jax_ep", ranks=bn.Shape().ranks, calls=args.calls,
             phases_us=got)
  bn.run_records.stamp([rec], bn._machine(gpus[:bn.Shape().ranks]))
  bn.write_records([rec], args.out, "setup_stamps")
  return 0


if __name__ == "__main__":
  sys.exit(main())
