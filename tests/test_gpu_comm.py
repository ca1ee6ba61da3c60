"""Communicator lifetime and the probe all-to-all over the NCCL device API (GPU)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and GPUs"),
]

from comm_probe import needs_harness, probe_all_to_all_cuda

if _native.cuda_available():
    import gpu_helpers as h
    from jax_ep import comm as comm_mod
    from jax_ep.comm import Communicator

HERE = os.path.dirname(os.path.abspath(__file__))


def _mesh2():
    devs = jax.devices("cuda")
    if len(devs) < 2:
        pytest.skip("needs 2 GPUs")
    return jax.sharding.Mesh(np.array(devs[:2]), (h.AXIS,))


def _mesh_all():
    """An EP mesh over the GPUs there are (JAX_EP_TEST_GPUS of them where
    that is set, at most 8): one GPU is an EP1 mesh."""
    devs = jax.devices("cuda")
    n = min(len(devs), comm_mod.MAX_RANKS)
    if "JAX_EP_TEST_GPUS" in os.environ:
        from conftest import ep_test_gpus
        if ep_test_gpus() > len(devs):
            pytest.skip(f"needs {ep_test_gpus()} GPUs")
        n = ep_test_gpus()
    return jax.sharding.Mesh(np.array(devs[:n]), (h.AXIS,))


def _dispatch_combine_case(mesh, seed: int):
    """Inputs [R, ...] of a dispatch + combine (expert layout, bf16, weighted)
    on `mesh` and a per-rank function running it with `backend`."""
    import jax_ep
    R = mesh.devices.size
    T, H, K, E = 128, 1024, 4, 8 * R
    rng = np.random.default_rng(seed)
    idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
    w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(jnp.bfloat16)

    def per_rank(backend):
        def f(x, i, w):
            o = jax_ep.dispatch(x, i, w, num_experts=E, layout="expert", backend=backend)
            y = (o.recv_x.astype(jnp.float32) * 1.5).astype(o.recv_x.dtype)
            return jax_ep.combine(y, o.handle, o.recv_topk_weights, backend=backend)
        return f

    need = comm_mod.get_buffer_size_hint(num_ranks=R, tokens_per_rank=T, hidden=H, topk=K,
                                         num_experts=E)
    args = tuple(h.put(mesh, a) for a in (x, idx, w))
    return args, per_rank, need


def test_nccl_runtime_matches_compiled_headers():
    compiled, runtime = _native.nccl_version()
    assert compiled == runtime


def test_create_reports_ranks_devices_and_window():
    mesh = _mesh2()
    with Communicator.create(mesh, h.AXIS, 5 << 20) as c:
        assert comm_mod.current(h.AXIS) is c
        info = sorted(c.info(), key=lambda d: d["rank"])
        assert [d["rank"] for d in info] == [0, 1]
        assert [d["device_ordinal"] for d in info] == [d.local_hardware_id for d in mesh.devices]
        assert all(d["window_bytes"] == 6 << 20 for d in info)  # rounded to 2 MiB
        assert all(d["lsa_size"] == 2 for d in info)
    assert c.closed and comm_mod.current(h.AXIS) is None


@needs_harness
@pytest.mark.parametrize("dtype,n", [(jnp.float32, 4096), (jnp.bfloat16, 1000), (jnp.int8, 77)])
def test_probe_equals_all_to_all_for_200_steps(dtype, n):
    mesh = _mesh2()
    R = 2
    rng = np.random.default_rng(3)
    with Communicator.create(mesh, h.AXIS, 16 << 20) as c:
        f = h.per_rank_jit(mesh, lambda v: (probe_all_to_all_cuda(v, comm_id=c.comm_id),
                                            lax.all_to_all(v, h.AXIS, 0, 0)))
        base = rng.integers(-100, 100, size=(R, R, n))
        for step in range(200):
            x = ((base + step) % 127).astype(np.dtype(dtype))
            got, want = f(h.put(mesh, x))
            got, want = np.asarray(got), np.asarray(want)
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
            np.testing.assert_array_equal(got, np.swapaxes(x, 0, 1), err_msg=f"step {step}")
        c.check()


@needs_harness
def test_probe_many_calls_in_one_jit_stay_in_step():
    """Back-to-back exchanges in one program: the entry barrier keeps a fast
    rank from overwriting slots its peer is still reading."""
    mesh = _mesh2()
    with Communicator.create(mesh, h.AXIS, 64 << 20) as c:
        def body(v):
            outs = []
            for i in range(8):
                outs.append(probe_all_to_all_cuda(v + i, comm_id=c.comm_id))
            return jnp.stack(outs)

        x = np.random.default_rng(4).standard_normal((2, 2, 3 << 16)).astype(np.float32)
        got = np.asarray(h.per_rank_jit(mesh, body)(h.put(mesh, x)))
        for r in range(2):
            for i in range(8):
                np.testing.assert_array_equal(got[r, i], x[:, r] + i)
        c.check()


@needs_harness
def test_probe_rejects_a_window_too_small():
    mesh = _mesh2()
    with Communicator.create(mesh, h.AXIS, 2 << 20) as c:
        f = h.per_rank_jit(mesh, lambda v: probe_all_to_all_cuda(v, comm_id=c.comm_id))
        x = np.zeros((2, 2, 1 << 20), np.float32)  # 8 MiB of slots > 2 MiB window
        with pytest.raises(Exception, match="num_bytes"):
            jax.block_until_ready(f(h.put(mesh, x)))


@needs_harness
def test_using_a_closed_communicator_raises_instead_of_touching_freed_memory():
    """Programs compiled against a Communicator (the probe; a dispatch +
    combine) refuse to run once it is closed (docs/design.md §3)."""
    mesh = _mesh_all()
    R = mesh.devices.size
    args, per_rank, need = _dispatch_combine_case(mesh, 11)
    c = Communicator.create(mesh, h.AXIS, max(4 << 20, need))
    comm_id = c.comm_id
    f = h.per_rank_jit(mesh, lambda v: probe_all_to_all_cuda(v, comm_id=comm_id))
    g = h.per_rank_jit(mesh, per_rank("cuda"))
    x = h.put(mesh, np.ones((R, R, 64), np.float32))
    jax.block_until_ready(f(x))
    jax.block_until_ready(g(*args))
    c.check()
    c.close()
    c.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        jax.block_until_ready(f(x))
    with pytest.raises(Exception, match="closed"):
        jax.block_until_ready(g(*args))


@needs_harness
def test_create_use_close_100_times_under_load_returns_gpu_memory():
    """docs/design.md §3: 100 Communicators, one after another, each with a
    64 MiB window and a dispatch + combine on it (re-traced for each: the
    program names its communicator) whose output must equal the
    reference's bitwise; then every GPU's free memory is back at its
    baseline (a leaked window would be 6.4 GB, a leak of 1 MiB per cycle
    100 MiB)."""
    import gc
    import time
    mesh = _mesh_all()
    ordinals = [d.local_hardware_id for d in mesh.devices.flat]
    native = _native.module()
    args, per_rank, need = _dispatch_combine_case(mesh, 12)
    window = 64 << 20
    assert need <= window, need
    want = np.asarray(jax.block_until_ready(h.per_rank_jit(mesh, per_rank("reference"))(*args)))

    def cycle(i):
        with Communicator.create(mesh, h.AXIS, window) as c:
            got = np.asarray(h.per_rank_jit(mesh, per_rank("cuda"))(*args))
            c.check()
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16),
                                      err_msg=f"cycle {i}")

    def free():
        gc.collect()  # the dropped programs (and their hold on the communicators)
        return [native.mem_get_info(o)[0] for o in ordinals]

    cycle(-1)  # first-use allocations (NCCL, XLA, the kernels' modules) are not leaks
    base = free()
    t0 = time.monotonic()
    for i in range(100):
        cycle(i)
        if i == 49:
            half = free()
    took = time.monotonic() - t0
    after = free()
    print(f"100 create / dispatch + combine / close cycles on {len(ordinals)} GPU(s): {took:.1f} s; "
          f"free memory change (MiB) after 50: {[(b - m) >> 20 for b, m in zip(base, half)]}, "
          f"after 100: {[(b - a) >> 20 for b, a in zip(base, after)]}")
    for o, b, m, a in zip(ordinals, base, half, after):
        assert b - a < (64 << 20), f"device {o}: {(b - a) >> 20} MiB not returned after 100 cycles"
        assert m - a < (32 << 20), f"device {o}: {(m - a) >> 20} MiB more in use after cycles 50-99"


def test_create_rejects_a_missing_axis_and_a_tiny_window():
    mesh = _mesh2()
    with pytest.raises(ValueError, match="axis_name"):
        Communicator.create(mesh, "tp")
    with pytest.raises(ValueError, match="num_bytes"):
        Communicator.create(mesh, h.AXIS, 4096)


def test_check_size_against_buffer_size_hint():
    mesh = _mesh2()
    with Communicator.create(mesh, h.AXIS, 2 << 20) as c:
        with pytest.raises(ValueError, match="num_bytes"):
            c.check_size(num_ranks=2, tokens_per_rank=4096, hidden=7168, topk=8, num_experts=256)


@needs_harness
def test_forced_gin_fails_clearly_without_leaking_and_nvlink_still_works():
    """transport="gin" puts the other rank on GIN. These machines have no
    GIN-capable NIC: create must raise a message that names GIN, the peer and
    the way back (not hang, not succeed), free what it had made, and leave a
    normal create working in the same process."""
    mesh = _mesh2()
    ordinals = [d.local_hardware_id for d in mesh.devices]
    native = _native.module()
    try:
        c = Communicator.create(mesh, h.AXIS, 4 << 20, transport="gin")
    except RuntimeError as e:
        msg = str(e)
    else:  # a machine whose NCCL does have GIN
        with c:
            info = sorted(c.info(), key=lambda d: d["rank"])
            assert [d["gin_mask"] for d in info] == [0b10, 0b01]
        pytest.skip("this machine has GIN: the forced branch was created, not refused")
    assert "GIN" in msg and "transport 'gin'" in msg and "transport='auto'" in msg, msg
    assert "EP rank" in msg and "device" in msg, msg
    assert comm_mod.current(h.AXIS) is None

    base = [native.mem_get_info(o)[0] for o in ordinals]
    for _ in range(4):  # a 256 MiB window per try: a leaked one shows
        with pytest.raises(RuntimeError, match="GIN"):
            Communicator.create(mesh, h.AXIS, 256 << 20, transport="gin")
    after = [native.mem_get_info(o)[0] for o in ordinals]
    for o, b, a in zip(ordinals, base, after):
        assert b - a < (128 << 20), f"device {o}: {(b - a) >> 20} MiB not returned"

    x = np.random.default_rng(5).standard_normal((2, 2, 256)).astype(np.float32)
    with Communicator.create(mesh, h.AXIS, 4 << 20) as c:
        assert all(d["gin_mask"] == 0 and d["lsa_size"] == 2 for d in c.info())
        f = h.per_rank_jit(mesh, lambda v: probe_all_to_all_cuda(v, comm_id=c.comm_id))
        np.testing.assert_array_equal(np.asarray(f(h.put(mesh, x))), np.swapaxes(x, 0, 1))
        c.check()


def test_an_unknown_transport_is_refused_before_nccl_starts():
    mesh = _mesh2()
    with pytest.raises(ValueError, match="transport='nvlink' is not one of"):
        Communicator.create(mesh, h.AXIS, 4 << 20, transport="nvlink")
    assert comm_mod.current(h.AXIS) is None


def test_the_transport_argument_alone_picks_the_transport(monkeypatch):
    """Communicator.create(transport=...) is the knob; the environment plays
    no part (the native code reads none)."""
    mesh = _mesh2()
    monkeypatch.setenv("JAX_EP_TRANSPORT", "gin")  # a leftover of older releases: ignored
    with Communicator.create(mesh, h.AXIS, 4 << 20) as c:
        assert all(d["gin_mask"] == 0 and d["lsa_size"] == 2 for d in c.info())
    with Communicator.create(mesh, h.AXIS, 4 << 20, transport="gin_emulated") as c:
        assert all(d["gin_emulated"] and d["gin_mask"] == 1 << (1 - d["rank"])
                   for d in _native.module().comm_info(c.comm_id))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_one_process_per_gpu(worker_name: str, n: int, killed: Optional[int] = None,
                             **env_extra) -> list[str]:
    """Runs tests/<worker_name> as n processes, one GPU each (jax.distributed
    on localhost); their outputs, asserting each exited 0 (but process
    `killed`, which ends itself)."""
    port = _free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0",
               **env_extra)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    worker = os.path.join(HERE, worker_name)
    procs = [subprocess.Popen([sys.executable, worker, str(port), str(i), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 or i == killed, f"process {i}:\n{out[-4000:]}"
    return outs


def test_one_process_per_gpu():
    from conftest import ep_test_gpus
    n = ep_test_gpus()
    if len(jax.devices("cuda")) < n:
        pytest.skip(f"needs {n} GPUs")
    outs = _run_one_process_per_gpu("gpu_multiprocess_worker.py", n)
    for i, out in enumerate(outs):
        assert "WORKER OK" in out, f"process {i}:\n{out[-4000:]}"


@pytest.mark.parametrize("mode", ["refuse", "mismatch"])
def test_a_rank_that_refuses_or_differs_makes_its_peers_fail_at_once(mode):
    """One process per GPU (tests/gpu_refusal_worker.py). "refuse": the last
    one's dispatch needs more window than there is, so its handler refuses;
    the others, already in the dispatch's barrier, fail within 0.3 x
    timeout_s naming it (its refusal stands in for its barriers:
    kernels/abort.h; docs/errors.md, its table). "mismatch": the last one calls
    dispatch with half the hidden size (both fit the window); every rank
    reports "hidden 1024 here, 512 on EP rank 1" (or the reverse) with zeros
    out and no row moved (docs/errors.md, its table). Then a valid dispatch works on
    every process."""
    from conftest import ep_test_gpus
    n = ep_test_gpus()
    if n < 2 or len(jax.devices("cuda")) < n:
        pytest.skip("needs 2 GPUs")
    outs = _run_one_process_per_gpu("gpu_refusal_worker.py", n, REFUSAL_MODE=mode)
    for i, out in enumerate(outs):
        assert "REFUSAL OK" in out, f"process {i}:\n{out[-4000:]}"
        print(f"process {i}:", [l for l in out.splitlines() if "REFUSAL OK" in l])


def test_a_process_killed_in_a_loop_leaves_a_survivor_that_raises_and_closes():
    """One process per GPU; the last exits in the middle of a loop of
    dispatches. The survivor raises within 2 x timeout_s ("did not arrive")
    and close() returns within 60 s: after a lost peer the NCCL
    communicators are aborted, not torn down collectively (comm.h Close;
    docs/errors.md, its table)."""
    from conftest import ep_test_gpus
    n = ep_test_gpus()
    if n < 2 or len(jax.devices("cuda")) < n:
        pytest.skip("needs 2 GPUs")
    outs = _run_one_process_per_gpu("gpu_refusal_worker.py", n, killed=n - 1, REFUSAL_MODE="kill")
    for i, out in enumerate(outs[:-1]):
        assert "KILL OK" in out, f"process {i}:\n{out[-4000:]}"
        print(f"process {i}:", [l for l in out.splitlines() if "KILL OK" in l])
