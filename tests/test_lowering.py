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

from jax_ep._ffi import layout as layout_ffi

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
              for t in ("jax_ep_dispatch_layout", "jax_ep_probe_all_to_all",
                        "jax_ep_engram_publish", "jax_ep_engram_fetch",
                        "jax_ep_engram_publish_fetch", "jax_ep_ll_dispatch",
                        "jax_ep_ll_combine", "jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv",
                        "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")]
    exp = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(*args)
    return exp.mlir_module()


def _smap(f, mesh):
    return _shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))


def _custom_calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f'@{target}(' in line or f'"{target}"' in line]


def test_layout_lowers_to_custom_call_with_comm_id_and_config_attributes():
    R, T, K, E = 2, 64, 4, 16
    mesh = _mesh(R)

    def per_rank(idx):
        return layout_ffi.layout(idx, num_experts=E, num_ranks=R, comm_id=COMM_ID)

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
        from comm_probe import probe_all_to_all_cuda
        return probe_all_to_all_cuda(x.reshape(R, n), comm_id=COMM_ID).reshape(1, R * n)

    text = _export_text(_smap(per_rank, mesh), jax.ShapeDtypeStruct((R, R * n), jnp.bfloat16))
    calls = _custom_calls(text, "jax_ep_probe_all_to_all")
    assert len(calls) == 1, text
    assert re.search(rf"comm_id = {COMM_ID} : i64", calls[0]), calls[0]
    assert f"tensor<{R}x{n}xbf16>" in calls[0], calls[0]


def test_layout_rejects_non_int32_ids_at_trace_time():
    with pytest.raises(ValueError, match="int32"):
        layout_ffi.layout(jnp.zeros((4, 2), jnp.int16), num_experts=4, num_ranks=2, comm_id=1)


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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_engram_publish_and_fetch_lower_to_two_custom_calls_ordered_by_the_token(dtype):
  from jax_ep._ffi import engram as _ffi_engram

  R, VL, D, T, E = 2, 1000, 128, 16, 3
  mesh = _mesh(R)

  def per_rank(table, idx):
    token = _ffi_engram.publish(table, comm_id=COMM_ID, reserved_bytes=12345)
    rows = _ffi_engram.fetch(token, idx.reshape(T, E), rows_per_rank=VL, dim=D,
                                  dtype=dtype, comm_id=COMM_ID, reserved_bytes=12345)
    return rows.reshape(1, T, E, D)

  f = _shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
  text = _export_text(f, jax.ShapeDtypeStruct((R * VL, D), dtype),
                      jax.ShapeDtypeStruct((R, T * E), jnp.int32))
  pub = _custom_calls(text, "jax_ep_engram_publish")
  fetch = _custom_calls(text, "jax_ep_engram_fetch")
  assert len(pub) == 1 and len(fetch) == 1, text
  assert re.search(rf"comm_id = {COMM_ID} : i64", pub[0]) and "reserved_bytes = 12345 : i64" in pub[0]
  assert re.search(rf"rows_per_rank = {VL} : i64", fetch[0]), fetch[0]
  assert "reserved_bytes = 12345 : i64" in fetch[0], fetch[0]
  # The fetch consumes the publish's token: XLA cannot reorder them.
  token = re.match(r"\s*(%\S+)", pub[0]).group(1)
  assert token in fetch[0].split("(", 1)[1], (pub[0], fetch[0])
  elt = "bf16" if dtype == jnp.bfloat16 else "f8E4M3FN"
  assert f"tensor<{T}x{E}x{D}x{elt}>" in fetch[0], fetch[0]


def test_engram_fused_publish_fetch_lowers_to_one_custom_call():
  from jax_ep._ffi import engram as _ffi_engram

  R, VL, D, T, E = 2, 64, 128, 8, 2
  mesh = _mesh(R)

  def per_rank(table, idx):
    return _ffi_engram.publish_fetch(table, idx.reshape(T, E), comm_id=COMM_ID,
                                         num_sms=7).reshape(1, T, E, D)

  f = _shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
  text = _export_text(f, jax.ShapeDtypeStruct((R * VL, D), jnp.float32),
                      jax.ShapeDtypeStruct((R, T * E), jnp.int32))
  calls = _custom_calls(text, "jax_ep_engram_publish_fetch")
  assert len(calls) == 1, text
  assert "num_sms = 7 : i32" in calls[0] and f"tensor<{T}x{E}x{D}xf32>" in calls[0], calls[0]


@pytest.mark.parametrize("backend", [None, "auto", "reference", "cuda"])
def test_public_engram_uses_kernels_unless_told_reference(monkeypatch, backend):
  import jax_ep
  from jax_ep.ops import _backend

  class _Comm:
    comm_id = COMM_ID
    num_bytes = 1 << 30

  # A Communicator "exists" with room for the table: auto picks the kernels.
  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _Comm())
  R, VL, D, T, E = 2, 64, 128, 8, 2
  mesh = _mesh(R)

  def per_rank(table, idx):
    return jax_ep.engram_fetch(table, idx.reshape(T, E), axis_name="ep",
                               backend=backend).reshape(1, T, E, D)

  f = _shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
  text = _export_text(f, jax.ShapeDtypeStruct((R * VL, D), jnp.bfloat16),
                      jax.ShapeDtypeStruct((R, T * E), jnp.int32))
  n = len(_custom_calls(text, "jax_ep_engram_publish_fetch"))
  assert n == (0 if backend == "reference" else 1), text


@pytest.mark.parametrize("dim,match", [
    (128, "Communicator"),    # no communicator for the axis
    (4, "multiple of 16"),    # rows of 8 bytes
])
def test_engram_cuda_backend_without_communicator_or_with_short_rows_raises(dim, match):
  import jax_ep

  mesh = _mesh(2)
  f = _shard_map(lambda t, i: jax_ep.engram_fetch(t, i.reshape(4, 2), backend="cuda")[None],
                 mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
  with pytest.raises(ValueError, match=match):
    jax.jit(f).lower(jnp.zeros((16, dim), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32))


def test_engram_window_bytes_needed_places_table_above_reserved_area():
  from jax_ep import _window

  need = _window.engram_bytes(rows_per_rank=524288, dim=128, dtype=jnp.bfloat16,
                              reserved_bytes=1000)
  assert need == 4096 + 524288 * 256
  need = _window.engram_bytes(rows_per_rank=10, dim=128, dtype=jnp.float8_e4m3fn,
                              reserved_bytes=5000)
  assert need == 5120 + 10 * 128


def test_published_tables_lower_to_one_publish_each_and_fetches_that_take_its_token(monkeypatch):
  """engram_publish(backend="cuda") twice (the second above the first) and
  three fetches: two publish calls with table_end_offset 0 and below the
  first table, and every fetch consumes its own table's token."""
  import dataclasses as dc
  import jax_ep
  from jax_ep.ops import _backend

  @dc.dataclass
  class _Comm:
    comm_id: int = COMM_ID
    num_ranks: int = 2
    num_bytes: int = 1 << 30

  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _Comm())
  R, VL, D, T, E = 2, 1000, 128, 16, 3
  mesh = _mesh(R)

  def per_rank(t1, t2, idx):
    p1 = jax_ep.engram_publish(t1, backend="cuda")
    p2 = jax_ep.engram_publish(t2, backend="cuda", above=p1)
    i = idx.reshape(T, E)
    a = jax_ep.engram_fetch(p1, i)
    b = jax_ep.engram_fetch(p2, i)
    c = jax_ep.engram_fetch(p1, i + 1)
    return (a.astype(jnp.float32) + b + c.astype(jnp.float32)).reshape(1, T, E, D)

  f = _shard_map(per_rank, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"))
  text = _export_text(f, jax.ShapeDtypeStruct((R * VL, D), jnp.bfloat16),
                      jax.ShapeDtypeStruct((R * VL, D), jnp.float32),
                      jax.ShapeDtypeStruct((R, T * E), jnp.int32))
  pubs = _custom_calls(text, "jax_ep_engram_publish")
  fetches = _custom_calls(text, "jax_ep_engram_fetch")
  assert len(pubs) == 2 and len(fetches) == 3, text
  offsets = sorted(int(re.search(r"table_end_offset = (\d+) : i64", p).group(1)) for p in pubs)
  assert offsets == [0, VL * D * 2 + 256], offsets
  tokens = [re.match(r"\s*(%\S+)", p).group(1) for p in pubs]
  for fc in fetches:
    assert sum(t in fc.split("(", 1)[1] for t in tokens) == 1, fc


class _LlComm:
    comm_id = COMM_ID
    num_bytes = 1 << 30


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_ops_lower_to_one_kernel_call_each_with_their_shapes(monkeypatch, fp8):
    """low_latency_dispatch -> low_latency_combine (backend="cuda") in one
    step: one custom call each, the grid shapes of the contract, the combine
    fed the dispatch's handle."""
    import jax_ep
    from jax_ep.ops import _backend

    monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _LlComm())
    R, T, H, K, E, M = 2, 8, 256, 4, 16, 8
    mesh = _mesh(R)

    def per_rank(x, idx, w):
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens=M, fp8=fp8,
                                        backend="cuda")
        y = (o.recv_x[0].astype(jnp.float32) * o.recv_x[1][..., :1] if fp8 else o.recv_x)
        return jax_ep.low_latency_combine(y.astype(jnp.bfloat16), idx, w, o.handle,
                                          backend="cuda")

    f = _smap(per_rank, mesh)
    text = _export_text(f, jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16),
                        jax.ShapeDtypeStruct((R * T, K), jnp.int32),
                        jax.ShapeDtypeStruct((R * T, K), jnp.float32))
    d = _custom_calls(text, "jax_ep_ll_dispatch")
    c = _custom_calls(text, "jax_ep_ll_combine")
    assert len(d) == 1 and len(c) == 1, text
    elt = "f8E4M3FN" if fp8 else "bf16"
    assert f"tensor<{E // R}x{R * M}x{H}x{elt}>" in d[0], d[0]
    assert f"tensor<{E // R}x{R * M}xi32>" in d[0] and re.search(rf"comm_id = {COMM_ID} : i64", d[0])
    assert f"fp8 = {int(fp8)} : i32" in d[0] and f"max_tokens = {M} : i32" in d[0], d[0]
    assert f"tensor<{T}x{H}xbf16>" in c[0], c[0]


def test_low_latency_options_reach_the_kernels_as_attributes(monkeypatch):
    import jax_ep
    from jax_ep.ops import _backend

    monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _LlComm())
    R, T, H, K, E, M = 2, 8, 256, 4, 16, 8
    kw = dict(reserved_bytes=12345 << 8, num_sms=7, backend="cuda")

    def per_rank(x, idx, w):
        o = jax_ep.low_latency_dispatch(x, idx, num_experts=E, max_tokens=M, **kw)
        return jax_ep.low_latency_combine(o.recv_x, idx, w, o.handle, **kw)

    text = _export_text(_smap(per_rank, _mesh(R)), jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16),
                        jax.ShapeDtypeStruct((R * T, K), jnp.int32),
                        jax.ShapeDtypeStruct((R * T, K), jnp.float32))
    for target in ("jax_ep_ll_dispatch", "jax_ep_ll_combine"):
        (call,) = _custom_calls(text, target)
        assert f"reserved_bytes = {12345 << 8} : i64" in call and "num_sms = 7 : i32" in call, call


def test_low_latency_cuda_refuses_inputs_the_kernels_cannot_take(monkeypatch):
    import jax_ep
    from jax_ep.ops import _backend

    monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _LlComm())
    mesh = _mesh(2)
    f = _smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, num_experts=8, max_tokens=4,
                                                       backend="cuda").recv_count, mesh)
    with pytest.raises(ValueError, match="bf16"):
        jax.jit(f).lower(jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         jax.ShapeDtypeStruct((8, 2), jnp.int32))


def test_low_latency_cuda_refuses_a_window_too_small_at_trace_time(monkeypatch):
    import jax_ep
    from jax_ep.ops import _backend

    class _Small(_LlComm):
        num_bytes = 1 << 21

    monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _Small())
    mesh = _mesh(2)
    f = _smap(lambda x, i: jax_ep.low_latency_dispatch(x, i, num_experts=16, max_tokens=128,
                                                       backend="cuda").recv_count, mesh)
    with pytest.raises(ValueError, match="window bytes"):
        jax.jit(f).lower(jax.ShapeDtypeStruct((256, 7168), jnp.bfloat16),
                         jax.ShapeDtypeStruct((256, 8), jnp.int32))


LL_TARGETS = ("jax_ep_ll_dispatch", "jax_ep_ll_combine", "jax_ep_ll_dispatch_send",
              "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")


@pytest.mark.parametrize("backend", ["cuda", None])
@pytest.mark.parametrize("split", [False, True])
def test_public_low_latency_ops_lower_to_the_kernels(monkeypatch, split, backend):
    """backend="cuda", and the automatic choice lowered for CUDA, lower the
    fused ops to one kernel call each and *_start / *_done to a send and a
    receive call, the receive taking the send's token."""
    import jax_ep
    from jax_ep.ops import _backend

    monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _LlComm())
    R, T, H, K, E, M = 2, 8, 256, 4, 16, 8
    mesh = _mesh(R)

    def per_rank(x, idx, w):
        kw = dict(num_experts=E, max_tokens=M, backend=backend)
        if split:
            o = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(x, idx, **kw))
            return jax_ep.low_latency_combine_done(
                jax_ep.low_latency_combine_start(o.recv_x, idx, w, o.handle, backend=backend))
        o = jax_ep.low_latency_dispatch(x, idx, **kw)
        return jax_ep.low_latency_combine(o.recv_x, idx, w, o.handle, backend=backend)

    text = _export_text(_smap(per_rank, mesh), jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16),
                        jax.ShapeDtypeStruct((R * T, K), jnp.int32),
                        jax.ShapeDtypeStruct((R * T, K), jnp.float32))
    counts = {t: len(_custom_calls(text, t)) for t in LL_TARGETS}
    if not split:
        assert counts == {**{t: 0 for t in LL_TARGETS}, "jax_ep_ll_dispatch": 1,
                          "jax_ep_ll_combine": 1}, counts
        return
    assert counts == {**{t: 1 for t in LL_TARGETS}, "jax_ep_ll_dispatch": 0,
                      "jax_ep_ll_combine": 0}, counts
    if backend is None:
        return  # the choice's branches are functions of their own: no one SSA name to follow
    for op in ("dispatch", "combine"):
        send = _custom_calls(text, f"jax_ep_ll_{op}_send")[0]
        recv = _custom_calls(text, f"jax_ep_ll_{op}_recv")[0]
        token = re.match(r"\s*(%\S+)", send).group(1)
        assert token in recv.split("(", 1)[1], (send, recv)


def test_a_second_communicator_on_an_axis_is_an_error_unless_replace(monkeypatch):
    """Ops pick the Communicator of their axis: a second create on that axis
    must not shadow the first silently (docs/errors.md)."""
    from jax_ep import comm as _comm

    closed = []
    monkeypatch.setattr(_comm._native, "module",
                        lambda: type("M", (), {"comm_destroy": staticmethod(closed.append)}))
    old = _comm.Communicator(comm_id=41, mesh=_mesh(2), axis_name="ep", num_bytes=1 << 21,
                             timeout_s=1.0)
    monkeypatch.setitem(_comm._defaults, "ep", old)
    with pytest.raises(ValueError, match="already open.*replace=True"):
        _comm.Communicator.create(_mesh(2), "ep")
    assert not old.closed and _comm.current("ep") is old
    # replace=True validates the new one's arguments before closing the old:
    # a CPU mesh is refused and the old one stays.
    with pytest.raises(ValueError, match="GPUs"):
        _comm.Communicator.create(_mesh(2), "ep", replace=True)
    assert not old.closed and closed == []
    old.close()
    assert closed == [41] and _comm.current("ep") is None
