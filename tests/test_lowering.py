"""The native ops lower to the expected custom calls for CUDA, on any machine:
`jax.export(..., platforms=["cuda"])` only lowers, so no GPU (and no CUDA
build of jax_ep) is needed."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_ep import _ffi

try:
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

COMM_ID = 123456789012  # > 2**32: proves the attribute stays int64


def _mesh(R: int) -> Mesh:
    devs = jax.devices()[:R]
    if len(devs) < R:
        pytest.skip(f"needs {R} devices")
    return Mesh(np.array(devs), ("ep",))


def _export_text(f, *args) -> str:
    # jax_ep's targets make no serialization-compatibility promise; we only
    # look at the lowering here.
    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in ("jax_ep_dispatch_layout", "jax_ep_probe_all_to_all")]
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args)
    return exp.mlir_module()


def _smap(f, mesh):
    return _shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))


def _custom_calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f'@{target}' in line or f'"{target}"' in line]


def test_layout_lowers_to_custom_call_with_comm_id_and_config_attributes():
    R, T, K, E = 2, 64, 4, 16
    mesh = _mesh(R)

    def per_rank(idx):
        return _ffi.layout_cuda(idx, num_experts=E, num_ranks=R, comm_id=COMM_ID)

    text = _export_text(_smap(per_rank, mesh), jax.ShapeDtypeStruct((R * T, K), jnp.int32))
    calls = _custom_calls(text, "jax_ep_dispatch_layout")
    assert len(calls) == 1, text
    call = calls[0]
    assert re.search(rf"comm_id = {COMM_ID} : i64", call), call
    assert re.search(rf"num_experts = {E} : i32", call), call
    assert re.search(rf"num_ranks = {R} : i32", call), call
    # Per-shard result shapes: [R] [E] [T,R] bool [T,R].
    assert f"tensor<{R}xi32>" in call and f"tensor<{E}xi32>" in call, call
    assert f"tensor<{T}x{R}xi1>" in call and f"tensor<{T}x{R}xi32>" in call, call


def test_probe_lowers_to_custom_call_with_per_shard_shape():
    R, n = 2, 48
    mesh = _mesh(R)

    def per_rank(x):
        return _ffi.probe_all_to_all_cuda(x.reshape(R, n), comm_id=COMM_ID).reshape(1, R * n)

    text = _export_text(_smap(per_rank, mesh), jax.ShapeDtypeStruct((R, R * n), jnp.bfloat16))
    calls = _custom_calls(text, "jax_ep_probe_all_to_all")
    assert len(calls) == 1, text
    assert re.search(rf"comm_id = {COMM_ID} : i64", calls[0]), calls[0]
    assert f"tensor<{R}x{n}xbf16>" in calls[0], calls[0]


def test_layout_rejects_non_int32_ids_at_trace_time():
    with pytest.raises(ValueError, match="int32"):
        _ffi.layout_cuda(jnp.zeros((4, 2), jnp.int16), num_experts=4, num_ranks=2, comm_id=1)


def test_buffer_size_hint_is_granule_aligned_and_grows_with_config():
    from jax_ep.comm import get_buffer_size_hint

    small = get_buffer_size_hint(num_ranks=2, tokens_per_rank=128, hidden=1024, topk=2,
                                 num_experts=8)
    big = get_buffer_size_hint(num_ranks=2, tokens_per_rank=4096, hidden=7168, topk=8,
                               num_experts=256)
    assert small % (2 << 20) == 0 and big % (2 << 20) == 0
    assert big > small
    # Enough for at least the received bf16 rows of every source rank.
    assert big >= 2 * 4096 * 7168 * 2
    with pytest.raises(ValueError, match="hidden"):
        get_buffer_size_hint(num_ranks=2, tokens_per_rank=1, hidden=0, topk=1, num_experts=2)


def test_communicator_create_rejects_cpu_mesh_and_missing_axis():
    from jax_ep.comm import Communicator

    mesh = _mesh(2)
    with pytest.raises(ValueError, match="axis_name"):
        Communicator.create(mesh, "nope")
    with pytest.raises(ValueError, match="GPUs"):
        Communicator.create(mesh, "ep")
