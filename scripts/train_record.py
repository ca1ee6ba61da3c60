"""Turns the JSON of a `python -m jax_ep.train` run into a training-quality
record under benchmarks/results/train/ (docs/design.md §6).

  python scripts/train_record.py <train.json> [--plot <png>] [--commit <sha>] [--machine TEXT]
                                 [--note TEXT]

The JSON may come from this machine or from a GPU machine (the run's $OUT):
the record carries the run's own command and date (from the JSON), the
commit the run was made at (--commit; else this checkout's HEAD, "+dirty"
where tracked files differ) and the machine (--machine; else from the
JSON's devices). One record per trained run (bf16 and fp8 for
`--compare-fp8`), each with its train and held-out eval curves; the FP8
record carries its gap to the bf16 run of the same start. Written as
`<date>_<commit>_<n>.json` with the first free n (never over an earlier
record), the plot copied beside it as `<same stem>.png`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import records  # noqa: E402

# An FP8 run counts as matching bf16 where its final eval loss is within this
# relative gap of the bf16 run's (issue 40).
TOLERANCE = 0.02


def machine_of(result: dict) -> str:
  """"1x NVIDIA H100 80GB HBM3" on GPUs; on CPU the virtual devices and the
  host's cores (they share them)."""
  if result.get("platform") == "cpu":
    cores = result.get("host_cpus")
    return (f"CPU, {result.get('devices')} virtual devices"
            + (f" ({cores} shared cores, no GPU)" if cores else " (no GPU)"))
  return f"{result.get('devices')}x {result.get('device_kind') or result.get('platform')}"


def _finite(xs) -> list[float]:
  return [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def _run_record(name: str, run: dict, result: dict) -> dict:
  a = result["args"]
  losses = run["losses"]
  tail = max(1, len(losses) // 10)
  fin = _finite(losses[-tail:])
  ev = run.get("eval") or {}
  ev_batches = ev.get("batch_losses") or []
  nonfinite = sum(1 for x in losses if not (isinstance(x, (int, float)) and math.isfinite(x)))
  nonfinite += sum(1 for b in ev_batches for x in b if not math.isfinite(x))
  fp8 = name == "fp8" or (a.get("fp8") and name not in ("bf16",))
  steady = sorted(run.get("step_times_s", [])[1:]) or [None]
  return dict(
      bench="train_quality",
      impl="jax_ep_fp8" if fp8 else "jax_ep",
      run=name,
      dtype="fp8" if fp8 else "bf16",
      activation=a.get("activation"), hidden=a.get("hidden"), ffn=a.get("ffn"),
      experts=a.get("experts_per_rank", 0) * (result.get("devices", 1) // max(1, a.get("dp", 1))),
      experts_per_rank=a.get("experts_per_rank"), topk=a.get("topk"),
      ranks=result.get("devices", 1) // max(1, a.get("dp", 1)), dp=a.get("dp"),
      layers=a.get("layers"), batch=a.get("batch"), seq=a.get("seq"), steps=a.get("steps"),
      lr=a.get("lr"), lr_schedule=a.get("lr_schedule", "auto"),
      warmup_steps=a.get("warmup_steps", 0), seed=a.get("seed"),
      first_loss=losses[0] if losses else None,
      final_loss=losses[-1] if losses else None,
      tail_mean_loss=sum(fin) / len(fin) if fin else None, tail_steps=tail,
      eval_every=a.get("eval_every") or None,
      eval_batches=len(ev_batches[-1]) if ev_batches else None,
      first_eval_loss=ev["losses"][0] if ev.get("losses") else None,
      final_eval_loss=ev["losses"][-1] if ev.get("losses") else None,
      nonfinite_losses=nonfinite,
      median_step_s=steady[len(steady) // 2],
      tokens_per_s=run.get("tokens_per_s"),
      path=("cuda" if result.get("kernels") and a.get("backend") != "reference"
            and name != "reference" else "reference"),
      losses=losses, lrs=run.get("lrs"),
      eval_steps=ev.get("steps"), eval_losses=ev.get("losses"), eval_batch_losses=ev_batches)


def make_records(result: dict, *, commit: str, machine: Optional[str] = None,
                 date: Optional[str] = None) -> list[dict]:
  """The records of one training run's JSON (see the module docstring)."""
  recs = [_run_record(name, run, result) for name, run in result["runs"].items()]
  by_run = {r["run"]: r for r in recs}
  if "bf16" in by_run and "fp8" in by_run:
    b, f = by_run["bf16"], by_run["fp8"]
    b.update(relative_difference=None, tail_relative_difference=None, eval_relative_gap=None)
    f["relative_difference"] = (f["final_loss"] - b["final_loss"]) / abs(b["final_loss"])
    if b["tail_mean_loss"] and f["tail_mean_loss"] is not None:
      f["tail_relative_difference"] = (f["tail_mean_loss"] - b["tail_mean_loss"]) / abs(
          b["tail_mean_loss"])
    if "fp8_eval_relative_gap" in result:
      f["eval_relative_gap"] = result["fp8_eval_relative_gap"]
      f["eval_paired_se"] = result["fp8_eval_paired_se"]
      f["within_tolerance"] = (abs(f["eval_relative_gap"]) <= TOLERANCE
                               and f["nonfinite_losses"] == 0 and b["nonfinite_losses"] == 0)
      f["tolerance"] = TOLERANCE
  run = dict(machine=machine or machine_of(result),
             date=date or result.get("date") or records.now(), commit=commit,
             command=result.get("command") or "python -m jax_ep.train "
             + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in result["args"].items()))
  for r in recs:
    r.update(run)
  return recs


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("json", help="the run's --json output")
  ap.add_argument("--plot", default=None, help="the run's --plot PNG, copied beside the record")
  ap.add_argument("--commit", default=None,
                  help="the commit the run was made at (default: this checkout's HEAD)")
  ap.add_argument("--machine", default=None, help="default: from the JSON's devices")
  ap.add_argument("--note", action="append", default=[],
                  help="a note on the run, shown with it on the results page (repeatable)")
  ap.add_argument("--out", default=records.RESULTS_DIR,
                  help="results directory (the record goes to <out>/train/)")
  args = ap.parse_args(argv)
  with open(args.json) as f:
    result = json.load(f)
  recs = make_records(result, commit=args.commit or records.commit(), machine=args.machine)
  for r in recs:
    if args.note:
      r["record_notes"] = list(args.note)
  path = records.write(recs, args.out, "train")
  show = lambda p: os.path.relpath(p, REPO) if p.startswith(REPO + os.sep) else p  # noqa: E731
  print(f"wrote {show(path)}")
  if args.plot:
    png = path[:-len(".json")] + ".png"
    shutil.copyfile(args.plot, png)
    print(f"wrote {show(png)}")
  for r in recs:
    gap = r.get("eval_relative_gap")
    print(f"  {r['run']}: final loss {r['final_loss']:.4f}"
          + (f", final eval loss {r['final_eval_loss']:.4f}" if r.get("final_eval_loss") else "")
          + (f", eval gap to bf16 {gap:+.2%} (paired SE {r['eval_paired_se']:.2%})"
             if gap is not None else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
