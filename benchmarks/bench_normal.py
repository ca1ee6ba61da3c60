"""docs/design.md §6 "Normal" benchmark: MoE dispatch / combine at EP=2 on one host.

4096 tokens/rank, H=7168, top-8 of 256 experts (uniform random, distinct),
BF16 and FP8 dispatch, BF16 combine, rank layout (DeepEP "normal"). Measured in
the same process run:
  jax_ep                  the CUDA kernels (backend="cuda"), remote rows by SM NVLink stores
  reference               jax_ep's pure-JAX backend (backend="reference")
  jax_ragged_all_to_all   sort by expert + lax.ragged_all_to_all (MaxText style); then
                          jax_ragged_all_to_all[mode], the same under each XLA flag of
                          RAGGED_XLA_MODES, one process each (a refused flag is recorded)
  jax_capacity_all_to_all per-expert capacity-padded lax.all_to_all (factor 1.25)
  jax_all_to_all          one row per (token, destination rank) + dense all_to_all
  copy_engine             bidirectional 256 MB cudaMemcpyPeerAsync (cupy), the ceiling

Bandwidth: `nvlink_gbps` counts the bytes that had to cross NVLink for the
op (rows sent to the other ranks; the same figure for every impl, so ratios
compare times), `logical_gbps` DeepEP's figure including local rows. Times are
medians over repeats of a jitted step that runs the op `iters` times
back-to-back (each call chained to the previous one through
lax.optimization_barrier so XLA cannot hoist or merge them), divided by `iters`.
--sweep sizes `iters` per variant and size (chain_calls: at least 50 calls and
about 50 ms of their work per step, so the step's own launch + sync is spread
thin at the small sizes), keeps one digest of jax_ep's outputs per step
instead of all of them (XLA's baselines keep all: XLA could shrink them to
the digest), and records the profiler's kernel time per call of jax_ep.

  python benchmarks/bench_normal.py [--quick] [--sweep] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

import records as run_records

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = run_records.RESULTS_DIR


@dataclasses.dataclass
class Shape:
  tokens: int = 4096
  hidden: int = 7168
  topk: int = 8
  experts: int = 256
  ranks: int = int(os.environ.get("JAX_EP_BENCH_RANKS", "2"))  # EP size (docs/design.md §6: 2)


# ---------------------------------------------------------------- helpers

_commit = run_records.commit
_machine = run_records.machine


def _routing(key, shape: Shape):
  """Global [R*T, K] distinct uniform experts, weights, and x."""
  import jax
  import jax.numpy as jnp
  n = shape.ranks * shape.tokens
  k1, k2, k3 = jax.random.split(key, 3)
  scores = jax.random.uniform(k1, (n, shape.experts))
  topk_idx = jnp.argsort(scores, axis=1)[:, :shape.topk].astype(jnp.int32)
  w = jax.random.uniform(k2, (n, shape.topk), jnp.float32, 0.1, 1.0)
  x = jax.random.normal(k3, (n, shape.hidden), jnp.float32).astype(jnp.bfloat16)
  return x, topk_idx, w


def _bytes(topk_idx: np.ndarray, shape: Shape, row_bytes: int,
           per_expert: bool = False) -> tuple[float, float]:
  """(NVLink bytes, logical bytes) per rank, averaged over ranks: one row
  per (token, destination rank), or with `per_expert` one per (token,
  expert) (what expert-layout combine moves)."""
  e_l = shape.experts // shape.ranks
  t = shape.tokens
  nv, lg = [], []
  for r in range(shape.ranks):
    ids = topk_idx[r * t:(r + 1) * t]
    dest = np.where(ids >= 0, ids // e_l, -1)
    if per_expert:
      rows_all = int((dest >= 0).sum())
      rows_remote = rows_all - int((dest == r).sum())
      nv.append(rows_remote * row_bytes)
      lg.append(rows_all * row_bytes)
      continue
    in_rank = np.stack([(dest == j).any(axis=1) for j in range(shape.ranks)], axis=1)
    rows_all = in_rank.sum()
    rows_remote = rows_all - in_rank[:, r].sum()
    nv.append(rows_remote * row_bytes)
    lg.append(rows_all * row_bytes)
  return float(np.mean(nv)), float(np.mean(lg))


def _digest(outs, mesh) -> Any:
  """One small array holding the first element of every rank's shard of
  every output leaf (each leaf split over the mesh's first axis, as
  jax_ep.shard_map gives them): every call stays live, and the step returns
  one buffer instead of one per call. Built per rank, so it adds no
  collective."""
  import jax
  import jax.numpy as jnp
  import jax_ep

  def local(*leaves):
    return jnp.stack([l.reshape(-1)[0].astype(jnp.float32) if l.size else jnp.float32(0) for l in leaves])

  leaves = jax.tree.leaves(outs)
  axis = mesh.axis_names[0]
  return jax_ep.shard_map(local, mesh=mesh, axis_name=axis)(*leaves)


def _chain(fn: Callable, iters: int, digest=None) -> Callable:
  """A jitted step of `iters` chained calls of `fn`; with `digest` (the
  mesh), returning their _digest instead of every output."""
  import jax
  from jax import lax

  def step(*a):
    # Every call's output is returned, or a digest of them all: a step
    # returning only the last one let XLA drop 49 of 50 Engram fetches,
    # barrier or not (trace_chain at e4e1a39: 0.02 kernels per call). No
    # reduction across ranks: that would add a collective. The barrier makes
    # each call's inputs look new, so XLA cannot merge the calls.
    carry, outs = a, []
    for _ in range(iters):
      out = fn(*carry)
      carry, out = lax.optimization_barrier((carry, out))
      outs.append(out)
    return outs if digest is None else _digest(outs, digest)

  return jax.jit(step)


def _time_chain(jstep: Callable, args, repeats: int) -> float:
  """Median seconds per step of an already compiled and warmed `_chain`."""
  import jax
  jax.block_until_ready(jstep(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(jstep(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _time_step(fn: Callable, args, *, iters: int, repeats: int, digest=None) -> float:
  """Median seconds per call of `fn`, `iters` chained calls per jitted step
  (`digest`: _chain's)."""
  import jax
  jstep = _chain(fn, iters, digest)
  jax.block_until_ready(jstep(*args))  # compile + warm-up
  return _time_chain(jstep, args, repeats) / iters


# The sweep's chain length (chain_calls): every jitted step runs at least
# SWEEP_MIN_CALLS calls and about SWEEP_STEP_S of their work, at most
# SWEEP_MAX_CALLS (compile time grows with it).
SWEEP_STEP_S = 50e-3
SWEEP_MIN_CALLS = 50
SWEEP_MAX_CALLS = 1000
SWEEP_PROBE_CALLS = 10  # the longer of the two steps that estimate a call's time


def chain_calls(per_call_s: float) -> int:
  """Calls per step for a call of `per_call_s` seconds (see SWEEP_STEP_S)."""
  want = SWEEP_STEP_S / per_call_s if per_call_s > 0 else SWEEP_MAX_CALLS
  return int(min(SWEEP_MAX_CALLS, max(SWEEP_MIN_CALLS, -(-want // 1))))


def _adaptive_iters(fn, args, quick: bool, sweep: bool = False, digest=None) -> tuple[int, int]:
  """Few iterations for slow baselines (ragged_all_to_all takes ~100 ms).
  `sweep`: chain_calls of the time per call, from the difference between a
  SWEEP_PROBE_CALLS-call and a 1-call step, so the step's own launch + sync
  (the same in both) drops out of the estimate; `digest` as for _chain."""
  t = _time_step(fn, args, iters=1, repeats=3 if sweep else 1, digest=digest)
  if t > 20e-3:
    return 1, 3
  if sweep:
    n = SWEEP_PROBE_CALLS
    tn = _time_step(fn, args, iters=n, repeats=3, digest=digest) * n
    per_call = (tn - t) / (n - 1) if tn > t else tn / n
    return chain_calls(per_call), 5
  if quick:
    return 5, 5
  # Many calls per step: the step's own launch + sync (~2 ms for 2 GPUs) is
  # spread over them instead of adding ~100 us to every call.
  return (50, 7) if t < 2e-3 else (5, 5)


def _kernel_label(name: str) -> str:
  """'void ns::(anonymous namespace)::FooKernel<int, true>(args)' -> 'FooKernel<int, true>'."""
  import re
  m = re.search(r"(\w+)(<[^()]*>)?\(", name)
  return (m.group(1) + (m.group(2) or "")) if m else name[:40]


def time_or_none(label: str, fn, args, quick: bool, max_iters: Optional[int] = None) -> Optional[float]:
  """Seconds per call of `fn` (adaptive iterations), or None after printing
  why it failed: a failing implementation must not hide the others."""
  try:
    iters, reps = _adaptive_iters(fn, args, quick)
    return _time_step(fn, args, iters=min(iters, max_iters or iters), repeats=reps)
  except Exception as e:  # noqa: BLE001
    print(f"  {label}: FAILED: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
    return None


def load_trace(trace_dir: str) -> tuple[list[dict], dict]:
  """(trace events, process id -> process name) of the newest Perfetto trace
  that jax.profiler wrote under trace_dir."""
  import glob
  import gzip
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise RuntimeError(f"no .trace.json.gz under {trace_dir}")
  with gzip.open(max(files, key=os.path.getmtime), "rt") as f:
    data = json.load(f)
  evs = data["traceEvents"] if isinstance(data, dict) else data
  names = {e["pid"]: e["args"]["name"] for e in evs
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return evs, names


def _gpu_events(evs: list[dict], names: dict) -> list[dict]:
  """Kernel and copy events (name, ts, dur in µs, and `line`: the GPU
  timeline's id, one per stream) on the GPU timelines; lines named XLA...
  (ops and modules spanning many kernels) are not kernels and are left out."""
  gpu_pids = {pid for pid, name in names.items() if "GPU" in str(name)}
  threads = {(e.get("pid"), e.get("tid")): str(e["args"].get("name", "")) for e in evs
             if e.get("ph") == "M" and e.get("name") == "thread_name" and "args" in e}
  return [dict(name=e.get("name", ""), ts=float(e["ts"]), dur=float(e["dur"]),
               line=(e.get("pid"), e.get("tid"))) for e in evs
          if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e
          and not threads.get((e.get("pid"), e.get("tid")), "").startswith("XLA")]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  out: list[tuple[float, float]] = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    else:
      out.append((a, b))
  return out


def concurrent_us(gpu_evs: list[dict], is_comm: Callable[[str], bool]) -> tuple[float, float]:
  """(µs of communication kernels, µs of them during which a kernel that is
  not communication ran on another line, i.e. stream): how much of the
  communication a profile shows overlapped with compute."""
  total = both = 0.0
  for line in {e["line"] for e in gpu_evs if is_comm(e["name"])}:
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu_evs
                   if e["line"] == line and is_comm(e["name"])])
    other = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu_evs
                    if e["line"] != line and not is_comm(e["name"])])
    total += sum(b - a for a, b in comm)
    j = 0
    for a, b in comm:
      while j < len(other) and other[j][1] <= a:
        j += 1
      k = j
      while k < len(other) and other[k][0] < b:
        both += min(b, other[k][1]) - max(a, other[k][0])
        k += 1
  return total, both


def gpu_kernel_events(trace_dir: str) -> list[dict]:
  """_gpu_events of the newest Perfetto trace jax.profiler wrote under trace_dir."""
  return _gpu_events(*load_trace(trace_dir))


def profile_step(fn, args, iters: int, digest=None) -> tuple[list[dict], dict]:
  """(trace events, process id -> name) of a jax.profiler trace of
  _time_step(fn, args, iters, repeats=1), which runs its step three times
  (two warm-ups, one timed)."""
  import tempfile
  import jax
  tdir = tempfile.mkdtemp(prefix="jax_ep_prof_")
  with jax.profiler.trace(tdir, create_perfetto_trace=True):
    _time_step(fn, args, iters=iters, repeats=1, digest=digest)
  return load_trace(tdir)


def chain_times(gpu_evs: list[dict], kernel: Optional[str], calls: int) -> dict:
  """Per call (µs), from the GPU events of `calls` calls: `kernel_us`, the
  GPU time of the events whose name contains `kernel`, any case (None:
  every event; what DeepEP reports); `gpu_us`, of every GPU event (the busy
  time); `gap_us`, the median start-to-start gap of consecutive such events
  of one name (what a call costs in a long chain, launch gaps included,
  without the step's own launch, sync and the returning of its outputs);
  `kernel_parts`, kernel_us per distinct name. None where nothing matches."""
  out = dict(kernel_us=None, gpu_us=None, gap_us=None, kernel_parts=None, kernels_per_call=0.0)
  mine = [e for e in gpu_evs if kernel is None or kernel.lower() in e["name"].lower()]
  out["kernels_per_call"] = len(mine) / calls
  if gpu_evs:
    out["gpu_us"] = sum(e["dur"] for e in gpu_evs) / calls
  if mine:
    out["kernel_us"] = sum(e["dur"] for e in mine) / calls
    # Per distinct kernel name (e.g. a split op's send and receive kernels).
    parts: dict[str, float] = {}
    for e in mine:
      parts[e["name"][:160]] = parts.get(e["name"][:160], 0.0) + e["dur"] / calls
    out["kernel_parts"] = parts
    # Start-to-start of one kernel name (a split op launches two kernels
    # per call: either one's period is the call's). Gaps between steps (the
    # host's step overhead) are far longer than a call: the median is a call's.
    first = min(mine, key=lambda e: e["ts"])["name"]
    starts = sorted(e["ts"] for e in mine if e["name"] == first)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    out["gap_us"] = statistics.median(gaps) if gaps else None
  return out


def trace_us(fn, args, kernel: Optional[str], ranks: int, iters: int = 50, digest=None) -> dict:
  """chain_times per call and per rank of a profiled `iters`-call step (each
  rank's GPU runs every call once; `digest`: _chain's); all None when the
  trace cannot be read."""
  try:
    evs, names = profile_step(fn, args, iters, digest=digest)
  except Exception as e:  # noqa: BLE001 - the profile must not hide the timings
    print(f"  profile {kernel}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return dict(chain_times([], kernel, 1), kernels_per_call=None)
  return chain_times(_gpu_events(evs, names), kernel, 3 * iters * ranks)


def digest_times(fn, args, mesh, kernel: Optional[str], ranks: int, iters: int = 50) -> dict:
  """The same chain returning one _digest of its outputs instead of all of
  them: `digest_us`, wall µs per call (no per-output return cost), and
  from its profile `digest_gpu_us` (busy time per call) and
  `digest_kernels_per_call` (of `kernel`; below 1: calls were dropped, and
  a busy time below the every-output chain's: XLA code around the kernel
  shrank to the digested elements). All None when it fails."""
  out = dict(digest_us=None, digest_gpu_us=None, digest_kernels_per_call=None)
  try:
    out["digest_us"] = _time_step(fn, args, iters=iters, repeats=7, digest=mesh) * 1e6
  except Exception as e:  # noqa: BLE001 - the digest must not hide the timings
    print(f"  digest {kernel}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return out
  tr = trace_us(fn, args, kernel, ranks, iters, digest=mesh)
  out.update(digest_gpu_us=tr["gpu_us"], digest_kernels_per_call=tr["kernels_per_call"])
  return out


def fmt(v, spec: str = ".1f") -> str:
  """`v` formatted, or '-' (padded to the spec's width) where it was not
  measured."""
  return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0] or 0))


def simple_args(doc: str, argv=None, flags: tuple[tuple[str, str], ...] = ()) -> argparse.Namespace:
  """--out / --quick, the options of the benchmark scripts that time one shape,
  and a script's own on/off `flags` ((name, help) pairs)."""
  ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
  ap.add_argument("--quick", action="store_true", help="fewer iterations")
  for name, text in flags:
    ap.add_argument(name, action="store_true", help=text)
  return ap.parse_args(argv)


def _machine_and_ceiling(name: str) -> Optional[tuple[str, Optional[float], str]]:
  """(machine, copy-engine GB/s per direction or None at EP1, its note) for
  the JAX_EP_BENCH_RANKS GPUs, or None (said why) without them."""
  ranks = Shape().ranks
  gpus = require_two_gpus(name, need=min(ranks, 2))
  if gpus is None:
    return None
  if ranks < 2:  # JAX_EP_BENCH_RANKS=1: launch and local-path figures, no link to measure
    return _machine(gpus[:ranks]), None, "EP1: nothing crosses a link"
  ce, ce_note = copy_engine_gbps(gpus[:2])
  print(f"copy engine: {ce:.1f} GB/s per direction ({ce_note})", flush=True)
  return _machine(gpus[:ranks]), ce, ce_note


def measure_and_write(name: str, json_name: str, run_fn: Callable[[], list[dict]],
                      out_dir: str) -> tuple[int, list[dict], Optional[str]]:
  """The frame of a two-GPU benchmark script: (exit status, records, JSON
  path). Exit 2 without 2 GPUs or the CUDA build, 1 when every
  implementation failed; else the copy-engine ceiling of the same run is
  added and the records are written."""
  frame = _machine_and_ceiling(name)
  if frame is None:
    return 2, [], None
  machine, ce, ce_note = frame
  records = run_fn()
  if not records:
    print(f"{name}: every implementation failed; nothing written", file=sys.stderr)
    return 1, [], None
  _finish(records, ce, ce_note, machine)
  return 0, records, write_records(records, out_dir, json_name)


def copy_engine_gbps(devices, nbytes: int = 256 << 20, repeats: int = 10) -> tuple[float, str]:
  """Per-direction GB/s of a bidirectional peer copy, both GPUs at once."""
  try:
    import cupy as cp
  except ImportError:
    return _device_put_gbps(devices, nbytes, repeats), "device_put (cupy missing: not the copy-engine ceiling)"
  ids = [d.id for d in devices[:2]]
  bufs, streams, events = {}, {}, {}
  for i in ids:
    with cp.cuda.Device(i):
      bufs[i] = (cp.empty(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8))
      bufs[i][0].fill(1)
      streams[i] = cp.cuda.Stream(non_blocking=True)
      events[i] = (cp.cuda.Event(), cp.cuda.Event())
  for a in ids:
    for b in ids:
      if a != b:
        with cp.cuda.Device(a):
          try:
            cp.cuda.runtime.deviceEnablePeerAccess(b)
          except cp.cuda.runtime.CUDARuntimeError:
            pass  # already enabled
  a, b = ids
  per = []
  for it in range(repeats + 2):
    for src, dst in ((a, b), (b, a)):
      with cp.cuda.Device(src):
        events[src][0].record(streams[src])
        cp.cuda.runtime.memcpyPeerAsync(bufs[dst][1].data.ptr, dst, bufs[src][0].data.ptr, src,
                                        nbytes, streams[src].ptr)
        events[src][1].record(streams[src])
    ms = []
    for src in (a, b):
      with cp.cuda.Device(src):
        events[src][1].synchronize()
        ms.append(cp.cuda.get_elapsed_time(events[src][0], events[src][1]))
    if it >= 2:
      per.append(nbytes / (max(ms) * 1e-3) / 1e9)
  return statistics.median(per), "copy_engine (cupy memcpyPeerAsync, both directions at once)"


def _device_put_gbps(devices, nbytes, repeats) -> float:
  import jax
  import jax.numpy as jnp
  x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), devices[0])
  jax.block_until_ready(jax.device_put(x, devices[1]))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(jax.device_put(x, devices[1]))
    ts.append(time.perf_counter() - t0)
  return nbytes / statistics.median(ts) / 1e9


# ---------------------------------------------------------------- baselines (per rank)

def _dense_all_to_all_dispatch(x, topk_idx, *, shape: Shape, axis: str):
  """One row per (token, destination rank), zero where the token does not go."""
  import jax.numpy as jnp
  from jax import lax
  e_l = shape.experts // shape.ranks
  dest = jnp.where(topk_idx >= 0, topk_idx // e_l, -1)
  in_rank = (dest[:, :, None] == jnp.arange(shape.ranks)).any(axis=1)  # [T, R]
  buf = jnp.where(in_rank.T[:, :, None], x[None], jnp.zeros((), x.dtype))  # [R, T, H]
  return lax.all_to_all(buf, axis, 0, 0, tiled=False)


def _dense_all_to_all_combine(y, topk_idx, w, *, shape: Shape, axis: str):
  """Inverse of the dense dispatch: rows back, weighted f32 sum per token."""
  import jax.numpy as jnp
  from jax import lax
  back = lax.all_to_all(y, axis, 0, 0, tiled=False)  # [R, T, H]: [j, t] = row of t on rank j
  e_l = shape.experts // shape.ranks
  dest = jnp.where(topk_idx >= 0, topk_idx // e_l, -1)
  wr = jnp.stack([jnp.where(dest == j, w, 0).sum(axis=1) for j in range(shape.ranks)])  # [R, T]
  return jnp.einsum("rt,rth->th", wr, back.astype(jnp.float32)).astype(y.dtype)


def _capacity_all_to_all_dispatch(x, topk_idx, *, shape: Shape, axis: str, factor: float = 1.25):
  import jax.numpy as jnp
  from jax import lax
  t, k = topk_idx.shape
  e = shape.experts
  cap = int(np.ceil(factor * t * k / e))
  flat = topk_idx.reshape(-1)
  onehot = (flat[:, None] == jnp.arange(e)[None]).astype(jnp.int32)
  pos = (jnp.cumsum(onehot, axis=0) - 1)[jnp.arange(t * k), jnp.maximum(flat, 0)]
  ok = (flat >= 0) & (pos < cap)
  slot = jnp.where(ok, flat * cap + pos, e * cap)
  buf = jnp.zeros((e * cap + 1, x.shape[1]), x.dtype).at[slot].set(x[jnp.arange(t * k) // k])
  buf = buf[:-1].reshape(shape.ranks, (e // shape.ranks) * cap, x.shape[1])
  return lax.all_to_all(buf, axis, 0, 0, tiled=False)


def _ragged_all_to_all_dispatch(x, topk_idx, *, shape: Shape, axis: str):
  import jax.numpy as jnp
  from jax import lax
  t, k = topk_idx.shape
  e_l = shape.experts // shape.ranks
  flat = topk_idx.reshape(-1)
  order = jnp.argsort(flat)
  x_sorted = x[order // k]
  dest = flat[order] // e_l
  send = jnp.sum(dest[:, None] == jnp.arange(shape.ranks)[None], axis=0).astype(jnp.int32)
  in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
  sizes = lax.all_gather(send, axis)                       # [src, dst]
  r = lax.axis_index(axis)
  below = (jnp.arange(shape.ranks) < r)[:, None]
  out_off = jnp.sum(jnp.where(below, sizes, 0), axis=0).astype(jnp.int32)  # where my chunk lands on j
  recv = sizes[:, r].astype(jnp.int32)
  out = jnp.zeros((shape.ranks * t * k, x.shape[1]), x.dtype)
  return lax.ragged_all_to_all(x_sorted, out, in_off, send, out_off, recv, axis_name=axis)


# ---------------------------------------------------------------- runs

# XLA modes of ragged_all_to_all to try, one process each (flags are read
# once when the backend starts, and an unknown flag aborts it): names found
# in XLA's debug options of 2025-26 releases; which ones this jaxlib's CUDA
# plugin accepts is recorded, not assumed.
RAGGED_XLA_MODES = {
    "one_shot": "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true",
    "nccl": "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false",
    "decomposer": "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true",
    "symmetric_memory": "--xla_gpu_ragged_all_to_all_mode=COLLECTIVES_SYMMETRIC_MEMORY",
}


def records_from_script(script: str, argv: list[str], json_name: str, impl: str,
                        env_extra: dict,
                        timeout_s: int = 300) -> tuple[list[dict], Optional[int], str]:
  """(records of `impl`, return code, output tail) from a benchmark script run
  in a fresh process with `env_extra` in its environment (XLA_FLAGS and
  jax_ep's settings are read once per process) and `--out` a temporary
  directory, where it writes its run file under `json_name`/."""
  import tempfile
  env = dict(os.environ, **env_extra)
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, script, "--out", tmp, *argv]
    try:
      res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
      rc, tail = res.returncode, (res.stdout + res.stderr)[-600:]
    except subprocess.TimeoutExpired:
      rc, tail = None, f"timed out after {timeout_s} s"
    got = []
    child = run_records.latest(tmp, json_name) if rc == 0 else None
    if child:
      got = [r for r in child if r.get("impl") == impl]
  return got, rc, tail


def failure_reason(rc: Optional[int], tail: str) -> str:
  """Why a fresh-process run gave no records: a refused XLA flag (the
  backend aborts at start-up on an unknown one) or its return code."""
  return "flag not accepted" if "nknown" in tail and "flag" in tail else f"rc {rc}"


def _records_in_subprocess(shape: "Shape", impl: str, env_extra: dict,
                           timeout_s: int = 300) -> tuple[list[dict], Optional[int], str]:
  """records_from_script of this script run for `impl` alone."""
  return records_from_script(os.path.abspath(__file__),
                             ["--tokens", str(shape.tokens), "--impls", impl,
                              "--no-ragged-modes"],
                             "normal", impl, env_extra, timeout_s)


def ragged_modes(shape: "Shape", out_dir: str, timeout_s: int = 300) -> list[dict]:
  """sort + ragged_all_to_all under each RAGGED_XLA_MODES flag, each in a
  fresh process; a mode whose flag the plugin refuses gives a record with
  time_us None and its reason."""
  records = []
  for mode, flag in RAGGED_XLA_MODES.items():
    xla = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    got, rc, tail = _records_in_subprocess(shape, "jax_ragged_all_to_all", {"XLA_FLAGS": xla}, timeout_s)
    for r in got:
      r.update(impl=f"jax_ragged_all_to_all[{mode}]", xla_flags=flag)
    if not got:
      why = failure_reason(rc, tail)
      got = [dict(bench="normal_dispatch", impl=f"jax_ragged_all_to_all[{mode}]", dtype="bf16",
                  tokens_per_rank=shape.tokens, ranks=shape.ranks, time_us=None,
                  xla_flags=flag, failed=why, log_tail=tail)]
    for r in got:
      t = r.get("time_us")
      print(f"  ragged_all_to_all [{mode:16s}] {flag}: "
            f"{'-' if t is None else f'{t:.1f} us'}{'' if t else ' (' + r['failed'] + ')'}",
            flush=True)
    records += got
  return records


def run(shape: Shape, *, quick: bool, impls: Optional[list[str]] = None,
        sweep: bool = False) -> list[dict]:
  """Records of `impls` at `shape`. `sweep`: chain_calls per step, a digest
  of the outputs per step, and the profiler's kernel time of jax_ep's ops
  (what `quick` leaves out)."""
  import jax
  from jax.sharding import Mesh
  import jax_ep

  devices = jax.devices()[:shape.ranks]
  mesh = Mesh(np.array(devices), ("ep",))
  x, topk_idx, w = _routing(jax.random.PRNGKey(0), shape)
  x_fp8 = jax_ep.quantize(x)
  idx_np = np.asarray(topk_idx)
  h = shape.hidden
  smap = functools.partial(jax_ep.shard_map, mesh=mesh)
  disp = functools.partial(jax_ep.dispatch, num_experts=shape.experts, axis_name="ep")
  sms = 24  # jax_ep_sms: DeepEP's default SM budget (docs/design.md §6)
  results = []
  # jax_ep_checked last: it replaces the communicator by a checked one.
  impls = impls or ["jax_ep", "reference", "jax_all_to_all", "jax_capacity_all_to_all",
                    "jax_ragged_all_to_all", "jax_ep_sms", "jax_ep_checked"]

  def record(bench, impl, dtype, t, row_bytes, nsms=None, per_expert=False, **extra):
    nv, lg = _bytes(idx_np, shape, row_bytes, per_expert)
    results.append(dict(bench=bench, impl=impl, dtype=dtype, tokens_per_rank=shape.tokens,
                        hidden=h, topk=shape.topk, experts=shape.experts, ranks=shape.ranks,
                        time_us=t * 1e6, nvlink_gbps=nv / t / 1e9, logical_gbps=lg / t / 1e9,
                        sms=nsms, **extra))

  # Every variant is compiled and run once (bench) before any is timed
  # (time_all), so none is timed on a colder GPU than the others
  # (docs/design.md §6).
  pending = []

  def bench(name, impl, dtype, fn, args, row_bytes, nsms=None, per_expert=False):
    label = f"{name}/{impl}/{dtype}"
    # The sweep's long chains of jax_ep's ops keep one small digest per step,
    # not every call's outputs (up to SWEEP_MAX_CALLS of them). XLA's own
    # pipelines keep every output: under a digest XLA may shrink their
    # gathers and scatters to the digested elements (RESULTS.md, 8728f18).
    digest = mesh if sweep and impl.startswith("jax_ep") else None
    try:
      iters, reps = _adaptive_iters(fn, args, quick, sweep=sweep, digest=digest)
      jstep = _chain(fn, iters, digest)
      jax.block_until_ready(jstep(*args))
    except Exception as e:  # noqa: BLE001 - a failing variant must not hide the others
      print(f"  {label}: FAILED: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
      return
    pending.append((name, impl, dtype, fn, args, row_bytes, nsms, per_expert, jstep, iters, reps))

  def time_all():
    for job in pending:
      timed(*job)
    pending.clear()

  def timed(name, impl, dtype, fn, args, row_bytes, nsms, per_expert, jstep, iters, reps):
    try:
      t = _time_chain(jstep, args, reps) / iters
    except Exception as e:  # noqa: BLE001
      print(f"  {name}/{impl}/{dtype}: FAILED: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
      return
    extra = dict(calls_per_step=iters)
    if impl.startswith("jax_ep") and (sweep or not quick):
      # The profiler's view of one call (docs/design.md §6: kernel time per
      # op, and which of prep / control / data kernels it goes to).
      tr = trace_us(fn, args, None, shape.ranks, iters=10)
      extra.update(kernel_us=tr["kernel_us"], chain_gap_us=tr["gap_us"], kernel_parts=tr["kernel_parts"])
    record(name, impl, dtype, t, row_bytes, nsms, per_expert, **extra)
    parts = extra.get("kernel_parts") or {}
    detail = "  ".join(f"{_kernel_label(k)}={v:.1f}" for k, v in parts.items())
    print(f"  {name:16s} {impl:24s} {dtype:5s} {t * 1e6:10.1f} us  {detail}", flush=True)

  bf16_row = h * 2
  fp8_row = h + (h // 128) * 4
  comm = None
  if any(i.startswith("jax_ep") for i in impls):
    from jax_ep._window import normal_bytes as window_bytes_needed
    nbytes = max(1 << 30, window_bytes_needed(num_ranks=shape.ranks, tokens_per_rank=shape.tokens,
                                              hidden=h, topk=shape.topk, num_experts=shape.experts))
    comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes)
    run_records.note_communicator(comm)
  try:
    for impl in impls:
      if impl == "jax_ep_checked":
        # Checked mode (docs/errors.md): every op waits for its own kernels
        # and fails the program that caused an error. Its cost per op
        # against the deferred default is what decides the default. The
        # programs compiled so far use the deferred communicator: time
        # them before it closes.
        time_all()
        comm.close()
        comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes, checked=True)
      if impl in ("jax_ep", "reference", "jax_ep_checked"):
        backend = "reference" if impl == "reference" else "cuda"
        nsms = None if impl == "reference" else sms
        # The SM budget is passed, not left to the default (which at one
        # rank is every SM), so the records' `sms` is what ran.
        kw = dict(backend=backend, num_sms=nsms)
        f_bf16 = smap(lambda x, i, w: disp(x, i, w, **kw).recv_x)
        bench("normal_dispatch", impl, "bf16", f_bf16, (x, topk_idx, w), bf16_row, nsms)
        if impl != "jax_ep_checked":
          f_fp8 = smap(lambda q, s, i, w: disp((q, s), i, w, **kw).recv_x)
          bench("normal_dispatch", impl, "fp8", f_fp8, (*x_fp8, topk_idx, w), fp8_row, nsms)
          f_cast = smap(lambda x, i, w: disp(x, i, w, fp8=True, **kw).recv_x)
          bench("normal_dispatch", impl + "_cast", "fp8",
                f_cast, (x, topk_idx, w), fp8_row, nsms)

        def comb(x, i, w):
          out = disp(x, i, w, **kw)
          return out.recv_x, out.recv_topk_weights, out.handle
        recv, rw, handle = jax.jit(smap(comb))(x, topk_idx, w)
        row_w = rw.max(axis=-1)  # a per-row weight (rank layout rows carry K weights)
        f_comb = smap(lambda y, hd, wr: jax_ep.combine(y, hd, wr, **kw))
        bench("normal_combine", impl, "bf16", f_comb, (recv, handle, row_w), bf16_row, nsms)
      elif impl == "jax_ep_sms":
        # What more SMs than the 24 of the bar buy (docs/design.md §6): the same BF16
        # dispatch and combine on 48 and on every SM.
        for n in (48, 132):
          f = smap(lambda x, i, w, n=n: disp(x, i, w, num_sms=n, backend="cuda").recv_x)
          bench("normal_dispatch", f"jax_ep_{n}sms", "bf16", f, (x, topk_idx, w), bf16_row, n)
          def parts(x, i, w, n=n):
            o = disp(x, i, w, num_sms=n, backend="cuda")
            return o.recv_x, o.recv_topk_weights.max(axis=-1), o.handle
          try:
            recv, row_w, handle = jax.jit(smap(parts))(x, topk_idx, w)
          except Exception as e:  # noqa: BLE001 - a variant must not hide the others
            print(f"  normal_combine/jax_ep_{n}sms: FAILED: {type(e).__name__}: {str(e)[:300]}")
            continue
          fc = smap(lambda y, hd, wr, n=n: jax_ep.combine(y, hd, wr, num_sms=n, backend="cuda"))
          bench("normal_combine", f"jax_ep_{n}sms", "bf16", fc, (recv, handle, row_w), bf16_row, n)
      elif impl == "jax_ep_expert":
        # The layout jax_ep.nn.MoE uses (rows per (token, expert), grouped by
        # local expert): BF16 dispatch and combine on the same SMs.
        f = smap(lambda x, i, w: disp(x, i, w, layout="expert", num_sms=sms, backend="cuda").recv_x)
        bench("normal_dispatch", impl, "bf16", f, (x, topk_idx, w), bf16_row, sms)

        def eparts(x, i, w):
          o = disp(x, i, w, layout="expert", num_sms=sms, backend="cuda")
          return o.recv_x, o.recv_topk_weights, o.handle
        recv, rw, handle = jax.jit(smap(eparts))(x, topk_idx, w)
        fc = smap(lambda y, hd, wr: jax_ep.combine(y, hd, wr, num_sms=sms, backend="cuda"))
        bench("normal_combine", impl, "bf16", fc, (recv, handle, rw), bf16_row, sms, per_expert=True)
      elif impl == "jax_all_to_all":
        f = smap(functools.partial(_dense_all_to_all_dispatch, shape=shape, axis="ep"))
        bench("normal_dispatch", impl, "bf16", f, (x, topk_idx), bf16_row)
        y = jax.jit(f)(x, topk_idx)
        fc = smap(functools.partial(_dense_all_to_all_combine, shape=shape, axis="ep"))
        bench("normal_combine", impl, "bf16", fc, (y, topk_idx, w), bf16_row)
      elif impl == "jax_capacity_all_to_all":
        f = smap(functools.partial(_capacity_all_to_all_dispatch, shape=shape, axis="ep"))
        bench("normal_dispatch", impl, "bf16", f, (x, topk_idx), bf16_row)
      elif impl == "jax_ragged_all_to_all":
        f = smap(functools.partial(_ragged_all_to_all_dispatch, shape=shape, axis="ep"))
        bench("normal_dispatch", impl, "bf16", f, (x, topk_idx), bf16_row)
    time_all()
  finally:
    if comm is not None:
      comm.close()
  return results


def _finish(records: list[dict], ce_gbps: Optional[float], ce_note: str, machine: str) -> None:
  for r in records:
    r["ratio_to_copy_engine"] = (r["nvlink_gbps"] / ce_gbps) if r.get("nvlink_gbps") and ce_gbps else None
  if ce_gbps is not None:
    records.append(dict(bench="copy_engine", impl="copy_engine", dtype="u8", tokens_per_rank=None,
                        hidden=None, topk=None, experts=None, ranks=2, time_us=None,
                        nvlink_gbps=ce_gbps, logical_gbps=None, sms=None, ratio_to_copy_engine=1.0,
                        note=ce_note))
  run_records.stamp(records, machine)


def write_records(records: list[dict], out_dir: str, name: str) -> str:
  """Adds this run's file under out_dir/<name>/ (benchmarks/records.py) and
  returns its path."""
  path = run_records.write(records, out_dir, name)
  print(f"records: {path}", flush=True)
  return path


def _table(records: list[dict]) -> str:
  hdr = f"{'bench':16s} {'impl':24s} {'dtype':5s} {'tok':>6s} {'time_us':>10s} {'nvlink':>8s} {'logical':>8s} {'sms':>4s} {'x_ce':>6s}"
  lines = [hdr, "-" * len(hdr)]
  for r in records:
    f = lambda k, fmt: (fmt % r[k]) if r.get(k) is not None else "-"  # noqa: E731
    lines.append(f"{r['bench']:16s} {r['impl']:24s} {r['dtype']:5s} {f('tokens_per_rank', '%6d'):>6s} "
                 f"{f('time_us', '%10.1f'):>10s} {f('nvlink_gbps', '%8.1f'):>8s} "
                 f"{f('logical_gbps', '%8.1f'):>8s} {f('sms', '%4d'):>4s} "
                 f"{f('ratio_to_copy_engine', '%6.2f'):>6s}")
  return "\n".join(lines)


def _plot(records: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, bench in zip(axes, ("normal_dispatch", "normal_combine")):
    series = {}
    for r in records:
      if r["bench"] == bench and r["tokens_per_rank"]:
        series.setdefault(f"{r['impl']} {r['dtype']}", []).append((r["tokens_per_rank"], r["time_us"]))
    for name, pts in sorted(series.items()):
      pts.sort()
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("µs per call (median)")
    ax.set_title(bench)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def require_two_gpus(name: str, need: int = 2):
  """The GPUs to measure on (at least `need`: 2 unless a benchmark runs at
  EP1 on purpose), or None after saying why nothing can be measured."""
  try:
    import jax
  except ImportError:
    print(f"{name}: jax is not installed", file=sys.stderr)
    return None
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if len(gpus) < need:
    print(f"{name}: needs {need} GPUs visible to JAX, found {len(gpus)} "
          f"(backend: {jax.default_backend()}); nothing measured.", file=sys.stderr)
    return None
  import jax_ep
  if not jax_ep.cuda_available():
    print(f"{name}: jax_ep was built without CUDA (pip install -e . with nvcc + NCCL)",
          file=sys.stderr)
    return None
  return gpus


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for JSON/PNG")
  ap.add_argument("--quick", action="store_true", help="1024 tokens, fewer iterations, no ragged baseline")
  ap.add_argument("--sweep", action="store_true", help="tokens 128..16384, writes a PNG")
  ap.add_argument("--tokens", type=int, default=None)
  ap.add_argument("--impls", default=None, help="comma list, e.g. jax_ep,jax_all_to_all")
  ap.add_argument("--no-ragged-modes", action="store_true",
                  help="skip ragged_all_to_all under XLA's other modes (one process each)")
  args = ap.parse_args(argv)

  # Variants that need a process of their own run first, while this one
  # holds no GPU memory yet (XLA preallocates most of it at start-up, and
  # a child's communicator window then fails to allocate).
  t = args.tokens or (1024 if args.quick else 4096)
  impls = None if not args.quick else ["jax_ep", "reference", "jax_all_to_all"]
  if args.impls:
    impls = args.impls.split(",")
  early: list[dict] = []
  from jax_ep import _native
  # (Not cuda_available(): asking JAX for its GPUs would start the backend.)
  gpu_here = _native.cuda_built() and os.path.exists("/dev/nvidiactl")
  if not args.sweep and not args.quick and gpu_here:
    if not args.no_ragged_modes:
      early += ragged_modes(Shape(tokens=t), args.out)

  frame = _machine_and_ceiling("bench_normal")
  if frame is None:
    return 2
  machine, ce, ce_note = frame
  records: list[dict] = []
  if args.sweep:
    toks = [128 << i for i in range(8)]  # 128 .. 16384
    for t in toks:
      print(f"tokens/rank = {t}", flush=True)
      impls = ["jax_ep", "reference", "jax_all_to_all"] + ([] if t > 4096 else ["jax_capacity_all_to_all"])
      if args.impls:
        impls = args.impls.split(",")
      records += run(Shape(tokens=t), quick=False, impls=impls, sweep=True)
  else:
    records += run(Shape(tokens=t), quick=args.quick, impls=impls) + early
  _finish(records, ce, ce_note, machine)

  path = write_records(records, args.out, "normal_sweep" if args.sweep else "normal")
  if args.sweep:
    png = path[:-len(".json")] + ".png"
    _plot(records, png)
    print(f"plot: {png}")
  print(_table(records))
  return 0


if __name__ == "__main__":
  sys.exit(main())
