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
