"""Where the time of one normal dispatch / combine goes, kernel by kernel.

Runs the Normal shape (bench_normal.Shape) through the CUDA backend under
jax.profiler (CUPTI kernel activity), then reads the Perfetto trace back and
prints, per GPU and per op, the median duration of each of our kernels, its
median start offset inside the call, and the median span of a whole call
(first kernel start to last kernel end). Launch gaps and barrier waits show
up as the difference between offsets and durations.

  python benchmarks/profile_normal.py [--tokens N] [--iters N] [--out DIR]

With --plain-calls N it only makes N plain dispatch + combine calls (no
jax.profiler, which would hold CUPTI), on one GPU or two, for a kernel
profiler, e.g.

  ncu --clock-control none -k regex:CombineDataKernel -s 2 -c 1 \
      --section SpeedOfLight --section WarpStateStats \
      python3 benchmarks/profile_normal.py --plain-calls 3 --layout expert

(-s 2 skips the first calls).
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_normal  # noqa: E402

# First kernel of each op's launch sequence: a call starts there.
_FIRST = {"dispatch": "DispatchSetupKernel", "combine": "CombineStartKernel"}


def _short(name: str) -> str:
  m = re.search(r"(\w+Kernel)", name)
  return m.group(1) if m else name[:40]


def _events(trace_dir: str) -> list[dict]:
  evs, pname = bench_normal.load_trace(trace_dir)
  out = []
  for e in evs:
    if e.get("ph") != "X":
      continue
    name = e.get("name", "")
    if "emcpy" in name:  # copies on the GPU (none in dispatch / combine since the copy-engine path went, 4e57e2a)
      if "GPU" not in pname.get(e["pid"], ""):
        continue  # the host-side cudaMemcpyAsync API events
      m = re.search(r"size[^0-9]*([0-9]+)", json.dumps(e.get("args", {})))
      mb = int(m.group(1)) / 1e6 if m else float("nan")
      label = "Memcpy(rows)" if mb != mb or mb > 0.01 else "Memcpy(flag)"
      out.append(dict(dev=pname.get(e["pid"], str(e["pid"])), name=label, ts=float(e["ts"]),
                      dur=float(e["dur"]), mb=mb))
      continue
    if "Kernel" not in name or not re.search(r"(Dispatch|Combine)\w*Kernel", name):
      continue
    out.append(dict(dev=pname.get(e["pid"], str(e["pid"])), name=_short(name),
                    ts=float(e["ts"]), dur=float(e["dur"])))
  return out


def summarize(evs: list[dict], op: str) -> list[dict]:
  first = _FIRST[op]
  prefix = "Dispatch" if op == "dispatch" else "Combine"
  rows = []
  by_dev = collections.defaultdict(list)
  for e in evs:
    if e["name"].startswith(prefix) or e["name"].startswith("Memcpy"):
      by_dev[e["dev"]].append(e)
  for dev, es in sorted(by_dev.items()):
    es.sort(key=lambda e: e["ts"])
    calls, cur = [], []
    for e in es:
      if e["name"] == first and cur:
        calls.append(cur)
        cur = []
      cur.append(e)
    if cur:
      calls.append(cur)
    calls = calls[1:] if len(calls) > 2 else calls  # the first call pays for warm-up
    spans = [c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls]
    # Start to start of consecutive calls: the GPU time per call in a chain,
    # with whatever XLA runs between calls.
    starts = [c[0]["ts"] for c in calls]
    periods = [b - a for a, b in zip(starts, starts[1:])] or [float("nan")]
    per = collections.defaultdict(lambda: ([], []))
    # The copies of a call: how many, their total time, when the last ends.
    copies = [[e for e in c if e["name"] == "Memcpy(rows)"] for c in calls]
    ce = dict(n=statistics.median([len(k) for k in copies]) if copies else 0)
    if any(copies):
      ce.update(busy_us=statistics.median([sum(e["dur"] for e in k) for k in copies if k]),
                last_end_us=statistics.median([max(e["ts"] + e["dur"] for e in k) - c[0]["ts"]
                                               for k, c in zip(copies, calls) if k]),
                gbps=statistics.median([sum(e["mb"] for e in k) * 1e3 / sum(e["dur"] for e in k)
                                        for k in copies if k]))
    timeline = [(e["name"], round(e["ts"] - calls[len(calls) // 2][0]["ts"], 1), round(e["dur"], 1))
                for e in calls[len(calls) // 2]]
    for c in calls:
      t0 = c[0]["ts"]
      for e in c:
        per[e["name"]][0].append(e["dur"])
        per[e["name"]][1].append(e["ts"] - t0)
    rows.append(dict(op=op, device=dev, calls=len(calls), span_us=statistics.median(spans),
                     period_us=statistics.median(periods), copies=ce, timeline=timeline,
                     kernels={k: dict(dur_us=statistics.median(d), start_us=statistics.median(s))
                              for k, (d, s) in per.items()}))
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--out", default=None)
  ap.add_argument("--layout", choices=("rank", "expert"), default="rank")
  ap.add_argument("--plain-calls", type=int, default=0,
                  help="only this many dispatch + combine calls, for ncu (one GPU is enough)")
  ap.add_argument("--num-sms", type=int, default=None)
  args = ap.parse_args(argv)
  gpus = bench_normal.require_two_gpus("profile_normal", need=1 if args.plain_calls else 2)
  if gpus is None:
    return 2
  import jax
  from jax.sharding import Mesh
  import jax_ep
  from jax_ep._window import normal_bytes as window_bytes_needed

  gpus = gpus[:2]
  shape = bench_normal.Shape(tokens=args.tokens, ranks=len(gpus))
  mesh = Mesh(np.array(gpus), ("ep",))
  x, topk_idx, w = bench_normal._routing(jax.random.PRNGKey(0), shape)
  smap = functools.partial(jax_ep.shard_map, mesh=mesh)
  disp = functools.partial(jax_ep.dispatch, num_experts=shape.experts, axis_name="ep",
                           layout=args.layout, num_sms=args.num_sms, backend="cuda")
  nbytes = max(1 << 30, window_bytes_needed(num_ranks=len(gpus), tokens_per_rank=shape.tokens,
                                            hidden=shape.hidden, topk=shape.topk,
                                            num_experts=shape.experts))
  rows = []
  with jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes):
    j_d = jax.jit(smap(disp))
    f_c = smap(lambda y, hd, wr: jax_ep.combine(y, hd, wr, num_sms=args.num_sms, backend="cuda"))
    out = j_d(x, topk_idx, w)
    # Rank-layout rows carry K weights; combine takes one per row.
    row_w = out.recv_topk_weights if args.layout == "expert" else out.recv_topk_weights.max(axis=-1)
    if args.plain_calls:
      j_c = jax.jit(f_c)
      for _ in range(args.plain_calls):
        out = j_d(x, topk_idx, w)
        jax.block_until_ready(j_c(out.recv_x, out.handle, row_w))
      return 0
    f_d = smap(lambda x, i, w: disp(x, i, w).recv_x)
    for op, fn, a in (("dispatch", f_d, (x, topk_idx, w)),
                      ("combine", f_c, (out.recv_x, out.handle, row_w))):
      t = bench_normal._time_step(fn, a, iters=args.iters, repeats=3)
      tdir = tempfile.mkdtemp(prefix=f"jax_ep_prof_{op}_")
      with jax.profiler.trace(tdir, create_perfetto_trace=True):
        bench_normal._time_step(fn, a, iters=args.iters, repeats=2)
      for r in summarize(_events(tdir), op):
        r["wall_us_per_call"] = t * 1e6
        rows.append(r)
  for r in rows:
    print(f"{r['op']} {r['device']}: {r['calls']} calls, span {r['span_us']:.1f} us, "
          f"start-to-start {r['period_us']:.1f} us (wall {r['wall_us_per_call']:.1f} us/call)")
    for k, v in sorted(r["kernels"].items(), key=lambda kv: kv[1]["start_us"]):
      print(f"   {k:32s} start {v['start_us']:8.1f}  dur {v['dur_us']:8.1f}")
    if r["copies"].get("n"):
      print(f"   copies: {r['copies']}")
      print(f"   one call: {r['timeline']}")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_normal.json"), "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
