"""Soak (docs/errors.md: nothing dropped, no drift): many normal dispatch + combine pairs, each with a
fresh random routing (within capacity, with −1 slots), in jitted chunks.
After each chunk: the communicator reports no error, device memory in use
has not grown, and the chunk's last pair equals the reference bit for bit
(no drift). Stops after --pairs pairs or --max-seconds, whichever comes
first (a device call is limited: run it in pieces), prints pairs/s and
adds a run file under <out>/soak/ (benchmarks/records.py).

  python benchmarks/soak.py --pairs 100000 --chunk 2000 --max-seconds 400
  JAX_EP_BENCH_RANKS=1 python benchmarks/soak.py ...   # one GPU (EP1)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_normal as bn  # noqa: E402


def _pair(x, key, *, E: int, K: int, backend: str):
  """One dispatch + combine on this rank's tokens with a routing drawn from
  `key` (distinct experts per token, ~20 % of the slots −1)."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  k_ids, k_drop, k_w = jax.random.split(jax.random.fold_in(key, jax.lax.axis_index("ep")), 3)
  t = x.shape[0]
  _, idx = jax.lax.top_k(jax.random.uniform(k_ids, (t, E)), K)
  idx = jnp.where(jax.random.uniform(k_drop, (t, K)) < 0.2, -1, idx).astype(jnp.int32)
  w = jax.random.uniform(k_w, (t, K), jnp.float32, 0.25, 1.5)
  o = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", backend=backend)
  return jax_ep.combine(o.recv_x, o.handle, o.recv_topk_weights, backend=backend)


def memory_growth(mems: list[list[int]]) -> tuple:
  """(growth, swing) in bytes over per-chunk samples of bytes in use per
  device. A leak raises the floor; a buffer that XLA frees a little late
  comes and goes (the run at 26bc3db: one 4 MiB output, up and down from chunk
  to chunk). So growth is the lowest sample of the later half minus the
  lowest of the earlier half, the worst device; swing the largest range."""
  if len(mems) < 2:
    return None, None
  half = len(mems) // 2
  devs = range(len(mems[0]))
  growth = max(min(m[d] for m in mems[half:]) - min(m[d] for m in mems[:half]) for d in devs)
  swing = max(max(m[d] for m in mems) - min(m[d] for m in mems) for d in devs)
  return growth, swing


def run_soak(mesh, *, backend: str, pairs: int, chunk: int, max_seconds: float, tokens: int,
             hidden: int, check=lambda: None) -> dict:
  """The soak on `mesh` (axis "ep"); `check` raises on a device error (the
  Communicator's check). Returns the record."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  devices = list(mesh.devices.flat)
  R, T, H, K, E = len(devices), tokens, hidden, 8, 16 * len(devices)
  spec = P("ep")

  def chunk_body(x, key0):
    # The carry is the last pair's output (stacking them would not fit).
    def body(_, i):
      return _pair(x, jax.random.fold_in(key0, i), E=E, K=K, backend=backend), None
    return jax.lax.scan(body, jnp.zeros_like(x), jnp.arange(chunk))[0]

  run_chunk = jax.jit(jax.shard_map(chunk_body, mesh=mesh, in_specs=(spec, P()), out_specs=spec))
  ref_last = jax.jit(jax.shard_map(
      lambda x, k: _pair(x, jax.random.fold_in(k, chunk - 1), E=E, K=K, backend="reference"),
      mesh=mesh, in_specs=(spec, P()), out_specs=spec))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (R * T, H), jnp.bfloat16),
                     NamedSharding(mesh, spec))

  def mem():
    return [(d.memory_stats() or {}).get("bytes_in_use", 0) for d in devices]

  done, chunks, t0, status = 0, 0, None, "ok"
  mems = []  # bytes in use per device after each timed chunk
  try:
    while done < pairs:
      key = jax.random.key(1000 + chunks)
      last = jax.block_until_ready(run_chunk(x, key))
      check()
      want = ref_last(x, key)
      if not np.array_equal(np.asarray(last).view(np.uint16), np.asarray(want).view(np.uint16)):
        status = f"DRIFT: chunk {chunks}'s last pair differs from the reference"
        break
      m = mem()
      if t0 is None:  # the first chunk compiles: time and memory from the second on
        t0 = time.perf_counter()
      else:
        done += chunk
      mems.append(m)
      chunks += 1
      el = time.perf_counter() - t0
      print(f"  {done:7d} pairs  {el:7.1f} s  bytes in use {m}", flush=True)
      if el > max_seconds:
        break
  except Exception as e:  # noqa: BLE001 - record what stopped it
    status = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
  el = time.perf_counter() - t0 if t0 else None
  growth, swing = memory_growth(mems)
  return dict(bench="soak", impl=f"jax_ep[{backend}]", ranks=R, tokens_per_rank=T, hidden=H,
              topk=K, experts=E, pairs=done, chunk=chunk, seconds=el,
              pairs_per_s=(done / el) if el and done else None, memory_growth_bytes=growth,
              memory_swing_bytes=swing,
              status=status)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(HERE, "results"))
  ap.add_argument("--pairs", type=int, default=100_000)
  ap.add_argument("--chunk", type=int, default=2000, help="pairs per jitted call")
  ap.add_argument("--max-seconds", type=float, default=400.0)
  ap.add_argument("--tokens", type=int, default=1024)
  ap.add_argument("--hidden", type=int, default=2048)
  args = ap.parse_args(argv)
  ranks = int(os.environ.get("JAX_EP_BENCH_RANKS", "2"))
  gpus = bn.require_two_gpus("soak", need=min(ranks, 2))
  if gpus is None:
    return 2

  from jax.sharding import Mesh
  import jax_ep
  devices = gpus[:ranks]
  mesh = Mesh(np.array(devices), ("ep",))
  comm = jax_ep.Communicator.create(mesh, "ep", num_bytes=max(
      1 << 28, jax_ep.get_buffer_size_hint(num_ranks=len(devices), tokens_per_rank=args.tokens,
                                           hidden=args.hidden, topk=8,
                                           num_experts=16 * len(devices))))
  try:
    rec = run_soak(mesh, backend="cuda", pairs=args.pairs, chunk=args.chunk,
                   max_seconds=args.max_seconds, tokens=args.tokens, hidden=args.hidden,
                   check=comm.check)
  finally:
    comm.close()
  bn.run_records.stamp([rec], bn._machine(devices))
  bn.write_records([rec], args.out, "soak")
  growth = rec["memory_growth_bytes"]
  print(f"soak: {rec['status']}; {rec['pairs']} pairs in {rec['seconds'] or 0:.1f} s; "
        f"memory growth {growth} bytes", flush=True)
  return 0 if rec["status"] == "ok" and growth is not None and growth <= (1 << 20) else 1


if __name__ == "__main__":
  sys.exit(main())
