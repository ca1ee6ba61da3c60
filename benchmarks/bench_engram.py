"""docs/design.md §6 "Engram" benchmark: remote-row lookups at EP=2 on one host.

524288 rows/rank of D=128 (bf16, and FP8 e4m3 payload with replicated f32
row scales), 512 tokens x 24 rows per rank, indices uniform over the global
table (no -1: never time zeros). Measured in the same process run:
  jax_ep          engram_fetch(backend="cuda"): publish (barrier, 128 MiB /
                  64 MiB local copy into the window, barrier) + NVLink fetch,
                  i.e. what one call of the public op costs
  jax_ep_fetch    the fetch kernel alone, on a table published once before
                  timing (the inference case: publish once, fetch many times)
  jax_ep_publish  the publish alone (barrier, cudaMemcpyAsync, barrier)
  jax_ep_fetch_checked  jax_ep_fetch (bf16) on a checked Communicator
                  (docs/errors.md), for checked mode's cost
  d2d_memcpy      (bench = engram_publish) a device-to-device cudaMemcpyAsync
                  of the shard's bytes: the publish's bar is 0.8 x its rate
  reference       engram_fetch(backend="reference"): request/response
                  lax.all_to_all of ids and rows (the JAX-native baseline)
  jax_ep_fetch_large  16384 x 32 rows per rank (64 MiB remote at EP2) on 8 ... 132
                  CTAs (`sms`): the bandwidth case, against the copy engine
  copy_engine     bidirectional 256 MB cudaMemcpyPeerAsync (cupy), the ceiling

Per rank: `nvlink_gbps` counts the bytes of the rows owned by the other rank
(the bytes that must cross NVLink), `logical_gbps` all fetched row bytes,
`mrows_per_s` fetched rows (T * e) per second. Times: medians over repeats of
a jitted step running the op `iters` times back-to-back, every call's output
returned and its inputs passed through lax.optimization_barrier
(bench_normal._time_step), divided by `iters`. Beside them, for jax_ep's
rows, from a profiler trace: `gpu_us`, the GPU's busy time per call (every
kernel and copy), and for the fetch `kernel_us`, EngramFetchKernel alone
(what DeepEP reports); wall minus busy is launch and host time. And
`digest_us`: the same 50-call chain returning one digest of every call's
outputs (bench_normal.digest_times), without the cost of returning 50
outputs; its profile's `digest_kernels_per_call` shows no call was dropped.

  python benchmarks/bench_engram.py [--quick] [--out DIR]

Exits 2 (measuring nothing, writing nothing) without 2 GPUs or the CUDA build.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


@dataclasses.dataclass
class Shape:
  rows_per_rank: int = 524288
  dim: int = 128
  tokens: int = 512
  rows_per_token: int = 24
  ranks: int = int(os.environ.get("JAX_EP_BENCH_RANKS", "2"))  # EP size (docs/design.md §6: 2)


def _tables(shape: Shape, mesh):
  """Global [R*VL, D] bf16 table and its FP8 form (q, scales [V]), on device."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  v = shape.ranks * shape.rows_per_rank
  sh = NamedSharding(mesh, P("ep"))

  @functools.partial(jax.jit, out_shardings=(sh, sh, NamedSharding(mesh, P())))
  def make(key):
    x = jax.random.normal(key, (v, shape.dim), jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1), 1e-6)
    s = amax / 448.0
    q = (x / s[:, None]).astype(jnp.float8_e4m3fn)
    return x.astype(jnp.bfloat16), q, s

  return make(jax.random.PRNGKey(0))


def window_bytes(shape: Shape) -> int:
  """The Communicator's num_bytes: one bf16 table shard, plus room for the
  FP8 one and the runtime header."""
  import jax.numpy as jnp
  from jax_ep import _window
  return _window.engram_bytes(rows_per_rank=shape.rows_per_rank, dim=shape.dim,
                                         dtype=jnp.bfloat16) + (8 << 20)


def _indices(shape: Shape) -> np.ndarray:
  rng = np.random.default_rng(0)
  v = shape.ranks * shape.rows_per_rank
  return rng.integers(0, v, size=(shape.ranks * shape.tokens, shape.rows_per_token)).astype(np.int32)


def _bytes(idx: np.ndarray, shape: Shape, row_bytes: int) -> tuple[float, float, float]:
  """(NVLink bytes, logical bytes, rows) per rank, averaged over ranks."""
  nv, lg, rows = [], [], []
  for r in range(shape.ranks):
    ids = idx[r * shape.tokens:(r + 1) * shape.tokens]
    valid = ids >= 0
    remote = valid & (ids // shape.rows_per_rank != r)
    nv.append(remote.sum() * row_bytes)
    lg.append(valid.sum() * row_bytes)
    rows.append(valid.sum())
  return float(np.mean(nv)), float(np.mean(lg)), float(np.mean(rows))


def run(shape: Shape, *, quick: bool) -> list[dict]:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_ep
  from jax_ep import _native
  from jax_ep._ffi import engram as _ffi_engram
  from bench_normal import digest_times, fmt, run_records, time_or_none, trace_us

  devices = jax.devices()[:shape.ranks]
  mesh = Mesh(np.array(devices), ("ep",))
  smap = functools.partial(jax_ep.shard_map, mesh=mesh)
  table, q, scales = _tables(shape, mesh)
  scales_rep = jax.device_put(jnp.tile(scales, shape.ranks), NamedSharding(mesh, P("ep")))
  idx_np = _indices(shape)
  idx = jax.device_put(idx_np, NamedSharding(mesh, P("ep")))
  d = shape.dim
  results: list[dict] = []

  def record(impl, dtype, t, row_bytes, nsms=None):
    nv, lg, rows = _bytes(idx_np, shape, row_bytes)
    results.append(dict(bench="engram_fetch", impl=impl, dtype=dtype,
                        tokens_per_rank=shape.tokens, hidden=d, topk=shape.rows_per_token,
                        experts=None, rows_per_rank=shape.rows_per_rank, ranks=shape.ranks,
                        time_us=t * 1e6, nvlink_gbps=nv / t / 1e9, logical_gbps=lg / t / 1e9,
                        mrows_per_s=rows / t / 1e6, sms=nsms))

  def bench(impl, dtype, fn, args, row_bytes, nsms=None, kernel=None):
    """`kernel`: the kernel-name substring whose profiler time per call is
    recorded (kernel_us) next to the wall time and the GPUs' busy time per
    call (gpu_us: every kernel and copy of the call)."""
    t = time_or_none(f"engram_fetch/{impl}/{dtype}", fn, args, quick)
    if t is None:
      return
    record(impl, dtype, t, row_bytes, nsms)
    extra = ""
    if impl.startswith("jax_ep"):
      tr = trace_us(fn, args, kernel, shape.ranks)
      dg = digest_times(fn, args, mesh, kernel, shape.ranks)
      results[-1].update(gpu_us=tr["gpu_us"], kernel_us=tr["kernel_us"], chain_gap_us=tr["gap_us"],
                         kernels_per_call=tr["kernels_per_call"], **dg)
      extra = f"  gpu busy {fmt(tr['gpu_us'], '6.1f')} us" + (
          f", {kernel} {fmt(tr['kernel_us'], '6.1f')} us, {fmt(tr['gap_us'], '6.1f')} us apart"
          if kernel else "") + (
          f"; digest chain {fmt(dg['digest_us'], '6.1f')} us/call, busy {fmt(dg['digest_gpu_us'], '6.1f')},"
          f" {fmt(dg['digest_kernels_per_call'], '4.2f')} kernels/call")
    print(f"  engram_fetch {impl:16s} {dtype:5s} {t * 1e6:10.1f} us{extra}", flush=True)

  comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=window_bytes(shape))
  run_records.note_communicator(comm)
  cid = comm.comm_id
  try:
    for dtype, tab, row_bytes in (("bf16", table, d * 2), ("fp8", q, d)):
      fp8 = dtype == "fp8"
      for impl, backend in (("jax_ep", "cuda"), ("reference", "reference")):
        if fp8:
          f = smap(lambda t, i, s, b=backend: jax_ep.engram_fetch(t, i, scales=s, backend=b))
          args = (tab, idx, scales_rep)
        else:
          f = smap(lambda t, i, b=backend: jax_ep.engram_fetch(t, i, backend=b))
          args = (tab, idx)
        bench(impl, dtype, f, args, row_bytes, None,
              kernel="EngramFetchKernel" if impl == "jax_ep" else None)

      # Publish once, then time the fetch kernel alone (+ the FP8 scale gather).
      pub = jax.jit(smap(lambda t: _ffi_engram.publish(t, comm_id=cid)))
      token = jax.block_until_ready(pub(tab))

      def fetch_only(tok, i, *s, vl=shape.rows_per_rank, dt=tab.dtype, n=0):
        rows = _ffi_engram.fetch(tok, i, rows_per_rank=vl, dim=d, dtype=dt, comm_id=cid,
                                      num_sms=n)
        if not s:
          return rows
        sc = s[0]
        return rows, jnp.where(i >= 0, sc[jnp.maximum(i, 0)], 0).astype(sc.dtype)

      bench("jax_ep_fetch", dtype, smap(fetch_only),
            (token, idx, scales_rep) if fp8 else (token, idx), row_bytes, None,
            kernel="EngramFetchKernel")
      if not fp8:
        # The model's 64 CTAs leave some of the 96 a one-pass grid would take
        # idle; whether all SMs shorten the small fetch:
        bench("jax_ep_fetch_132sms", dtype, smap(functools.partial(fetch_only, n=132)),
              (token, idx), row_bytes, 132, kernel="EngramFetchKernel")
        results += _large_fetch(shape, mesh, smap, token, cid, quick)
      bench("jax_ep_publish", dtype, smap(lambda t: _ffi_engram.publish(t, comm_id=cid)),
            (tab,), row_bytes, None, kernel="memcpy")  # its copy-engine copy
      # The publish's bar: a device-to-device cudaMemcpyAsync of the shard's
      # bytes on one of the GPUs, measured in this run (a timer of the test
      # harness: only in a build with JAX_EP_TESTING=ON).
      shard_bytes = shape.rows_per_rank * row_bytes
      if not _native.testing_built():
        print("  engram_publish d2d cudaMemcpyAsync: not measured (jax_ep built without "
              "JAX_EP_TESTING=ON)", flush=True)
      else:
        us = _native.module().time_d2d_memcpy(mesh.devices.flat[0].local_hardware_id,
                                              shard_bytes)
        pub_t = next((r["time_us"] for r in reversed(results)
                      if r["impl"] == "jax_ep_publish" and r["dtype"] == dtype), None)
        results.append(dict(bench="engram_publish", impl="d2d_memcpy", dtype=dtype,
                            bytes=shard_bytes, time_us=us, publish_us=pub_t,
                            publish_ratio_to_memcpy=None if not pub_t else us / pub_t))
        print(f"  engram_publish d2d cudaMemcpyAsync {dtype:5s} {us:10.1f} us; publish "
              f"{pub_t if pub_t is None else round(pub_t, 1)} us "
              f"(x{(us / pub_t) if pub_t else float('nan'):.2f} of the memcpy rate)", flush=True)
      comm.check()
  finally:
    comm.close()
  # Checked mode (docs/errors.md): the same fetch from a publication of a
  # checked Communicator, whose every op waits for its kernels and fails the
  # program that caused an error; its cost against jax_ep_fetch above.
  comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=window_bytes(shape), checked=True)
  try:
    cid = comm.comm_id
    token = jax.block_until_ready(jax.jit(smap(lambda t: _ffi_engram.publish(t, comm_id=cid)))(table))
    bench("jax_ep_fetch_checked", "bf16",
          smap(lambda tok, i: _ffi_engram.fetch(tok, i, rows_per_rank=shape.rows_per_rank, dim=d,
                                                     dtype=table.dtype, comm_id=cid)),
          (token, idx), d * 2, None, kernel="EngramFetchKernel")
    comm.check()
  finally:
    comm.close()
  return results


LARGE_TOKENS, LARGE_ROWS = 16384, 32  # 524288 rows of 256 B per rank: 64 MiB remote at EP2
LARGE_SMS = (8, 16, 24, 32, 64, 132)


def _large_fetch(shape: Shape, mesh, smap, token, cid: int, quick: bool) -> list[dict]:
  """The bandwidth case (docs/design.md §6): 16384 x 32 rows of bf16 D = 128 per rank
  from the published table, half of them remote at EP2 (64 MiB over
  NVLink), for each CTA count in LARGE_SMS; ratio_to_copy_engine is added
  by the frame (measure_and_write), so the fewest CTAs reaching the bar show."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jax_ep._ffi import engram as _ffi_engram
  from bench_normal import time_or_none

  big = dataclasses.replace(shape, tokens=LARGE_TOKENS, rows_per_token=LARGE_ROWS)
  idx_np = _indices(big)
  idx = jax.device_put(idx_np, NamedSharding(mesh, P("ep")))
  nv, lg, rows = _bytes(idx_np, big, shape.dim * 2)
  out = []
  for nsms in LARGE_SMS[-2:] if quick else LARGE_SMS:
    f = smap(lambda tok, i, n=nsms: _ffi_engram.fetch(
        tok, i, rows_per_rank=shape.rows_per_rank, dim=shape.dim, dtype=jnp.bfloat16,
        comm_id=cid, num_sms=n))
    t = time_or_none(f"engram_fetch/jax_ep_fetch_large/{nsms}", f, (token, idx), quick, max_iters=10)
    if t is None:
      continue
    out.append(dict(bench="engram_fetch", impl="jax_ep_fetch_large", dtype="bf16",
                    tokens_per_rank=LARGE_TOKENS, hidden=shape.dim, topk=LARGE_ROWS, experts=None,
                    rows_per_rank=shape.rows_per_rank, ranks=shape.ranks, time_us=t * 1e6,
                    nvlink_gbps=nv / t / 1e9, logical_gbps=lg / t / 1e9,
                    mrows_per_s=rows / t / 1e6, sms=nsms))
    print(f"  engram_fetch jax_ep_fetch_large bf16 {nsms:3d} CTAs {t * 1e6:10.1f} us "
          f"{nv / t / 1e9:7.1f} GB/s over NVLink, {lg / t / 1e9:7.1f} GB/s logical", flush=True)
  return out


def main(argv=None) -> int:
  from bench_normal import fmt, measure_and_write, simple_args
  args = simple_args(__doc__, argv)
  status, records, _ = measure_and_write("bench_engram", "engram",
                                           lambda: run(Shape(), quick=args.quick), args.out)
  if status:
    return status
  hdr = f"{'impl':16s} {'dtype':5s} {'time_us':>10s} {'nvlink':>8s} {'logical':>8s} {'Mrows/s':>9s} {'x_ce':>6s}"
  print(hdr + "\n" + "-" * len(hdr))
  for r in records:
    if r["bench"] != "engram_fetch":
      continue
    print(f"{r['impl']:16s} {r['dtype']:5s} {r['time_us']:10.1f} {r['nvlink_gbps']:8.1f} "
          f"{r['logical_gbps']:8.1f} {r['mrows_per_s']:9.1f} {fmt(r['ratio_to_copy_engine'], '6.2f')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
