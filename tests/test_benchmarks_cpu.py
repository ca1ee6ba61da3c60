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


def _bench(name: str):
  """A module of benchmarks/ (they import each other by plain name)."""
  sys.path.insert(0, BENCH)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(BENCH)


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="would run the benchmark")
@pytest.mark.parametrize("name", ["bench_normal", "bench_engram", "bench_low_latency", "profile_normal",
                                  "bench_grouped_gemm", "bench_moe", "bench_mega_moe", "soak",
                                  "setup_stamps"])
def test_benchmark_exits_2_without_gpus(name, tmp_path):
  assert _bench(name).main(["--out", str(tmp_path)]) == 2
  assert not list(tmp_path.iterdir())


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="would run the kernels")
@pytest.mark.parametrize("op", ["ll_dispatch", "ll_dispatch_fp8", "ll_combine", "engram_fetch"])
def test_profile_small_exits_2_without_gpus(op):
  assert _bench("profile_small").main(["--op", op, "--calls", "1"]) == 2


def test_moe_bench_variants_agree_on_cpu():
  """bench_moe's layers (jax_ep on the reference backend, and the JAX-native
  dense all_to_all layer) give the same loss and gradients at a capacity with
  no drops, on 8 CPU devices at a small shape: the comparison the GPU run
  makes before it times anything."""
  from jax.sharding import Mesh
  import numpy as np
  bm = _bench("bench_moe")
  devs = jax.devices()[:4]
  mesh = Mesh(np.array(devs), ("ep",))
  shape = bm.MoEShape(tokens=32, hidden=128, ffn=64, experts=16, topk=2)
  x, params = bm.make_inputs(shape, mesh, jax.random.key(3))
  diffs = bm.compare(shape, mesh, x, params)
  assert set(diffs) == {"jax_ep", "reference", "jax_ep_rank_combine", "jax_native_dense_a2a"}
  assert max(diffs["jax_ep_rank_combine"]) < 1e-2  # one more bf16 rounding, per rank
  # XLA:CPU has no ragged-all-to-all: that layer is left out here, but it
  # must still trace and lower (its shapes and offsets are checked on GPU).
  assert "jax_native_ragged_a2a" in bm.EXCLUDED
  step = bm.make_step(bm.layers(shape, 1.25)["jax_native_ragged_a2a"], mesh)
  assert "ragged_all_to_all" in step.lower(params, x).as_text()
  assert diffs["reference"] == (0.0, 0.0)  # on CPU jax_ep is the reference
  # The native layer at capacity factor 1 drops pairs, and says how many.
  n = bm.drops(np.asarray(x), np.asarray(params[0][0]), shape=shape, r_count=4,
               capacity_factor=0.5)
  assert n > 0


def test_moe_swiglu_run_records_every_variant_next_to_its_floor_on_cpu():
  """bench_moe --activation swiglu at a small shape on CPU devices: every
  variant runs (nn.MoE on the reference), each record carries its floor
  from the dense rates measured in the run, and the ratios to bf16 and to
  the JAX-native layer are filled in (over every CPU device)."""
  bm, sw = _bench("bench_moe"), _bench("moe_swiglu")
  shape = bm.MoEShape(tokens=32, hidden=128, ffn=128, experts=8, topk=2)
  records = sw.run(shape, quick=True)
  impls = {r["impl"]: r for r in records}
  assert set(impls) == {"jax_ep", "jax_ep_fp8", "jax_ep_fp8_cached", "jax_ep_fp8_weight_cast",
                        "jax_native_dense_a2a", "jax_ep_inference", "jax_ep_fp8_inference"}
  for impl, r in impls.items():
    assert r["activation"] == "swiglu" and r["time_us"] > 0, impl
    if r["kind"] != "cast":
      assert r["floor_us"] > 0 and r["share_of_floor"] > 0, impl
    assert r["bytes_floor_us"] > 0, impl
  # The weights' bytes of one rank (8 experts over the 8 CPU devices): a bf16
  # step reads them twice and writes their gradients; the cached FP8 step
  # reads half as many bytes twice and writes bf16 gradients.
  w16 = 2 * (8 // len(jax.devices())) * 128 * 3 * 128
  assert impls["jax_ep"]["weight_gbytes"] * 1e9 == pytest.approx(3 * w16)
  assert impls["jax_ep_fp8_cached"]["weight_gbytes"] * 1e9 == pytest.approx(2 * w16, rel=1e-3)
  assert impls["jax_ep_fp8_inference"]["weight_gbytes"] * 1e9 == pytest.approx(w16 / 2, rel=1e-3)
  assert impls["jax_ep"]["speedup_vs_jax_ep_bf16"] == 1.0
  assert impls["jax_ep_fp8_inference"]["speedup_vs_jax_ep_bf16"] > 0
  assert impls["jax_ep_fp8"]["speedup_vs_jax_native"] > 0
  assert impls["jax_ep_fp8"]["gemm_tflops"] == pytest.approx(3 * impls["jax_ep_inference"]["gemm_tflops"])


def test_mega_moe_bench_records_the_unfused_path_and_the_fused_refusal_on_cpu():
  """bench_mega_moe at a small shape on CPU devices: the op's automatic
  choice is timed next to its floors and sets the fused target; the fused
  kernels, which this build lacks, leave a record that says why it has no
  time rather than a missing row."""
  bm, mm = _bench("bench_moe"), _bench("bench_mega_moe")
  shape = bm.MoEShape(tokens=32, hidden=128, ffn=128, experts=16, topk=2)
  records = {r["impl"]: r for r in mm.run(shape, quick=True)}
  assert set(records) == {"jax_ep_fp8", "jax_ep_fused"}
  unfused, fused = records["jax_ep_fp8"], records["jax_ep_fused"]
  assert unfused["bench"] == "moe_forward" and unfused["ranks"] == len(jax.devices())
  assert unfused["time_us"] > 0 and unfused["failed"] is None
  assert unfused["floor_us"] > 0 and unfused["bytes_floor_us"] > 0
  assert unfused["fused_target_us"] == pytest.approx(0.9 * unfused["time_us"])
  assert unfused["ratio_to_unfused"] == 1.0
  assert fused["time_us"] is None and fused["failed"] and fused["ratio_to_unfused"] is None
  # 16 experts over the devices, each w13 [H, 2F] and w2 [F, H] in e4m3
  # with one f32 scale per 128 x 128 block.
  e_l = 16 // len(jax.devices())
  assert unfused["weight_gbytes"] * 1e9 == pytest.approx(e_l * 3 * 128 * 128 * (1 + 4 / 128**2))
  assert mm.is_grouped_gemm("cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<")
  assert not mm.is_grouped_gemm("void jax_ep::DispatchDataKernel<")


def test_grouped_gemm_profile_reader_sums_gpu_kernels_per_call(tmp_path):
  """bench_grouped_gemm's trace reader on a synthetic Perfetto trace: only
  GPU-timeline kernel events count, grouped by family, per call."""
  import gzip
  import json
  bg = _bench("bench_grouped_gemm")
  evs = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
  ]
  for call in range(3):
    t0 = call * 100.0
    evs += [
        {"ph": "X", "pid": 1, "name": "void jax_ep::gg::PrepGroups<...>", "ts": t0, "dur": 2.0},
        {"ph": "X", "pid": 1, "name": "void cutlass::device_kernel<GemmUniversal<...>>",
         "ts": t0 + 3, "dur": 80.0},
        {"ph": "X", "pid": 2, "name": "cudaLaunchKernelEx", "ts": t0, "dur": 5.0},  # host: ignored
    ]
  d = tmp_path / "plugins" / "profile" / "x"
  d.mkdir(parents=True)
  with gzip.open(d / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": evs}, f)
  summ = bg.kernel_summary(_bench("bench_normal").gpu_kernel_events(str(tmp_path)), calls=3)
  assert summ == {"PrepGroups": 2.0, "GemmUniversal": 80.0, "all_kernels": 82.0}


def test_concurrency_counts_communication_beside_compute_on_other_streams_only():
  """concurrent_us: the µs of communication kernels during which a compute
  kernel of another stream ran; compute on the same stream, other
  communication, and the XLA op lines (spans, not kernels) do not count."""
  bn, bm = _bench_normal(), _bench("bench_moe")
  evs = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "Stream #9"}},
      {"ph": "M", "name": "thread_name", "pid": 1, "tid": 3, "args": {"name": "XLA Ops"}},
      # side stream 9: a dispatch of 100 us, compute on stream 7 covers 30 + 20 of it
      {"ph": "X", "pid": 1, "tid": 9, "name": "jax_ep::DispatchDataKernel", "ts": 100.0, "dur": 100.0},
      {"ph": "X", "pid": 1, "tid": 7, "name": "cutlass GemmUniversal", "ts": 70.0, "dur": 60.0},
      {"ph": "X", "pid": 1, "tid": 7, "name": "loop_fusion", "ts": 150.0, "dur": 20.0},
      {"ph": "X", "pid": 1, "tid": 7, "name": "loop_fusion_2", "ts": 160.0, "dur": 5.0},
      {"ph": "X", "pid": 1, "tid": 7, "name": "jax_ep::CombineDataKernel", "ts": 180.0, "dur": 10.0},
      # stream 7: a combine, compute after it on its own stream only
      {"ph": "X", "pid": 1, "tid": 7, "name": "jax_ep::CombineDataKernel", "ts": 300.0, "dur": 40.0},
      {"ph": "X", "pid": 1, "tid": 7, "name": "loop_fusion_3", "ts": 340.0, "dur": 40.0},
      {"ph": "X", "pid": 1, "tid": 3, "name": "custom-call.1", "ts": 0.0, "dur": 1000.0},
  ]
  comm, both = bn.concurrent_us(bn._gpu_events(evs, {1: "/device:GPU:0"}), bm._is_comm)
  assert comm == 150.0 and both == 50.0


def test_chain_times_counts_the_kernels_it_saw_per_call():
  """A chain whose calls XLA dropped shows fewer than one kernel per call
  (2026-12-03: a last-output-only chain kept 1 of 50 fetches)."""
  bn = _bench_normal()
  evs = [dict(name="EngramFetchKernel", ts=10.0 * i, dur=5.0, line=(1, 7)) for i in range(4)]
  evs.append(dict(name="loop_fusion", ts=100.0, dur=2.0, line=(1, 7)))
  full = bn.chain_times(evs, "EngramFetch", calls=4)
  assert full["kernels_per_call"] == 1.0 and full["kernel_us"] == 5.0 and full["gap_us"] == 10.0
  assert bn.chain_times(evs[:1], "EngramFetch", calls=4)["kernels_per_call"] == 0.25
  assert bn.chain_times([], "EngramFetch", calls=4)["kernels_per_call"] == 0.0


def test_setup_stamps_reads_the_kernels_lines_and_drops_each_layouts_first_call():
  ss = _bench("setup_stamps")
  line = ("jax_ep setup stamps ({lay} layout), us: zeroed 0.50 barrier1 {b:.2f} end 9.00"
          " | rank prep x1: first start 0.20, last end 4.00, longest 3.80")
  text = "\n".join(["other output", line.format(lay="rank", b=50.0)]
                   + [line.format(lay="rank", b=b) for b in (1.0, 2.0, 3.0)]
                   + [line.format(lay="expert", b=7.0)] * 2
                   + [line.format(lay="expert", b=70.0).replace("end 9.00", "end 9.00 | expert prep x128:"
                                                               " first start 0.30, last end 9.00,"
                                                               " longest 8.50")])
  got = ss.parse(text)
  assert got["rank"]["barrier1"] == 2.0 and got["rank"]["rank_prep_longest"] == 3.8
  assert got["expert"]["barrier1"] == 38.5 and got["expert"]["expert_prep_last_end"] == 9.0


def test_moe_profile_families_split_dispatch_combine_from_gemms():
  bm, bg = _bench("bench_moe"), _bench("bench_grouped_gemm")
  evs = [dict(name="jax_ep::DispatchDataKernel", dur=30.0),
         dict(name="jax_ep::CombineDataKernel", dur=20.0),
         dict(name="jax_ep::DispatchLayoutKernel", dur=5.0),
         dict(name="cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<"
              "cute::tuple<int, int, int>, cutlass::layout::RowMajor*, ...>>", dur=100.0),
         dict(name="loop_fusion_3", dur=50.0)]
  summ = bg.kernel_summary(evs, calls=1, families=bm.STEP_FAMILIES)
  assert summ["dispatch_combine"] == 55.0 and summ["expert_gemms"] == 100.0
  assert summ["all_kernels"] == 205.0


def test_moe_bench_shared_expert_overlap_records_equal_steps_on_cpu():
  """bench_moe's shared-expert layer with and without the overlap (start /
  done) gives bit-identical losses and gradients, so both get timed and
  recorded, with the share of a dispatch the overlap hid."""
  from jax.sharding import Mesh
  import numpy as np
  bm = _bench("bench_moe")
  mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
  shape = bm.MoEShape(tokens=16, hidden=128, ffn=64, experts=8, topk=2)
  x, params = bm.make_inputs(shape, mesh, jax.random.key(5))
  recs = bm._overlap_records(shape, mesh, x, params, quick=True)
  assert [r["impl"] for r in recs] == ["jax_ep_shared", "jax_ep_shared_overlap"]
  assert all(r["time_us"] > 0 and r["dispatch_us"] > 0 for r in recs)
  assert "dispatch_hidden_share" in recs[-1]


def _bench_normal():
  return _bench("bench_normal")


def test_ragged_modes_run_each_flag_in_its_own_process_and_record_refusals(monkeypatch, tmp_path):
  import json
  import subprocess
  import types
  bn = _bench_normal()
  seen = []

  def fake_run(cmd, env, capture_output, text, timeout):
    flag = env["XLA_FLAGS"].split()[-1]
    seen.append(flag)
    out = cmd[cmd.index("--out") + 1]
    if "symmetric" in flag.lower():  # as a plugin without the flag would answer
      return types.SimpleNamespace(returncode=1, stdout="",
                                   stderr=f"Unknown flag in XLA_FLAGS: {flag}")
    os.makedirs(os.path.join(out, "normal"))  # the child adds its run file there
    with open(os.path.join(out, "normal", "2026-01-01_abc1234_1.json"), "w") as f:
      json.dump([dict(bench="normal_dispatch", impl="jax_ragged_all_to_all", dtype="bf16",
                      tokens_per_rank=64, time_us=123.0)], f)
    return types.SimpleNamespace(returncode=0, stdout="", stderr="")

  monkeypatch.setattr(subprocess, "run", fake_run)
  recs = bn.ragged_modes(bn.Shape(tokens=64), str(tmp_path))
  assert seen == list(bn.RAGGED_XLA_MODES.values())
  by = {r["impl"]: r for r in recs}
  assert by["jax_ragged_all_to_all[one_shot]"]["time_us"] == 123.0
  assert by["jax_ragged_all_to_all[one_shot]"]["xla_flags"] == bn.RAGGED_XLA_MODES["one_shot"]
  sym = by["jax_ragged_all_to_all[symmetric_memory]"]
  assert sym["time_us"] is None and sym["failed"] == "flag not accepted"
  print(bn._table(recs))


def test_moe_ragged_layer_runs_again_under_the_symmetric_memory_flag(monkeypatch):
  """bench_moe's MaxText-style layer, once more in its own process with the
  symmetric-memory flag: the record is renamed and carries the flag; a
  refused flag gives a record that says so."""
  import json
  import subprocess
  import types
  bm = _bench("bench_moe")
  seen = []

  def fake_run(cmd, env, capture_output, text, timeout, accept=True):
    seen.append((cmd, env["XLA_FLAGS"]))
    if not accept:
      return types.SimpleNamespace(returncode=1, stdout="",
                                   stderr="Unknown flag in XLA_FLAGS: ...")
    out = cmd[cmd.index("--out") + 1]
    os.makedirs(os.path.join(out, "moe"))  # the child adds its run file there
    with open(os.path.join(out, "moe", "2026-01-01_abc1234_1.json"), "w") as f:
      json.dump([dict(bench="moe_step", impl="jax_native_ragged_a2a", tokens_per_rank=512,
                      time_us=9876.0)], f)
    return types.SimpleNamespace(returncode=0, stdout="", stderr="")

  monkeypatch.setattr(subprocess, "run", fake_run)
  (rec,) = bm.symmetric_memory_ragged(512, quick=True)
  cmd, flags = seen[-1]
  assert flags.endswith(_bench_normal().RAGGED_XLA_MODES["symmetric_memory"])
  assert cmd[cmd.index("--impls") + 1] == "jax_native_ragged_a2a" and "--no-ragged-modes" in cmd
  assert rec["impl"] == "jax_native_ragged_a2a[symmetric_memory]" and rec["time_us"] == 9876.0
  monkeypatch.setattr(subprocess, "run", lambda *a, **k: fake_run(*a, **k, accept=False))
  (rec,) = bm.symmetric_memory_ragged(512, quick=True)
  assert rec["time_us"] is None and rec["failed"] == "flag not accepted"


def test_soak_runs_on_cpu_with_the_reference():
  """benchmarks/soak.py's loop (chunks, drift check, memory, record) on 8 CPU
  devices with the reference backend, so the GPU run meets no script bug."""
  import numpy as np
  from jax.sharding import Mesh
  soak = _bench("soak")
  mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
  rec = soak.run_soak(mesh, backend="reference", pairs=6, chunk=3, max_seconds=60, tokens=16,
                      hidden=128)
  assert rec["status"] == "ok", rec
  assert rec["pairs"] == 6 and rec["pairs_per_s"] > 0


def test_soak_memory_growth_ignores_churn_and_sees_a_leak():
  growth = _bench("soak").memory_growth
  mib = 1 << 20
  churn = [[12 * mib], [16 * mib], [12 * mib], [16 * mib], [16 * mib], [12 * mib]]
  assert growth(churn) == (0, 4 * mib)
  leak = [[12 * mib + i * mib] for i in range(6)]
  assert growth(leak)[0] == 3 * mib
  assert growth([[1]]) == (None, None)


def test_bench_normal_warms_every_variant_up_before_it_times_any(monkeypatch):
  """docs/design.md §6: all of bench_normal's variants are compiled and run once
  before the first is timed (a variant timed first must not meet a colder
  GPU than the rest). On CPU with the reference and the dense all_to_all."""
  bn = _bench_normal()
  events, probing = [], []
  adaptive, time_chain = bn._adaptive_iters, bn._time_chain

  def adaptive_logged(*a, **k):  # a variant's first compile and run
    events.append("warm")
    probing.append(1)
    try:
      return adaptive(*a, **k)
    finally:
      probing.pop()

  def time_chain_logged(*a, **k):  # the timing (not the probe inside adaptive)
    if not probing:
      events.append("time")
    return time_chain(*a, **k)

  monkeypatch.setattr(bn, "_adaptive_iters", adaptive_logged)
  monkeypatch.setattr(bn, "_time_chain", time_chain_logged)
  recs = bn.run(bn.Shape(tokens=32, hidden=256, topk=2, experts=8, ranks=2), quick=True,
                impls=["reference", "jax_all_to_all"])
  assert {(r["bench"], r["impl"], r["dtype"]) for r in recs} >= {
      ("normal_dispatch", "reference", "bf16"), ("normal_dispatch", "reference", "fp8"),
      ("normal_combine", "reference", "bf16"), ("normal_dispatch", "jax_all_to_all", "bf16"),
      ("normal_combine", "jax_all_to_all", "bf16")}
  assert all(r["time_us"] > 0 for r in recs)
  first_time = events.index("time")
  assert "warm" not in events[first_time:], events
  assert events.count("time") == len(recs)


def test_bench_normal_counts_rows_per_rank_or_per_expert():
  """NVLink / logical bytes of one rank's rows: per (token, destination
  rank) for dispatch and rank-layout combine, per (token, expert) for the
  expert-layout combine (jax_ep_expert)."""
  import numpy as np
  bn = _bench_normal()
  shape = bn.Shape(tokens=2, hidden=8, topk=3, experts=4, ranks=2)  # 2 experts per rank
  # rank 0: token 0 -> experts 0, 1, 2 (ranks 0, 0, 1); token 1 -> 3, -1, -1 (rank 1)
  # rank 1: token 0 -> 0, 2, 3 (ranks 0, 1, 1); token 1 -> -1, -1, -1
  idx = np.array([[0, 1, 2], [3, -1, -1], [0, 2, 3], [-1, -1, -1]])
  assert bn._bytes(idx, shape, 10) == ((2 * 10 + 1 * 10) / 2, (3 * 10 + 2 * 10) / 2)
  assert bn._bytes(idx, shape, 10, per_expert=True) == ((2 * 10 + 1 * 10) / 2, (4 * 10 + 3 * 10) / 2)


def test_digest_chain_keeps_every_call_returns_one_array_and_adds_no_collective():
  """bench_normal._digest: one output holding each rank's first element of
  every call's every output, so no call is dead, with no collective."""
  import numpy as np
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jax_ep

  bn = _bench_normal()
  devs = jax.devices()[:4] if len(jax.devices()) >= 4 else jax.devices()
  R = len(devs)
  mesh = Mesh(np.array(devs), ("ep",))
  fn = jax_ep.shard_map(lambda v: (v * 2.0, (v + 1.0).astype(jnp.bfloat16)), mesh)
  x = jax.device_put(jnp.arange(R * 3 * 5, dtype=jnp.float32).reshape(R * 3, 5) + 1.0,
                     NamedSharding(mesh, P("ep")))
  iters = 3
  step = bn._chain(fn, iters, digest=mesh)
  hlo = step.lower(x).compile().as_text()
  for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter"):
    assert op not in hlo, op
  got = np.asarray(step(x))
  outs = bn._chain(fn, iters)(x)
  leaves = jax.tree.leaves(outs)
  assert got.shape == (R * iters * 2,)
  want = np.concatenate([[np.asarray(l, np.float32).reshape(R, -1)[r, 0] for l in leaves] for r in range(R)])
  np.testing.assert_array_equal(got, want)


def test_bench_normal_sweep_chains_enough_calls_and_keeps_xlas_outputs(monkeypatch):
  """--sweep's timing: chain_calls gives at least SWEEP_MIN_CALLS calls and
  about SWEEP_STEP_S of work per step (capped); run(sweep=True) times that
  many calls per step; XLA's own pipelines (the reference here) keep every
  output, since under a digest XLA may shrink them (jax_ep's custom calls
  get the digest). On CPU with the reference and limits made small (the
  real ones would compile 50+ calls)."""
  bn = _bench_normal()
  assert bn.chain_calls(1.0) == bn.SWEEP_MIN_CALLS
  assert bn.chain_calls(bn.SWEEP_STEP_S / 200) == max(bn.SWEEP_MIN_CALLS, 200)
  assert bn.chain_calls(1e-9) == bn.SWEEP_MAX_CALLS
  assert bn.chain_calls(0.0) == bn.SWEEP_MAX_CALLS
  monkeypatch.setattr(bn, "SWEEP_MIN_CALLS", 2)
  monkeypatch.setattr(bn, "SWEEP_MAX_CALLS", 3)
  monkeypatch.setattr(bn, "SWEEP_PROBE_CALLS", 2)
  chains = []
  chain = bn._chain

  def chain_logged(fn, iters, digest=None):
    chains.append((iters, digest is not None))
    return chain(fn, iters, digest)

  monkeypatch.setattr(bn, "_chain", chain_logged)
  recs = bn.run(bn.Shape(tokens=16, hidden=128, topk=2, experts=8, ranks=2), quick=False,
                impls=["reference"], sweep=True)
  assert {(r["bench"], r["dtype"]) for r in recs} >= {("normal_dispatch", "bf16"), ("normal_combine", "bf16")}
  assert all(2 <= r["calls_per_step"] <= 3 and r["time_us"] > 0 for r in recs)
  assert chains and not any(d for _, d in chains)  # probes and timed steps: every output
  assert {r["calls_per_step"] for r in recs} <= {n for n, _ in chains}


def test_records_add_a_file_per_run_and_never_overwrite(monkeypatch, tmp_path):
  """benchmarks/records.py: every record carries the run's machine, date,
  commit and command (with the settings that change what ran) and what
  ran; a second run of the same commit on the same day adds a file."""
  import json
  rec = _bench("records")
  monkeypatch.setenv("JAX_EP_COMMIT", "abc1234")
  monkeypatch.setenv("JAX_EP_BENCH_RANKS", "1")
  monkeypatch.setenv("JAX_EP_CUDA", "ON")  # a build switch: not part of the command
  paths = []
  for t in (10.0, 11.0):
    rs = [dict(bench="normal_dispatch", impl="jax_ep", dtype="bf16", time_us=t),
          dict(bench="normal_dispatch", impl="jax_all_to_all", dtype="bf16", time_us=2 * t)]
    rec.stamp(rs, "1x NVIDIA H200", date="2026-12-04T10:00:00+00:00",
              argv=[os.path.join(BENCH, "bench_normal.py"), "--out", "/tmp/x"])
    paths.append(rec.write(rs, str(tmp_path), "normal"))
  assert [os.path.basename(p) for p in paths] == ["2026-12-04_abc1234_1.json",
                                                  "2026-12-04_abc1234_2.json"]
  first, second = (json.load(open(p)) for p in paths)
  assert first[0]["time_us"] == 10.0 and second[0]["time_us"] == 11.0
  r = first[0]
  assert (r["machine"], r["commit"], r["date"]) == ("1x NVIDIA H200", "abc1234",
                                                    "2026-12-04T10:00:00+00:00")
  assert r["command"] == "JAX_EP_BENCH_RANKS=1 python benchmarks/bench_normal.py --out /tmp/x"
  assert (first[0]["path"], first[1]["path"]) == ("cuda", "xla")
  assert rec.latest(str(tmp_path), "normal")[0]["time_us"] == 11.0


def test_records_name_the_transport_the_communicator_reports():
  import types
  rec = _bench("records")
  for info, want in (([dict(nranks=1, lsa_size=1, gin_mask=0, gin_emulated=False)], "local"),
                     ([dict(nranks=2, lsa_size=2, gin_mask=0, gin_emulated=False)] * 2, "lsa"),
                     ([dict(nranks=2, lsa_size=2, gin_mask=2, gin_emulated=True)] * 2, "gin_emulated"),
                     ([dict(nranks=2, lsa_size=1, gin_mask=2, gin_emulated=False)], "gin")):
    rec.note_communicator(types.SimpleNamespace(info=lambda info=info: info))
    (r,) = rec.stamp([dict(bench="b", impl="jax_ep_kernels")], "m", date="2026-12-04")
    assert r["transport"] == want
  (r,) = rec.stamp([dict(bench="b", impl="reference")], "m", date="2026-12-04")
  assert "transport" not in r and r["path"] == "reference"
  rec._transport = None
