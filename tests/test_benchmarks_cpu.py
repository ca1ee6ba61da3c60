"""The benchmark scripts import and refuse cleanly without GPUs (exit 2,
nothing written): catches a broken script before it reaches the GPU machine."""
from __future__ import annotations

import importlib
import os
import sys

import jax
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks")


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="would run the benchmark")
@pytest.mark.parametrize("name", ["bench_normal", "bench_engram", "bench_low_latency", "profile_normal",
                                  "bench_grouped_gemm", "bench_moe"])
def test_benchmark_exits_2_without_gpus(name, tmp_path):
  sys.path.insert(0, BENCH)
  try:
    mod = importlib.import_module(name)
    assert mod.main(["--out", str(tmp_path)]) == 2
  finally:
    sys.path.remove(BENCH)
  assert not list(tmp_path.iterdir())


def test_moe_bench_variants_agree_on_cpu():
  """bench_moe's layers (jax_ep on the reference backend, and the JAX-native
  dense all_to_all layer) give the same loss and gradients at a capacity with
  no drops, on 8 CPU devices at a small shape: the comparison the GPU run
  makes before it times anything."""
  from jax.sharding import Mesh
  import numpy as np
  sys.path.insert(0, BENCH)
  try:
    bm = importlib.import_module("bench_moe")
  finally:
    sys.path.remove(BENCH)
  devs = jax.devices()[:4]
  mesh = Mesh(np.array(devs), ("ep",))
  shape = bm.MoEShape(tokens=32, hidden=128, ffn=64, experts=16, topk=2)
  x, params = bm.make_inputs(shape, mesh, jax.random.key(3))
  diffs = bm.compare(shape, mesh, x, params)
  assert set(diffs) == {"jax_ep", "reference", "jax_native_dense_a2a"}
  assert diffs["reference"] == (0.0, 0.0)  # on CPU jax_ep is the reference
  # The native layer at capacity factor 1 drops pairs, and says how many.
  n = bm.drops(np.asarray(x), np.asarray(params[0][0]), shape=shape, r_count=4,
               capacity_factor=0.5)
  assert n > 0
