"""Benchmark records as data (docs/design.md §6): every benchmark writes
through here.

A run of a benchmark adds one file, never rewriting an earlier one:

  <out>/<name>/<YYYY-MM-DD>_<commit>_<n>.json

a JSON list of records, each carrying the fields of its measurement (`bench`,
`impl`, `dtype`, the shape fields, `time_us`, the ratios that apply) and the
run's own: `machine`, `date` (UTC, ISO), `commit`, `command` (the jax_ep /
XLA settings in the environment and the argv it ran with), and for jax_ep's
own variants what actually ran: `path` (kernels or reference) and
`transport` (how the communicator reached its peers, read from the
communicator itself). `<n>` is the first number not yet taken, so two runs
of one commit on one day are both kept. The results page
(scripts/results_page.py) is built from these files alone.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")

# Settings that change what a benchmark measures; the command records them
# beside argv because the same argv measures something else without them.
_ENV_PREFIXES = ("JAX_EP_", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES")
# Labels, build switches and CI's own paths, not settings of a run.
_ENV_LEFT_OUT = ("JAX_EP_COMMIT", "JAX_EP_CUDA", "JAX_EP_CI_VENV", "JAX_EP_CI_WHEELS")

# What each communicator a benchmark opened reported about its peers: the
# records of jax_ep's variants carry it (set by note_communicator).
_transport: Optional[str] = None


def commit() -> str:
  """JAX_EP_COMMIT (the device machine's copy of the tree has no .git, so
  the caller passes it), else git's short hash of HEAD, with "+dirty" when
  tracked files differ from it; "unknown" without either."""
  if os.environ.get("JAX_EP_COMMIT"):
    return os.environ["JAX_EP_COMMIT"]
  try:
    head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                   stderr=subprocess.DEVNULL).decode().strip()
    dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=HERE, stderr=subprocess.DEVNULL).decode().strip()
    return head + ("+dirty" if dirty else "")
  except Exception:  # noqa: BLE001 - a label, never a reason to lose a run
    return "unknown"


def command(argv: Optional[list[str]] = None) -> str:
  """The command line as it could be typed again: settings first, then
  `python <script> <args>` (the script relative to the repository)."""
  argv = list(sys.argv if argv is None else argv)
  if argv:
    script = os.path.abspath(argv[0])
    if script.startswith(REPO + os.sep):
      argv[0] = os.path.relpath(script, REPO)
  env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
         if k.startswith(_ENV_PREFIXES) and k not in _ENV_LEFT_OUT]
  return " ".join(env + ["python", shlex.join(argv)])


def machine(devices) -> str:
  """"<n>x <device kind>", e.g. "2x NVIDIA H200"."""
  kinds = sorted({d.device_kind for d in devices})
  return f"{len(devices)}x {'/'.join(kinds)}"


def now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def note_communicator(comm) -> None:
  """Remembers how `comm` reaches its peers, for the records written after.

  One rank: "local" (nothing crosses a link). Else from the communicator's
  own report per device: "lsa" (NVLink loads / stores), "gin" (GPU-initiated
  RDMA), "gin_emulated" (GIN's puts carried over NVLink), joined with "+"
  when devices differ."""
  global _transport
  kinds = set()
  for d in comm.info():
    if d.get("nranks", 1) <= 1:
      kinds.add("local")
    elif d.get("gin_emulated"):
      kinds.add("gin_emulated")
    elif d.get("gin_mask"):
      kinds.add("lsa+gin" if d.get("lsa_size", 1) > 1 else "gin")
    else:
      kinds.add("lsa")
  _transport = "+".join(sorted(kinds)) or None


def path_of(impl: str) -> str:
  """What an impl name ran: jax_ep's own variants the CUDA kernels (or the
  reference where the name says so), `reference` jax_ep's pure-JAX backend,
  `jax_*` XLA's own ops, the rest the library they are named after."""
  if impl.startswith("jax_ep"):
    return "cuda"
  if impl.startswith("reference"):
    return "reference"
  if impl.startswith("jax_"):
    return "xla"
  return impl.split("[")[0]


def stamp(records: list[dict], machine_name: str, *, date: Optional[str] = None,
          argv: Optional[list[str]] = None) -> list[dict]:
  """Adds the run's fields to every record (in place; also returned). The
  run's command replaces any a record brought from a child process: the
  child's settings are in the record's own fields (`env`, `xla_flags`)."""
  date = date or now()
  run = dict(machine=machine_name, date=date, commit=commit(), command=command(argv))
  for r in records:
    r.update(run)
    impl = str(r.get("impl", ""))
    r.setdefault("path", path_of(impl))
    if r["path"] == "cuda" and _transport and "transport" not in r:
      r["transport"] = _transport
  return records


def _slug(s: str) -> str:
  return re.sub(r"[^A-Za-z0-9.+-]", "-", s) or "unknown"


def new_path(out_dir: str, name: str, date: str, commit_: str) -> str:
  """<out_dir>/<name>/<date>_<commit>_<n>.json with the first free n."""
  d = os.path.join(out_dir, name)
  stem = f"{date[:10]}_{_slug(commit_)}"
  n = 1
  while os.path.exists(os.path.join(d, f"{stem}_{n}.json")):
    n += 1
  return os.path.join(d, f"{stem}_{n}.json")


def write(records: list[dict], out_dir: str, name: str) -> str:
  """Writes the run's records as a new file under out_dir/name/ (exclusive
  create: never over an existing one) and returns its path. The records
  must be stamped."""
  first = records[0]
  while True:
    path = new_path(out_dir, name, first.get("date") or now(), first.get("commit") or commit())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
      with open(path, "x") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
      return path
    except FileExistsError:  # another run took that number meanwhile
      continue


def _order(path: str) -> tuple:
  """By the run's time (its records' `date`, to the second where it has
  one: two runs of one day are ordered by when they ran, not by their
  commits' hashes), then number."""
  stem, _, n = os.path.basename(path)[:-len(".json")].rpartition("_")
  when = stem[:10]
  try:
    with open(path) as f:
      first = json.load(f)
    if isinstance(first, list) and first and isinstance(first[0].get("date"), str):
      when = max(when, first[0]["date"])
  except (OSError, ValueError):
    pass
  return (when, int(n) if n.isdigit() else 0, stem)


def run_files(out_dir: str, name: str) -> list[str]:
  """The run files of one benchmark under out_dir, by date, then number."""
  return sorted(glob.glob(os.path.join(out_dir, name, "*.json")), key=_order)


def latest(out_dir: str, name: str) -> Optional[list[dict]]:
  """The records of the newest run file of `name` under out_dir, or None."""
  files = run_files(out_dir, name)
  if not files:
    return None
  with open(files[-1]) as f:
    return json.load(f)
