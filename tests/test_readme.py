"""The newcomer's path on CPU: the README's example runs as written (in a
fresh process, as a user would paste it) and the demo trains; build_info()
says what was built."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax_ep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=timeout, env=env, cwd="/")


def test_readme_example_runs_as_written_on_8_cpu_devices():
  text = open(os.path.join(ROOT, "README.md")).read()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert blocks, "README has no python example"
  res = _run(blocks[0] + "\nassert R == 8, R\n")
  assert res.returncode == 0, res.stderr[-3000:]
  assert "(512, 256) bfloat16" in res.stdout


def test_readme_main_job_runs_and_the_loss_falls(tmp_path):
  """The set-up's first command (the main job), shortened to a few steps."""
  text = open(os.path.join(ROOT, "README.md")).read()
  setup = re.search(r"## Set-up on a fresh machine\s+```bash\n(.*?)```", text, re.S).group(1)
  main_job = re.search(r"&& python -m (\S+)", setup.splitlines()[0]).group(1)
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env["JAX_PLATFORMS"] = "cpu"
  res = subprocess.run([sys.executable, "-m", main_job, "--steps", "6", "--no-plot"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
  assert res.returncode == 0, res.stderr[-3000:]
  m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", res.stdout)
  assert m, res.stdout[-2000:]
  assert float(m.group(2)) < float(m.group(1))


def test_demo_trains_and_the_loss_falls():
  res = _run("import jax_ep.demo as d; d.main(['--steps', '8'])")
  assert res.returncode == 0, res.stderr[-3000:]
  m = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", res.stdout)
  assert m, res.stdout[-2000:]
  assert float(m.group(2)) < float(m.group(1))


def test_build_info_says_what_was_built():
  info = jax_ep.build_info()
  assert isinstance(info["cuda_built"], bool)
  if info["cuda_built"]:
    assert info["cutlass_headers"].startswith("4.2") and info["nccl_headers"]
  else:
    assert info["why_not_cuda"]
