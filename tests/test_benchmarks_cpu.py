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
                                  "bench_grouped_gemm"])
def test_benchmark_exits_2_without_gpus(name, tmp_path):
  sys.path.insert(0, BENCH)
  try:
    mod = importlib.import_module(name)
    assert mod.main(["--out", str(tmp_path)]) == 2
  finally:
    sys.path.remove(BENCH)
  assert not list(tmp_path.iterdir())
