"""Normal dispatch and combine at the Normal shape, a few calls each, for a
kernel profiler (no jax.profiler here: it would hold CUPTI), e.g.

  ncu --clock-control none -k regex:CombineDataKernel -s 2 -c 1 \
      --section SpeedOfLight --section WarpStateStats \
      python3 scripts/profile_normal_kernels.py --layout expert

(-s 2 skips the warm-up calls). Runs on the first min(2, #GPUs) GPUs.
"""
import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_normal  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--layout", choices=("rank", "expert"), default="expert")
ap.add_argument("--calls", type=int, default=3)
ap.add_argument("--num-sms", type=int, default=24)
args = ap.parse_args()

import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep._ffi_dispatch import window_bytes_needed  # noqa: E402

gpus = jax.devices()[:2]
shape = bench_normal.Shape(ranks=len(gpus))
mesh = Mesh(np.array(gpus), ("ep",))
x, topk_idx, w = bench_normal._routing(jax.random.PRNGKey(0), shape)
smap = functools.partial(jax_ep.shard_map, mesh=mesh)
kw = dict(num_experts=shape.experts, axis_name="ep", layout=args.layout, num_sms=args.num_sms,
          backend="cuda")
nbytes = max(1 << 30, window_bytes_needed(num_ranks=len(gpus), tokens_per_rank=shape.tokens,
                                          hidden=shape.hidden, topk=shape.topk,
                                          num_experts=shape.experts))
with jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes):
  disp = jax.jit(smap(lambda x, i, w: jax_ep.dispatch(x, i, w, **kw)))
  comb = jax.jit(smap(lambda y, hd, wr: jax_ep.combine(y, hd, wr, num_sms=args.num_sms,
                                                       backend="cuda")))
  for _ in range(args.calls):
    out = disp(x, topk_idx, w)
    wr = out.recv_topk_weights if args.layout == "expert" else out.recv_topk_weights.max(axis=-1)
    jax.block_until_ready(comb(out.recv_x, out.handle, wr))
print("done", args.layout, shape)
