"""The public ops pick the CUDA kernels when a Communicator exists: lowered
for the cuda platform (jax.export only lowers, so this runs on CPU), a step
that calls get_dispatch_layout, dispatch and combine holds the jax_ep custom
calls with the communicator's id; lowered for CPU it holds none. Engram's
publish / fetch likewise, when the window holds the table."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_ep
from jax_ep import _native
from jax_ep.ops import _backend

COMM_ID = 4242424242
TARGETS = ("jax_ep_dispatch_layout", "jax_ep_dispatch", "jax_ep_combine")


@dataclasses.dataclass
class _FakeComm:
  comm_id: int = COMM_ID
  num_ranks: int = 2
  num_bytes: int = 1 << 30


@pytest.fixture
def fake_comm(monkeypatch):
  """As if jax_ep were built with CUDA and a Communicator existed for 'ep'."""
  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _FakeComm())


@pytest.fixture
def small_fake_comm(monkeypatch):
  """As fake_comm, with a 1 MiB window."""
  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _FakeComm(num_bytes=1 << 20))


def _step(E, layout):
  def per_rank(x, idx, w):
    lay = jax_ep.get_dispatch_layout(idx, num_experts=E)
    o = jax_ep.dispatch(x, idx, w, num_experts=E, layout=layout)
    cw = o.recv_topk_weights if layout == "expert" else None
    return jax_ep.combine(o.recv_x, o.handle, cw), lay.num_tokens_per_rank
  return per_rank


def _lower(platform: str, layout: str) -> str:
  R, T, H, K, E = 2, 16, 256, 4, 16
  devs = jax.devices()[:R]
  if len(devs) < R:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(devs), ("ep",))
  f = jax_ep.shard_map(_step(E, layout), mesh)
  args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16), jax.ShapeDtypeStruct((R * T, K), jnp.int32),
          jax.ShapeDtypeStruct((R * T, K), jnp.float32))
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]
  exp = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args)
  return exp.mlir_module()


@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_public_ops_lower_to_jax_ep_custom_calls_for_cuda(fake_comm, layout):
  text = _lower("cuda", layout)
  for target in TARGETS:
    lines = [l for l in text.splitlines() if target + '"' in l or "@" + target + "(" in l]
    assert lines, f"{target} not in the cuda lowering"
    assert all(str(COMM_ID) in l for l in lines), (target, lines[0][:300])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowers for this machine's platform")
@pytest.mark.parametrize("layout", ["rank", "expert"])
def test_public_ops_lower_to_the_reference_for_cpu(fake_comm, layout):
  text = _lower("cpu", layout)
  for target in TARGETS:
    assert target + '"' not in text and "@" + target + "(" not in text, target


ENGRAM_TARGETS = ("jax_ep_engram_publish_fetch", "jax_ep_engram_publish", "jax_ep_engram_fetch")


def _engram_targets(platform: str, dim: int = 128, rows: int = 4096, dtype=jnp.bfloat16) -> set:
  """Engram custom calls in a step that publishes a table and fetches from it
  twice (published, then the fused form), lowered for `platform`."""
  R, T, e = 2, 8, 3
  devs = jax.devices()[:R]
  if len(devs) < R:
    pytest.skip("needs 2 devices")
  mesh = Mesh(np.array(devs), ("ep",))

  def per_rank(table, idx):
    pub = jax_ep.engram_publish(table)
    return jax_ep.engram_fetch(pub, idx), jax_ep.engram_fetch(table, idx)

  f = jax_ep.shard_map(per_rank, mesh)
  args = (jax.ShapeDtypeStruct((R * rows, dim), dtype), jax.ShapeDtypeStruct((R * T, e), jnp.int32))
  if platform == "cpu":
    text = jax.jit(f).lower(*args).as_text()
  else:
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ENGRAM_TARGETS]
    text = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(
        *args).mlir_module()
  return {t for t in ENGRAM_TARGETS if t + '"' in text or "@" + t + "(" in text}


def test_engram_auto_picks_the_kernels_for_cuda(fake_comm):
  assert _engram_targets("cuda") == set(ENGRAM_TARGETS)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowers for this machine's platform")
def test_engram_auto_lowers_to_the_reference_for_cpu(fake_comm):
  assert _engram_targets("cpu") == set()


def test_engram_auto_falls_back_where_the_kernels_cannot_run(small_fake_comm):
  # (Decided at trace time: the choice itself is checked.)
  from jax_ep.ops import engram as eg

  def choose(backend, table, reserved, end=0):
    return _backend.choose(backend, op="engram_fetch", axis_name="ep",
                           **eg._kernel_conditions(table, reserved, end)).kind

  table = jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16)  # 256 KiB: fits in 1 MiB
  assert choose(None, table, 0) == "auto"
  big = jax.ShapeDtypeStruct((4096, 128), jnp.bfloat16)    # 1 MiB: no room above the header
  assert choose(None, big, 0) == "reference"
  with pytest.raises(ValueError, match="window is too small.*num_bytes >= "):
    choose("cuda", big, 0)
  assert choose(None, table, 800 << 10) == "reference"  # reserved below it
  assert choose(None, table, 0, end=800 << 10) == "reference"  # tables above it
  odd = jax.ShapeDtypeStruct((16, 4), jnp.bfloat16)         # 8-byte rows
  assert choose(None, odd, 0) == "reference"
  assert choose("reference", table, 0) == "reference"


def test_engram_cuda_still_raises_where_auto_falls_back(small_fake_comm):
  R = 2
  mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))
  f = jax_ep.shard_map(lambda t, i: jax_ep.engram_fetch(t, i, backend="cuda"), mesh)
  with pytest.raises(ValueError, match="16 bytes"):
    jax.jit(f).lower(jax.ShapeDtypeStruct((R * 16, 4), jnp.bfloat16),
                     jax.ShapeDtypeStruct((R * 8, 3), jnp.int32))


def _mesh2() -> Mesh:
  devs = jax.devices()[:2]
  if len(devs) < 2:
    pytest.skip("needs 2 devices")
  return Mesh(np.array(devs), ("ep",))


def _cuda_text(f, args, targets) -> str:
  """The StableHLO of jit(f) exported for CUDA from this CPU machine."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
  return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
      *args).mlir_module()


@pytest.mark.parametrize("num_sms,recv_sms", [(None, None), (16, 4)])
def test_num_sms_and_recv_sms_reach_the_kernels_as_attributes(fake_comm, num_sms, recv_sms):
  R, T, H, K, E = 2, 16, 256, 4, 16
  mesh = _mesh2()

  def per_rank(x, idx):
    o = jax_ep.dispatch(x, idx, None, num_experts=E, num_sms=num_sms, recv_sms=recv_sms)
    return jax_ep.combine(o.recv_x, o.handle, num_sms=num_sms, recv_sms=recv_sms)

  text = _cuda_text(jax_ep.shard_map(per_rank, mesh),
                    (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16),
                     jax.ShapeDtypeStruct((R * T, K), jnp.int32)), TARGETS)
  for target in ("jax_ep_dispatch", "jax_ep_combine"):
    lines = [l for l in text.splitlines() if target + '"' in l or "@" + target + "(" in l]
    assert len(lines) == 1, target
    assert f"num_sms = {num_sms or 0} : i32" in lines[0], lines[0][:600]
    assert f"recv_sms = {recv_sms or 0} : i32" in lines[0], lines[0][:600]


@pytest.mark.parametrize("kw,match", [(dict(num_sms=-1), "num_sms"), (dict(recv_sms=-1), "recv_sms"),
                                      (dict(num_sms=8, recv_sms=8), "below num_sms"),
                                      (dict(num_sms=2.5), "num_sms")])
def test_bad_sm_counts_raise_naming_the_argument(kw, match):
  devs = jax.devices()[:2]
  mesh = Mesh(np.array(devs), ("ep",))
  f = jax_ep.shard_map(lambda x, i: jax_ep.dispatch(x, i, None, num_experts=4, **kw).recv_x, mesh)
  with pytest.raises(ValueError, match=match):
    jax.jit(f).lower(jax.ShapeDtypeStruct((len(devs) * 8, 128), jnp.bfloat16),
                     jax.ShapeDtypeStruct((len(devs) * 8, 2), jnp.int32))


def test_engram_table_gradient_lowers_to_the_ordered_sum_kernel_for_cuda(fake_comm):
  """On the kernels' path the table gradient is the deterministic per-row
  sum kernel, not XLA's scatter-add (atomics on the GPU; docs/design.md §2, Engram)."""
  R, T, e, rows, dim = 2, 8, 3, 4096, 128
  mesh = _mesh2()

  def per_rank(table, idx):
    return jax.grad(lambda t: jnp.sum(jax_ep.engram_fetch(t, idx).astype(jnp.float32) ** 2))(table)

  args = (jax.ShapeDtypeStruct((R * rows, dim), jnp.bfloat16),
          jax.ShapeDtypeStruct((R * T, e), jnp.int32))
  text = _cuda_text(jax_ep.shard_map(per_rank, mesh), args,
                    ENGRAM_TARGETS + ("jax_ep_engram_grad",))
  assert 'jax_ep_engram_grad"' in text or "@jax_ep_engram_grad(" in text
  assert "scatter" not in text, "the kernels' path still scatters"


LL_TARGETS = ("jax_ep_ll_dispatch", "jax_ep_ll_combine", "jax_ep_ll_dispatch_send",
              "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")


def _ll_step(split: bool, E: int = 16, M: int = 8, fp8: bool = False):
  def per_rank(x, idx, w):
    kw = dict(num_experts=E, max_tokens=M, fp8=fp8)
    if split:
      o = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(x, idx, **kw))
      y = o.recv_x[0].astype(jnp.bfloat16) if fp8 else o.recv_x
      return jax_ep.low_latency_combine_done(jax_ep.low_latency_combine_start(y, idx, w, o.handle))
    o = jax_ep.low_latency_dispatch(x, idx, **kw)
    y = o.recv_x[0].astype(jnp.bfloat16) if fp8 else o.recv_x
    return jax_ep.low_latency_combine(y, idx, w, o.handle)
  return per_rank


def _ll_targets(platform: str, split: bool, fp8: bool = False) -> set:
  R, T, H, K = 2, 8, 256, 4
  mesh = _mesh2()
  f = jax_ep.shard_map(_ll_step(split, fp8=fp8), mesh)
  args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16), jax.ShapeDtypeStruct((R * T, K), jnp.int32),
          jax.ShapeDtypeStruct((R * T, K), jnp.float32))
  if platform == "cpu":
    text = jax.jit(f).lower(*args).as_text()
  else:
    text = _cuda_text(f, args, LL_TARGETS)
  return {t for t in LL_TARGETS if t + '"' in text or "@" + t + "(" in text}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_low_latency_auto_picks_the_kernels_for_cuda(fake_comm, split, fp8):
  want = ({"jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
           "jax_ep_ll_combine_recv"} if split else {"jax_ep_ll_dispatch", "jax_ep_ll_combine"})
  assert _ll_targets("cuda", split, fp8) == want


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowers for this machine's platform")
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_low_latency_auto_lowers_to_the_reference_for_cpu(fake_comm, split):
  assert _ll_targets("cpu", split) == set()


def test_low_latency_auto_falls_back_where_the_kernels_cannot_run(small_fake_comm):
  # (Decided at trace time, as for Engram: the choice itself is checked.)
  from jax_ep.ops import low_latency as ll
  _mesh2()

  def choose(backend=None, *, dtype=jnp.bfloat16, hidden=256, fp8=False, topk=4, E=16, M=8,
             reserved=0):
    def per_rank(x):
      per_rank.kind = _backend.choose(backend, op="low_latency_dispatch", axis_name="ep",
                                      **ll._kernel_conditions(
                                          "ep", dtype=dtype, hidden=hidden, fp8=fp8, topk=topk,
                                          num_experts=E, max_tokens=M,
                                          reserved_bytes=reserved)).kind
      return x
    jax.jit(jax_ep.shard_map(per_rank, _mesh2())).lower(jax.ShapeDtypeStruct((2, 1), jnp.float32))
    return per_rank.kind

  assert choose() == "auto"
  assert choose(dtype=jnp.float32) == "reference"        # the kernels take bf16 only
  assert choose(hidden=260) == "reference"               # H a multiple of 8
  assert choose(fp8=True, hidden=192) == "reference"     # 128 with FP8
  assert choose(topk=33, E=64) == "reference"            # K <= 32
  assert choose(M=1 << 16) == "reference"                # 16-bit row counts
  assert choose(hidden=7168, E=256, M=128) == "reference"  # the 1 MiB window is too small
  assert choose(reserved=1 << 20) == "reference"         # no room above reserved_bytes
  assert choose("reference") == "reference"
  assert choose("cuda") == "cuda"
  comm = _FakeComm(num_bytes=1 << 20)
  comm.info = lambda: [dict(rank=0, gin_mask=0b10)]                  # a peer reached by GIN
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_backend, "cuda_comm", lambda axis_name: comm)
    assert choose() == "auto"                            # the kernels have a GIN path
    # A GIN peer adds the staging area to the window: a shape that fits the
    # 1 MiB window over LSA alone no longer does.
    assert choose(M=40) == "reference"
    with pytest.raises(ValueError, match="window bytes"):
      choose("cuda", M=40)
    comm.info = lambda: [dict(rank=0, gin_mask=0)]
    assert choose() == "auto"
    assert choose(M=40) == "auto"
  with pytest.raises(ValueError, match="bf16"):
    choose("cuda", dtype=jnp.float32)
  with pytest.raises(ValueError, match="window bytes"):
    choose("cuda", hidden=7168, E=256, M=128)

