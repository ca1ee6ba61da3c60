"""Shared pieces of the GPU tests (single- and multi-process): inputs, the
layout oracle and per-rank runners under jit + shard_map."""
from __future__ import annotations

from typing import Optional

import numpy as np

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

AXIS = "ep"


def random_topk(rng: np.random.Generator, T: int, K: int, E: int, p_none: float = 0.2) -> np.ndarray:
    """[T, K] int32: distinct experts per token, each slot -1 with prob p_none."""
    if T == 0:
        return np.zeros((0, K), np.int32)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
    idx[rng.random((T, K)) < p_none] = -1
    return idx


def layout_oracle(idx: np.ndarray, E: int, R: int):
    """Brute force: (per_rank [R], per_expert [E], in_rank [T,R], pos [T,R])."""
    T = idx.shape[0]
    e_l = E // R
    in_rank = np.zeros((T, R), bool)
    per_expert = np.zeros(E, np.int32)
    for t in range(T):
        for e in idx[t]:
            if 0 <= e < E:
                per_expert[e] += 1
                in_rank[t, e // e_l] = True
    pos = np.where(in_rank, np.cumsum(in_rank, axis=0) - 1, -1).astype(np.int32)
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank, pos


def reference_layout(idx: np.ndarray, E: int, R: int):
    """jax_ep.reference's layout when it is importable, else the oracle."""
    try:
        from jax_ep import reference as ref
        lay, pos = ref._layout(jax.numpy.asarray(idx), E, R)
        return tuple(np.asarray(a) for a in (lay.num_tokens_per_rank,
                                             lay.num_tokens_per_expert,
                                             lay.is_token_in_rank, pos))
    except (ImportError, AttributeError):
        return layout_oracle(idx, E, R)


def per_rank_jit(mesh: Mesh, fn):
    """jit(shard_map(fn)) over the EP axis; fn sees per-rank arrays (the
    leading rank axis of size 1 dropped) and every output gets it back."""
    def inner(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda v: v[None], out)

    def outer(*args):
        return _shard_map(inner, mesh=mesh, in_specs=tuple(P(AXIS) for _ in args),
                          out_specs=P(AXIS))(*args)

    return jax.jit(outer)


def put(mesh: Mesh, stacked: np.ndarray) -> jax.Array:
    """[R, ...] host array -> global array sharded over the EP axis (works with
    several processes: each places only its addressable shards)."""
    sh = NamedSharding(mesh, P(AXIS))
    return jax.make_array_from_callback(stacked.shape, sh, lambda i: stacked[i])


def local_rows(arr: jax.Array) -> dict[int, np.ndarray]:
    """{rank: this process's shard of a [R, ...] array}."""
    out = {}
    for s in arr.addressable_shards:
        r = s.index[0].start or 0
        out[r] = np.asarray(s.data)[0]
    return out


def run_worker(worker: str, *, command_buffers: bool, env_extra: Optional[dict] = None,
               timeout: int = 300) -> str:
    """Runs tests/<worker> in a fresh process (XLA reads XLA_FLAGS once) with
    XLA's command buffers for custom calls on (every run of >= 1 command
    captured) or off; returns its stdout, asserting it exited 0."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if command_buffers:
        flags += " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL"
        flags += " --xla_gpu_graph_min_graph_size=1"
    else:
        flags += " --xla_gpu_enable_command_buffer="
    env["XLA_FLAGS"] = flags.strip()
    env.update(env_extra or {})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), worker)
    r = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    return r.stdout


def init_one_process_per_gpu() -> tuple[int, int, Mesh]:
    """In a worker started as `worker.py PORT PROCESS_ID NUM_PROCESSES`:
    jax.distributed on localhost with this process's one GPU; returns
    (process id, number of processes, the EP mesh over all processes' GPUs)."""
    import sys
    port, pid, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc,
                               process_id=pid, local_device_ids=[pid])
    devs = jax.devices()
    assert len(devs) == nproc, devs
    return pid, nproc, Mesh(np.array(devs), (AXIS,))
