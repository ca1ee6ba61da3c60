"""docs/results.md is generated from benchmarks/results/ by
scripts/results_page.py: the committed page must be the script's output, so
a figure on it always has a record behind it."""
from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _page_module():
  spec = importlib.util.spec_from_file_location("results_page",
                                                os.path.join(ROOT, "scripts", "results_page.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_committed_results_page_is_the_generators_output():
  with open(os.path.join(ROOT, "docs", "results.md")) as f:
    committed = f.read()
  assert committed == _page_module().build(), (
      "docs/results.md differs from the records: run python scripts/results_page.py")


def test_every_run_file_carries_the_run_fields():
  mod = _page_module()
  for rel, recs in mod._load():
    for r in recs:
      for k in ("bench", "impl", "machine", "date", "commit", "command"):
        assert r.get(k), f"{rel}: a record lacks {k}"


def test_a_junit_file_becomes_a_test_record_and_a_validation_row(tmp_path):
  """scripts/junit_record.py keeps each case's outcome with the run's
  commit, date and machine; the page's table takes an op x path as passed
  only where every case of it passed in that run, and says "never" where
  nothing ran."""
  import json
  import sys
  junit = tmp_path / "junit.xml"
  junit.write_text(
      '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="5" '
      'timestamp="2026-12-05T10:00:00+00:00">'
      '<testcase classname="tests.test_gpu_dispatch" name="test_dispatch_bitwise[a]" time="1.0"/>'
      '<testcase classname="tests.test_gpu_dispatch" name="test_ragged_all_to_all_baseline" time="1.0"/>'
      '<testcase classname="tests.test_gpu_loopback" name="test_low_latency_kernels_x[2]" time="1.0">'
      '<failure message="boom"/></testcase>'
      '<testcase classname="tests.test_gpu_engram" name="test_engram_two_gpus" time="0">'
      '<skipped type="pytest.skip" message="needs 2 GPUs"/></testcase>'
      '<testcase classname="tests.test_gpu_engram" name="test_engram_fetch" time="0">'
      '<skipped type="pytest.xfail" message="strict"/></testcase>'
      '</testsuite></testsuites>')
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  try:
    import junit_record
  finally:
    sys.path.remove(os.path.join(ROOT, "scripts"))
  rec = junit_record.make_record(str(junit), gpus=1, commit="abc1234", machine="1x NVIDIA H200",
                                 command="bash scripts/gpu_check.sh")
  assert rec["date"] == "2026-12-05T10:00:00+00:00" and rec["commit"] == "abc1234"
  assert rec["totals"] == dict(passed=2, failed=1, error=0, skipped=1, xfailed=1, xpassed=0)
  json.loads(json.dumps(rec))
  table = "\n".join(_page_module()._validation([rec]))
  rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:]}
  ep1, virtual = 2, 3  # columns: op, reference, EP1, virtual ranks, EP2, hosts
  assert rows["dispatch / combine"].split(" | ")[ep1] == "passed 2026-12-05 at abc1234"
  assert rows["low latency"].split(" | ")[virtual] == "never passed; failed 2026-12-05 at abc1234"
  assert rows["Engram"].split(" | ")[ep1] == "passed 2026-12-05 at abc1234"  # the strict xfail counts
  assert rows["dispatch / combine"].split(" | ")[5].strip(" |") == "never"


def _train_json(*, kernels: bool, gap: float = 0.01) -> dict:
  """What `python -m jax_ep.train --compare-fp8 --eval-every 2` writes, in
  small: two runs from the same start, their train and eval curves."""
  args = dict(activation="swiglu", hidden=128, ffn=128, experts_per_rank=2, topk=2, dp=1,
              layers=1, batch=8, seq=16, steps=4, lr=1e-3, lr_schedule="cosine",
              warmup_steps=1, seed=0, eval_every=2, eval_batches=2, backend="auto", fp8=False)

  def run(scale):
    ev = [[3.5, 3.7], [1.0 * scale, 1.2 * scale], [0.4 * scale, 0.6 * scale]]
    return dict(losses=[3.6, 2.0, 1.0, 0.5 * scale], lrs=[1e-3] * 4, step_times_s=[5, 1, 1, 1],
                tokens_per_s=100.0, eval=dict(steps=[0, 2, 4], batch_losses=ev,
                                              losses=[sum(b) / 2 for b in ev]))
  return dict(args=args, command="python -m jax_ep.train --compare-fp8", date="2026-12-06T10:00:00+00:00",
              platform="gpu" if kernels else "cpu", device_kind="NVIDIA H100 80GB HBM3" if kernels
              else "cpu", devices=1 if kernels else 2, host_cpus=2, kernels=kernels,
              runs=dict(bf16=run(1.0), fp8=run(1.0 + gap)), fp8_eval_relative_gap=gap,
              fp8_eval_paired_se=0.004)


def _train_record_module():
  import sys
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  try:
    import train_record
  finally:
    sys.path.remove(os.path.join(ROOT, "scripts"))
  return train_record


def test_a_training_json_becomes_records_never_overwritten_and_both_sections(tmp_path):
  """scripts/train_record.py: a CPU and a GPU training run's JSON become
  run files under train/ (a second record of the same commit and day takes
  the next number; the plot is copied beside it); the page's CPU and GPU
  training sections each show their newest run, the FP8 gap of the final
  held-out eval with its paired standard error, and the plot."""
  import json
  tr = _train_record_module()
  src = tmp_path / "train.json"
  png = tmp_path / "train.png"
  png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
  src.write_text(json.dumps(_train_json(kernels=False)))
  out = tmp_path / "results"
  assert tr.main([str(src), "--plot", str(png), "--commit", "abc1234", "--out", str(out)]) == 0
  assert tr.main([str(src), "--commit", "abc1234", "--out", str(out)]) == 0
  names = sorted(os.listdir(out / "train"))
  assert names == ["2026-12-06_abc1234_1.json", "2026-12-06_abc1234_1.png",
                   "2026-12-06_abc1234_2.json"]
  recs = json.loads((out / "train" / names[0]).read_text())
  b, f = recs
  for r in recs:
    for k in ("bench", "impl", "machine", "date", "commit", "command"):
      assert r[k], k
  assert (b["impl"], f["impl"], b["path"]) == ("jax_ep", "jax_ep_fp8", "reference")
  assert b["machine"] == "CPU, 2 virtual devices (2 shared cores, no GPU)"
  assert f["eval_relative_gap"] == 0.01 and f["within_tolerance"] and b["nonfinite_losses"] == 0
  assert f["final_eval_loss"] == 0.5 * 1.01 and f["eval_steps"] == [0, 2, 4]
  assert b["experts"] == 4 and b["ranks"] == 2

  gpu = _train_json(kernels=True, gap=0.05)
  gpu["runs"]["fp8"]["losses"][2] = float("nan")
  src.write_text(json.dumps(gpu))
  tr.main([str(src), "--commit", "def5678", "--out", str(out)])
  g = json.loads((out / "train" / "2026-12-06_def5678_1.json").read_text())
  assert g[0]["machine"] == "1x NVIDIA H100 80GB HBM3" and g[0]["path"] == "cuda"
  assert g[1]["nonfinite_losses"] == 1 and not g[1]["within_tolerance"]

  mod = _page_module()
  mod.RESULTS = str(out)
  page = mod.build()
  cpu = page.split("## Training quality on CPU", 1)[1].split("\n## ", 1)[0]
  on_gpu = page.split("## Training quality on one GPU", 1)[1].split("\n## ", 1)[0]
  assert "train/2026-12-06_abc1234_" in cpu and "def5678" not in cpu
  assert "relative gap **+1.00%** (paired standard error 0.40%), within 2% with no non-finite" in cpu
  assert "def5678" in on_gpu and "1x NVIDIA H100 80GB HBM3" in on_gpu
  assert "**not** within 2% with some non-finite loss" in on_gpu
  assert "final_eval_loss" in cpu and "eval_paired_se" in cpu
  # The newest CPU run (number 2, no plot) is shown; the plot link is where one was kept.
  assert "abc1234_2.json" in cpu and "![loss curves" not in cpu


def test_older_training_records_without_an_eval_still_show_their_gaps():
  mod = _page_module()
  recs = [dict(bench="train_quality", dtype="bf16", final_loss=0.2, tail_steps=3),
          dict(bench="train_quality", dtype="fp8", final_loss=0.21, tail_steps=3,
               relative_difference=0.05, tail_relative_difference=-0.01)]
  text = "\n".join(mod._train_summary("train/none.json", recs))
  assert "No held-out eval" in text and "+5.00%" in text and "-1.00%" in text
