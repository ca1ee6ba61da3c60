"""A source tree without the native module ahead of an installed build on
sys.path (the current directory, PYTHONPATH) says so at import, naming both
paths, instead of running the reference silently where the kernels are
built."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig

from jax_ep import _native

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def test_the_message_names_both_paths_only_when_a_build_is_shadowed(tmp_path):
  here = str(tmp_path / "checkout" / "jax_ep")
  (tmp_path / "site" / "jax_ep").mkdir(parents=True)
  so = tmp_path / "site" / "jax_ep" / "_jax_ep.so"
  so.write_bytes(b"")
  msg = _native.shadow_message(here, None, str(so))
  assert here in msg and str(so.parent) in msg and "has no native module" in msg
  assert _native.shadow_message(here, None, None) is None              # nothing installed
  assert _native.shadow_message(str(so.parent), None, str(so)) is None  # the same place
  assert _native.shadow_message(here, str(so), str(so)) is None         # editable: the same module
  (tmp_path / "checkout" / "jax_ep").mkdir(parents=True)
  own = tmp_path / "checkout" / "jax_ep" / "_jax_ep.so"
  own.write_bytes(b"")
  msg = _native.shadow_message(here, str(own), str(so))                 # an in-place build
  assert str(own) in msg and "is not the installed one" in msg and str(so.parent) in msg


def _fake_install(site: pathlib.Path) -> pathlib.Path:
  """An installed jax_ep distribution with a native module, as pip leaves it
  (a dist-info whose RECORD lists the module)."""
  name = "_jax_ep" + sysconfig.get_config_var("EXT_SUFFIX")
  (site / "jax_ep").mkdir(parents=True)
  (site / "jax_ep" / name).write_bytes(b"")
  info = site / "jax_ep-0.1.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: jax_ep\nVersion: 0.1.0\n")
  (info / "RECORD").write_text(f"jax_ep/{name},,\njax_ep-0.1.0.dist-info/METADATA,,\n")
  return site / "jax_ep"


def _import_warnings(pythonpath: str) -> str:
  env = dict(os.environ, PYTHONPATH=pythonpath, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-W", "always", "-c", "import jax_ep"], env=env,
                       capture_output=True, text=True, timeout=300, cwd=os.path.dirname(SRC))
  assert res.returncode == 0, res.stderr[-3000:]
  return res.stderr


def test_importing_a_source_tree_ahead_of_an_installed_build_warns_naming_both(tmp_path):
  if any((SRC / "jax_ep").glob("_jax_ep.*")):
    import pytest
    pytest.skip("this checkout has a native module of its own (an in-place build)")
  installed = _fake_install(tmp_path / "site")
  err = _import_warnings(f"{SRC}{os.pathsep}{tmp_path / 'site'}")
  assert "RuntimeWarning" in err and "shadows the installed build" in err, err[-3000:]
  assert str(SRC / "jax_ep") in err and str(installed) in err, err[-3000:]
  # Without the fake install: a warning only if jax_ep is really installed
  # in this environment (as in CI, which tests the installed wheel), and
  # then naming that install.
  err = _import_warnings(str(SRC))
  try:
    import importlib.metadata as md
    real = md.distribution("jax_ep")
  except Exception:  # noqa: BLE001 - not installed
    real = None
  if real is None or not any(str(f).endswith((".so", ".pyd")) for f in real.files or ()):
    assert "shadows" not in err, err[-3000:]
  else:
    assert "shadows the installed build" in err, err[-3000:]
