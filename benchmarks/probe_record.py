"""Records (docs/design.md §6) from the standalone CUDA probes' printouts:
`mega_linear1_probe` and `grouped_gemm_configs`' FP8 forward schedules
(CFG 14-17). The probes are plain CUDA programs with no Python, so
scripts/gpu_probes.sh runs them and this file turns their lines into one
run file under <out>/grouped_gemm/, stamped like every other record.

  python benchmarks/probe_record.py --out DIR --machine "1x NVIDIA H200" \
      --command "..." LOG [LOG ...]
"""
from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import records as rec  # noqa: E402

# The fused linear 1 at EP1 (docs/mega_moe.md): 4096 tokens, top-8 of 256.
LINEAR1 = dict(dtype="fp8", experts=256, tokens=4096, topk=8, hidden=7168, ffn=2048)
_MS = r"([0-9.]+) ms"
_VARIANT = re.compile(r"^fused linear 1 v(\d) \(.*\): " + _MS + r".*ratio to GEMM 1 alone ([0-9.]+)")
_CHECK = re.compile(r"^fused linear 1 v(\d).* check: .*?(\d+) outside the bound, worst err/bound "
                    r"([0-9.]+)")
_CUTLASS = re.compile(r"^CUTLASS grouped FP8 GEMM 1 alone .*: " + _MS)
_PART = re.compile(r"^part: (.*): " + _MS + r"  weights ([0-9.]+) TB/s  ratio to v0 ([0-9.]+)")
_CFG_ROW = re.compile(r"^  (uniform|routed)\s+rows\s+(\d+)\s+" + _MS)
_CFG_EP1 = re.compile(r"^  linear 1 at EP1 \(256 groups, rows (\d+), N (\d+)\)\s+" + _MS
                      + r".*weights ([0-9.]+) TB/s")


def _us(ms: str) -> float:
  return round(float(ms) * 1e3, 1)


def parse_linear1(lines: list[str]) -> list[dict]:
  """mega_linear1_probe's variants, its parts of v0 and the CUTLASS GEMM 1."""
  checks, out = {}, []
  for line in lines:
    if m := _CHECK.match(line):
      bad, worst = int(m.group(2)), float(m.group(3))
      checks[m.group(1)] = ("passed" if bad == 0 else f"FAILED: {bad} outside the bound") + \
          f", worst {worst:.3f} of the bound"
  for line in lines:
    if m := _VARIANT.match(line):
      out.append(dict(bench="mega_linear1_probe", impl=f"fused_linear1_v{m.group(1)}",
                      time_us=_us(m.group(2)), ratio_to_cutlass_gemm1=float(m.group(3)),
                      check=checks.get(m.group(1), "not printed"), **LINEAR1))
    elif m := _CUTLASS.match(line):
      out.append(dict(bench="mega_linear1_probe", impl="cutlass_grouped_fp8_gemm1",
                      time_us=_us(m.group(1)), **LINEAR1))
    elif m := _PART.match(line):
      out.append(dict(bench="mega_linear1_probe", impl="fused_linear1_v0_part",
                      part=m.group(1), time_us=_us(m.group(2)), weight_tbps=float(m.group(3)),
                      ratio_to_v0=float(m.group(4)), **LINEAR1))
  return out


def parse_configs(lines: list[str]) -> list[dict]:
  """grouped_gemm_configs' FP8 forward (CFG 14-17): the schedule's name is
  its first line."""
  if not lines:
    return []
  schedule, out = lines[0].strip(), []
  for line in lines[1:]:
    if m := _CFG_ROW.match(line):
      out.append(dict(bench="grouped_gemm_config", impl=f"cutlass[{schedule}]", dtype="fp8",
                      groups=128, pattern=m.group(1), rows=int(m.group(2)), hidden=7168,
                      n=2048, time_us=_us(m.group(3))))
    elif m := _CFG_EP1.match(line):
      out.append(dict(bench="grouped_gemm_config", impl=f"cutlass[{schedule}]", dtype="fp8",
                      groups=256, pattern="linear1_ep1", rows=int(m.group(1)), hidden=7168,
                      n=int(m.group(2)), time_us=_us(m.group(3)),
                      weight_tbps=float(m.group(4))))
  return out


def parse(path: str) -> list[dict]:
  with open(path) as f:
    lines = [l.rstrip("\n") for l in f]
  name = os.path.basename(path)
  found = parse_linear1(lines) if name.startswith("mega_linear1") else parse_configs(lines)
  for r in found:
    r["log"] = name
  return found


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="results directory (records go to grouped_gemm/)")
  ap.add_argument("--machine", required=True, help='e.g. "1x NVIDIA H200"')
  ap.add_argument("--command", required=True, help="what ran, as it could be typed again")
  ap.add_argument("logs", nargs="+")
  args = ap.parse_args()
  found = [r for p in args.logs for r in parse(p)]
  if not found:
    print("probe_record: no probe lines found", file=sys.stderr)
    return 1
  rec.stamp(found, args.machine)
  for r in found:
    r["command"] = args.command
    r["path"] = "cuda"
  print(rec.write(found, args.out, "grouped_gemm"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
