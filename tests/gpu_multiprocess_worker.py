"""One process of the 2-process GPU test: python gpu_multiprocess_worker.py
PORT PROCESS_ID NUM_PROCESSES. Prints 'WORKER OK' on success."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402


def main() -> int:
    import gpu_helpers as h
    pid, nproc, mesh = h.init_one_process_per_gpu()
    from jax_ep import _native
    from jax_ep._ffi import layout as layout_ffi
    from jax_ep.comm import Communicator

    R = nproc
    comm = Communicator.create(mesh, h.AXIS, 256 << 20, timeout_s=20.0)
    info = comm.info()
    assert len(info) == 1 and info[0]["rank"] == pid and info[0]["nranks"] == R, info

    # probe vs lax.all_to_all, identical inputs on every process (same seed);
    # the probe is in the module only with the test harness (tests/comm_probe.py).
    rng = np.random.default_rng(7)
    if _native.testing_built():
        from comm_probe import probe_all_to_all_cuda
        n = 1000
        x = rng.standard_normal((R, R, n)).astype(np.float32)
        f = h.per_rank_jit(mesh, lambda v: (probe_all_to_all_cuda(v, comm_id=comm.comm_id),
                                            lax.all_to_all(v, h.AXIS, 0, 0)))
        for step in range(50):
            got, want = f(h.put(mesh, x + step))
            for r, g in h.local_rows(got).items():
                np.testing.assert_array_equal(g, h.local_rows(want)[r], err_msg=f"step {step}")
                np.testing.assert_array_equal(g, (x + step)[:, r], err_msg=f"step {step}")
    else:
        print("probe skipped: jax_ep built without JAX_EP_TESTING=ON", flush=True)

    # layout vs the oracle.
    T, K, E = 513, 4, 16
    idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
    g = h.per_rank_jit(mesh, lambda i: layout_ffi.layout(i, num_experts=E, num_ranks=R,
                                                         comm_id=comm.comm_id))
    outs = g(h.put(mesh, idx))
    for k, (name, arr) in enumerate(zip(("per_rank", "per_expert", "in_rank", "pos"), outs)):
        for r, got in h.local_rows(arr).items():
            np.testing.assert_array_equal(got, h.layout_oracle(idx[r], E, R)[k],
                                          err_msg=f"{name} rank {r}")
    comm.check()

    # normal dispatch + combine through the public API: CUDA kernels vs the
    # reference, bitwise, both layouts.
    import jax_ep
    T, H, K, E = 1024, 2048, 8, 64
    idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
    w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
    x = (rng.standard_normal((R, T, H)) * 3).astype(jnp.bfloat16)
    for layout in ("rank", "expert"):
        def both(x, i, w, layout=layout):
            res = []
            for b in ("cuda", "reference"):
                o = jax_ep.dispatch(x, i, w, num_experts=E, layout=layout, backend=b)
                cw = o.recv_topk_weights if layout == "expert" else None
                res.append((o.recv_x, o.counts, jax_ep.combine(o.recv_x, o.handle, cw, backend=b)))
            return res
        got, want = h.per_rank_jit(mesh, both)(*(h.put(mesh, v) for v in (x, idx, w)))
        for a, b in zip(got, want):
            for r, g in h.local_rows(a).items():
                np.testing.assert_array_equal(np.asarray(g).view(np.uint8),
                                              np.asarray(h.local_rows(b)[r]).view(np.uint8),
                                              err_msg=f"dispatch/combine {layout} rank {r}")
    comm.check()
    comm.close()
    jax.distributed.shutdown()
    print("WORKER OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
