"""A test run's junit.xml as a test record under benchmarks/results/tests/.

  python scripts/junit_record.py junit.xml [--out benchmarks/results] [--gpus N]
      [--commit SHA] [--date ISO] [--machine "1x NVIDIA H200"] [--command "..."]

The record says which commit ran which test on which machine, and how each
ended; scripts/results_page.py reads the validation table from these
records. scripts/gpu_check.sh runs this on the junit.xml of its GPU tests.
The commit comes from --commit, JAX_EP_COMMIT or git; the date from
--date or the junit file's timestamp; the machine from --machine or
nvidia-smi.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import records  # noqa: E402


def cases(root: ET.Element) -> list[dict]:
  """[{file, name, outcome, time_s}]: outcome passed / failed / error /
  skipped / xfailed (a strict xfail that failed as expected) / xpassed."""
  out = []
  for c in root.iter("testcase"):
    mod = c.get("classname", "")
    file = mod.replace(".", "/") + ".py" if mod else c.get("file", "")
    outcome = "passed"
    for child in c:
      tag, typ = child.tag, child.get("type", "")
      if tag == "failure":
        outcome = "xpassed" if "XPASS" in (child.get("message") or "") else "failed"
      elif tag == "error":
        outcome = "error"
      elif tag == "skipped":
        outcome = "xfailed" if typ == "pytest.xfail" else "skipped"
    rec = dict(file=file, name=c.get("name", ""), outcome=outcome,
               time_s=round(float(c.get("time", 0) or 0), 3))
    if outcome == "skipped":
      rec["why"] = next((s.get("message", "") for s in c.findall("skipped")), "")[:200]
    out.append(rec)
  return out


def _machine() -> str:
  try:
    names = subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                    stderr=subprocess.DEVNULL, timeout=30).decode().split("\n")
    names = [n.strip() for n in names if n.strip()]
    if names:
      return f"{len(names)}x {'/'.join(sorted(set(names)))}"
  except Exception:  # noqa: BLE001 - no GPU tool: say so
    pass
  return "unknown (no nvidia-smi)"


def _junit_date(root: ET.Element) -> str | None:
  for s in ([root] if root.tag == "testsuite" else list(root.iter("testsuite"))):
    ts = s.get("timestamp")
    if ts:
      t = datetime.datetime.fromisoformat(ts)
      if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
      return t.astimezone(datetime.timezone.utc).isoformat(timespec="seconds")
  return None


def make_record(junit: str, *, gpus: int, commit: str | None = None, date: str | None = None,
                machine: str | None = None, command: str | None = None,
                note: str | None = None) -> dict:
  root = ET.parse(junit).getroot()
  cs = cases(root)
  totals = {k: sum(1 for c in cs if c["outcome"] == k)
            for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
  rec = dict(bench="tests", machine=machine or _machine(),
             date=date or _junit_date(root) or records.now(), commit=commit or records.commit(),
             command=command or "unknown", gpus=gpus, totals=totals, cases=cs)
  if note:
    rec["note"] = note
  return rec


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("junit")
  ap.add_argument("--out", default=records.RESULTS_DIR, help="the records' root (its tests/ is written)")
  ap.add_argument("--gpus", type=int, default=int(os.environ.get("JAX_EP_TEST_GPUS", "0") or 0),
                  help="GPUs the tests used (JAX_EP_TEST_GPUS): 1 is EP1, 2 EP2")
  ap.add_argument("--commit")
  ap.add_argument("--date")
  ap.add_argument("--machine")
  ap.add_argument("--command")
  ap.add_argument("--note")
  args = ap.parse_args(argv)
  rec = make_record(args.junit, gpus=args.gpus, commit=args.commit, date=args.date,
                    machine=args.machine, command=args.command, note=args.note)
  path = records.new_path(args.out, "tests", rec["date"], rec["commit"])
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "x") as f:
    json.dump(rec, f, indent=1)
    f.write("\n")
  t = rec["totals"]
  print(f"{path}: {t['passed']} passed, {t['failed'] + t['error']} failed, {t['skipped']} skipped")
  return 0


if __name__ == "__main__":
  sys.exit(main())
