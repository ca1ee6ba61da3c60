"""Times the Normal-shape jax_ep ops for several JAX_EP_COUNT_BATCH values in
one process (the launchers read it per launch): python3 scripts/sweep_count_batch.py 1,2,4,8"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_normal as b  # noqa: E402

rows = []
for v in sys.argv[1].split(","):
  os.environ["JAX_EP_COUNT_BATCH"] = v
  for rec in b.run(b.Shape(), quick=False, impls=["jax_ep"]):
    rec["count_batch"] = int(v)
    rec["recv_sms"] = os.environ.get("JAX_EP_RECV_SMS", "")
    rows.append(rec)
    print(f"batch {v} recv_sms {rec['recv_sms'] or '-'} {rec['bench']} {rec['impl']} {rec['dtype']} "
          f"{rec['time_us']} us", flush=True)
if len(sys.argv) > 2:
  with open(sys.argv[2], "w") as f:
    json.dump(rows, f, indent=1)
