"""One process of the 2-process refusal tests: python gpu_refusal_worker.py
PORT PROCESS_ID NUM_PROCESSES, with REFUSAL_MODE set to
  refuse    the last process asks for a dispatch its window cannot hold (its
            handler refuses); the others ask for a valid one and wait in its
            barrier: they must fail within 0.3 x timeout_s naming it;
  mismatch  the last process calls dispatch with another hidden size (both
            fit the window): every process must report the mismatch naming
            both values, before any row moves;
  kill      the last process exits in the middle of a loop of dispatches:
            the others must raise within 2 x timeout_s and close() the
            communicator within 60 s (no collective teardown with a rank
            that is gone). Prints 'KILL OK raise_s=<float> close_s=<float>'.
Otherwise a valid dispatch on every process then works, bitwise the
reference. Prints 'REFUSAL OK fail_s=<float>' on success."""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

TIMEOUT_S = 10.0


def main() -> int:
    import gpu_helpers as h
    pid, nproc, mesh = h.init_one_process_per_gpu()
    import jax_ep
    from jax_ep._checks import EpRuntimeError
    from jax_ep._window import normal_bytes as window_bytes_needed
    from jax_ep.comm import Communicator

    R = nproc
    H, K, E, T_ok = 1024, 4, 16, 256
    nbytes = window_bytes_needed(num_ranks=R, tokens_per_rank=T_ok, hidden=H, topk=K, num_experts=E)
    comm = Communicator.create(mesh, h.AXIS, nbytes, timeout_s=TIMEOUT_S)
    mode = os.environ.get("REFUSAL_MODE", "refuse")
    refuser = pid == nproc - 1
    rng = np.random.default_rng(11)

    def call(T, hidden=H):
        # Each process builds its own program: the last one with more tokens
        # than the window holds, or another hidden size (a configuration
        # only it has).
        x = (rng.standard_normal((R, T, hidden))).astype(jnp.bfloat16)
        idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
        f = h.per_rank_jit(mesh, lambda a, i: jax_ep.dispatch(a, i, None, num_experts=E,
                                                              backend="cuda").recv_x)
        return x, idx, f(h.put(mesh, x), h.put(mesh, idx))

    if mode == "kill":
        return _kill(comm, call, T_ok, refuser)
    t0 = time.perf_counter()
    if mode == "mismatch":
        _, _, out = call(T_ok, hidden=H // 2 if refuser else H)
        jax.block_until_ready(out)
        fail_s = time.perf_counter() - t0
        other = 0 if refuser else nproc - 1
        mine, theirs = (H // 2, H) if refuser else (H, H // 2)
        try:
            comm.check()
            raise AssertionError("a hidden size differing across ranks was not reported")
        except EpRuntimeError as e:
            assert "another configuration" in str(e), e
            assert f"hidden {mine} here, {theirs} on EP rank {other}" in str(e), e
        assert not np.any(np.asarray(h.local_rows(out)[pid]).view(np.uint16)), "rows moved"
    else:
        refused_here = waited = False
        try:
            _, _, out = call(8 * T_ok if refuser else T_ok)
            jax.block_until_ready(out)
        except jax.errors.JaxRuntimeError as e:
            refused_here = "too small" in str(e) or "num_bytes" in str(e)
            if not refused_here:
                raise
        fail_s = time.perf_counter() - t0
        if not refuser:
            try:
                comm.check()
            except EpRuntimeError as e:
                waited = f"peer rank {nproc - 1} refused this call" in str(e)
                if not waited:
                    raise
        assert refused_here if refuser else waited, (refused_here, waited)
    assert fail_s < 0.3 * TIMEOUT_S, f"{fail_s:.1f} s to fail (timeout_s {TIMEOUT_S})"

    # The communicator stays usable: a valid dispatch everywhere, bitwise the
    # reference.
    x, idx, got = call(T_ok)
    want = h.per_rank_jit(mesh, lambda a, i: jax_ep.dispatch(a, i, None, num_experts=E,
                                                             backend="reference").recv_x)(
        h.put(mesh, x), h.put(mesh, idx))
    for r, g in h.local_rows(got).items():
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8),
                                      np.asarray(h.local_rows(want)[r]).view(np.uint8))
    comm.check()
    comm.close()
    jax.distributed.shutdown()
    print(f"REFUSAL OK fail_s={fail_s:.3f}", flush=True)
    return 0


def _kill(comm, call, T, dies: bool) -> int:
    x_idx_out = call(T)
    jax.block_until_ready(x_idx_out[2])
    t_fail = None
    t0 = time.perf_counter()
    for step in range(50):
        if dies and step == 10:
            os._exit(3)  # no teardown: as if the process were killed
        if step == 10:
            t_fail = time.perf_counter()
        try:
            jax.block_until_ready(call(T)[2])
            comm.check()
        except jax.errors.JaxRuntimeError as e:  # EpRuntimeError is one
            assert "did not arrive" in str(e) or "refused" in str(e) or "was closed" in str(e), e
            break
    else:
        raise AssertionError("50 dispatches with a dead peer and no error")
    raise_s = time.perf_counter() - (t_fail or t0)
    assert raise_s < 2 * TIMEOUT_S, f"{raise_s:.1f} s to raise (timeout_s {TIMEOUT_S})"
    t1 = time.perf_counter()
    comm.close()
    close_s = time.perf_counter() - t1
    assert close_s < 60, f"close() took {close_s:.1f} s"
    print(f"KILL OK raise_s={raise_s:.3f} close_s={close_s:.3f}", flush=True)
    os._exit(0)  # jax.distributed.shutdown would wait for the dead process


if __name__ == "__main__":
    sys.exit(main())
