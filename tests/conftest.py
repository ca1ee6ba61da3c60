"""Shared test setup: 8 virtual CPU devices, an EP mesh builder and a harness
that runs a per-rank function under ``jit(shard_map(...))``.

Convention used by every CPU test: a per-rank array of shape ``S`` is passed
globally as ``[R, *S]`` (ranks stacked on a new leading axis, sharded with
``P("ep")``); inside the shard the leading axis of size 1 is dropped, and every
output leaf gets it back, so results come home as ``[R, *S_out]`` numpy arrays
(index 0 = rank 0).  Outputs may be arbitrary pytrees (tuples for FP8, NamedTuples).
"""
from __future__ import annotations

import faulthandler
import functools
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # older jax (flag missing) or backend already initialised
    pass
jax.config.update("jax_enable_x64", False)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

try:
    _shard_map = jax.shard_map
    _SHMAP_NEW = True
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _SHMAP_NEW = False

AXIS = "ep"
RANKS = (1, 2, 4, 8)

# A hung collective (a rank that raised while its peers wait) must not hang CI
# forever: dump the stacks and exit if one test runs longer than this.
_WATCHDOG_S = float(os.environ.get("JAX_EP_TEST_WATCHDOG_S", "240"))


IN_CHILD = os.environ.get("JAX_EP_TEST_CHILD") == "1"
_CHILD_TIMEOUT_S = 180


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "isolated: run this test in a child pytest process, so that an abort, crash or "
        "hang in a device-side error path fails the test instead of killing the suite",
    )
    if len(jax.devices()) < 8:
        print(
            f"[jax_ep tests] only {len(jax.devices())} devices; set "
            "JAX_NUM_CPU_DEVICES=8 before jax initialises",
            file=sys.stderr,
        )


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
    if request.node.get_closest_marker("gpu") is not None:  # GPU tests keep their own limits
        yield
        return
    faulthandler.dump_traceback_later(_WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@functools.lru_cache(maxsize=None)
def make_mesh(R: int) -> jax.sharding.Mesh:
    """1-D mesh over the first R CPU devices with axis "ep" (Auto axis type)."""
    devs = jax.devices()[:R]
    if len(devs) < R:
        pytest.skip(f"needs {R} devices, have {len(jax.devices())}")
    return jax.sharding.Mesh(np.array(devs), (AXIS,))


def _smap(f, mesh, in_specs, out_specs):
    if _SHMAP_NEW:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return _shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs)  # pragma: no cover


def sharded(R: int, fn):
    """Global jitted function: args are pytrees of [R, ...] arrays; ``fn`` sees
    per-rank arrays and its outputs come back stacked as [R, ...]."""
    mesh = make_mesh(R)
    spec = P(AXIS)

    def inner(*args):
        args = jax.tree.map(lambda v: v[0], args)
        out = fn(*args)
        return jax.tree.map(lambda v: v[None], out)

    def outer(*args):
        f = _smap(inner, mesh, tuple(spec for _ in args), spec)
        return f(*args)

    return jax.jit(outer)


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def run_sharded(R: int, fn, *args):
    """Run ``fn`` per rank on ``R`` devices; returns numpy pytree stacked [R, ...]."""
    mesh = make_mesh(R)
    sh = NamedSharding(mesh, P(AXIS))
    args = jax.tree.map(lambda v: jax.device_put(v, sh), args)
    out = sharded(R, fn)(*args)
    return to_numpy(jax.block_until_ready(out))


@pytest.fixture
def mesh(R):
    return make_mesh(R)


@pytest.fixture
def run():
    """``run(R, fn, *args)`` -> numpy outputs stacked [R, ...] (see module doc)."""
    return run_sharded


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Tests marked ``isolated`` run in a child process (see the marker's doc)."""
    if IN_CHILD or pyfuncitem.get_closest_marker("isolated") is None:
        return None
    import subprocess

    root = str(pyfuncitem.config.rootpath)
    env = dict(os.environ, JAX_EP_TEST_CHILD="1", JAX_NUM_CPU_DEVICES="8")
    cmd = [sys.executable, "-m", "pytest", pyfuncitem.nodeid, "-q", "-x", "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")
        out = out.decode() if isinstance(out, bytes) else out
        pytest.fail(f"child process hung (> {_CHILD_TIMEOUT_S}s): {out[-3000:]}", pytrace=False)
    out = proc.stdout + proc.stderr
    if proc.returncode < 0 or "Fatal Python error" in out:
        pytest.fail(
            f"process died (rc {proc.returncode}) instead of raising a Python exception:\n"
            + out[-4000:],
            pytrace=False,
        )
    if proc.returncode != 0:
        pytest.fail(f"child pytest failed (rc {proc.returncode}):\n" + out[-6000:], pytrace=False)
    return True


def pytest_terminal_summary(terminalreporter):
    try:
        import oracle
    except ImportError:  # pragma: no cover
        return
    if oracle.EXACT_MATCH_TALLY:
        tally = ", ".join(f"{k}: {v}" for k, v in sorted(oracle.EXACT_MATCH_TALLY.items()))
        terminalreporter.write_line(f"[jax_ep] fixed-order f32 sums matched the oracle as: {tally}")


def ep_test_gpus() -> int:
    """GPUs the GPU tests' communicator spans (env JAX_EP_TEST_GPUS, default 2):
    the same tests run at EP2, EP4 and EP8 on a machine that has the GPUs."""
    return int(os.environ.get("JAX_EP_TEST_GPUS", "2"))


@pytest.fixture(scope="module")
def gpu_comm(request):
    """A Communicator over the first JAX_EP_TEST_GPUS GPUs (default 2) for a
    GPU test module (window bytes from the module's COMM_BYTES, default
    64 MiB); skips without that many GPUs."""
    from jax_ep import _native
    if not _native.cuda_available():
        pytest.skip("needs jax_ep's CUDA build and GPUs")
    devs = jax.devices("cuda")
    n = ep_test_gpus()
    if len(devs) < n:
        pytest.skip(f"needs {n} GPUs")
    from jax_ep.comm import Communicator
    mesh = jax.sharding.Mesh(np.array(devs[:n]), (AXIS,))
    c = Communicator.create(mesh, AXIS, getattr(request.module, "COMM_BYTES", 64 << 20),
                            checked=getattr(request.module, "COMM_CHECKED", False))
    yield c
    c.close()
