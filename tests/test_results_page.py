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
