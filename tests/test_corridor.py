"""One corridor per op: each public op reaches its kernels through one FFI
wrapper module named after its handler, with `num_sms` as an attribute that
means the same everywhere, and its backend decided by the one chooser
(`jax_ep.ops._backend.choose`).

Lowered for CUDA on this CPU machine (jax.export only lowers), as if jax_ep
were built with CUDA and a Communicator existed for the axis."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_ep
from jax_ep import _native
from jax_ep._ffi import grouped_gemm as gg_ffi
from jax_ep.ops import _backend

# The source tree next to these tests (CI tests an installed wheel, whose
# package directory holds no ffi/ beside it).
REPO = pathlib.Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "jax_ep"
R = 2
N = 7  # an SM count no default takes


@dataclasses.dataclass
class _FakeComm:
  comm_id: int = 4242424242
  num_ranks: int = R
  num_bytes: int = 1 << 30


@pytest.fixture
def kernels(monkeypatch):
  """As if jax_ep were built with CUDA and a Communicator existed for 'ep'."""
  monkeypatch.setattr(_backend, "cuda_comm", lambda axis_name: _FakeComm())
  monkeypatch.setattr(_backend, "cuda_built", lambda: True)
  # The grouped GEMM's scratch size comes from the native module.
  monkeypatch.setattr(gg_ffi, "workspace_bytes", lambda *a, **k: 1024)


def _mesh() -> Mesh:
  devs = jax.devices()[:R]
  if len(devs) < R:
    pytest.skip(f"needs {R} devices")
  return Mesh(np.array(devs), ("ep",))


def _calls(f, *args) -> list[tuple[str, str]]:
  """(target, line) of every jax_ep custom call of jit(f) lowered for CUDA."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _native.TARGETS]
  text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
      *args).mlir_module()
  out = []
  for line in text.splitlines():
    m = re.search(r'custom_call @(jax_ep_\w+)\(', line) or re.search(
        r'call_target_name = "(jax_ep_\w+)"', line)
    if m:
      out.append((m.group(1), line))
  return out


def _sds(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


T, H, K, E, F, M = 16, 256, 4, 16, 256, 8


def _normal(n):
  def per_rank(x, idx, w):
    lay = jax_ep.get_dispatch_layout(idx, num_experts=E, num_sms=n)
    o = jax_ep.dispatch(x, idx, w, num_experts=E, layout="expert", num_sms=n)
    y = jax_ep.combine(o.recv_x, o.handle, o.recv_topk_weights, num_sms=n)
    p = jax_ep.dispatch_start(x, idx, w, num_experts=E, num_sms=n)
    o2 = jax_ep.dispatch_done(p)
    y2 = jax_ep.combine_done(jax_ep.combine_start(o2.recv_x, o2.handle, num_sms=n))
    return y + y2 + lay.num_tokens_per_rank.sum().astype(y.dtype)
  args = (_sds((R * T, H)), _sds((R * T, K), jnp.int32), _sds((R * T, K), jnp.float32))
  return jax_ep.shard_map(per_rank, _mesh()), args


def _normal_grad(n):
  f, args = _normal(n)
  return jax.value_and_grad(lambda x, i, w: jnp.sum(f(x, i, w).astype(jnp.float32)),
                            argnums=(0, 2)), args


def _low_latency(n):
  def per_rank(x, idx, w):
    kw = dict(num_experts=E, max_tokens=M, num_sms=n)
    o = jax_ep.low_latency_dispatch(x, idx, **kw)
    y = jax_ep.low_latency_combine(o.recv_x, idx, w, o.handle, num_sms=n)
    o2 = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(x, idx, **kw))
    y2 = jax_ep.low_latency_combine_done(
        jax_ep.low_latency_combine_start(o2.recv_x, idx, w, o2.handle, num_sms=n))
    return y + y2
  args = (_sds((R * M, H)), _sds((R * M, K), jnp.int32), _sds((R * M, K), jnp.float32))
  return jax_ep.shard_map(per_rank, _mesh()), args


def _engram(n):
  def per_rank(table, idx):
    pub = jax_ep.engram_publish(table, num_sms=n)
    a = jax_ep.engram_fetch(pub, idx, num_sms=n)
    b = jax_ep.engram_fetch_wait(jax_ep.engram_fetch_start(jax.lax.stop_gradient(table), idx,
                                                           num_sms=n))  # forward-only
    return a + b + jax_ep.engram_fetch(table, idx, num_sms=n)
  f = jax_ep.shard_map(per_rank, _mesh())
  g = jax.value_and_grad(lambda t, i: jnp.sum(f(t, i).astype(jnp.float32)))
  return g, (_sds((R * 64, 128)), _sds((R * T, 3), jnp.int32))


def _grouped(n):
  def f(x, w, sizes, xm, counts):
    a = jax_ep.grouped_matmul(x, w, sizes, num_sms=n)
    b = jax_ep.masked_grouped_matmul(xm, w, counts, num_sms=n)
    return jnp.sum(a.astype(jnp.float32)) + jnp.sum(b.astype(jnp.float32))
  g = jax.value_and_grad(f, argnums=(0, 1))
  return g, (_sds((64, H)), _sds((4, H, F)), _sds((4,), jnp.int32), _sds((4, 8, H)),
             _sds((4,), jnp.int32))


def _grouped_fp8(n):
  def f(x, w, sizes, xm, counts):
    a = jax_ep.grouped_matmul_fp8(x, w, sizes, num_sms=n)  # training: casts, dgrad, wgrad
    # The inference forms (FP8 operands as they arrive) are not differentiable.
    x, w, xm = (jax.lax.stop_gradient(v) for v in (x, w, xm))
    wq = jax_ep.fp8_weights(w, num_sms=n)
    b = jax_ep.grouped_matmul_fp8(jax_ep.quantize(x), (wq.q, wq.s), sizes, num_sms=n)
    c = jax_ep.masked_grouped_matmul_fp8(jax_ep.quantize(xm), (wq.q, wq.s), counts, num_sms=n)
    return sum(jnp.sum(v.astype(jnp.float32)) for v in (a, b, c))
  g = jax.value_and_grad(f, argnums=(0, 1))
  return g, (_sds((128, H)), _sds((4, H, F)), _sds((4,), jnp.int32), _sds((4, 8, H)),
             _sds((4,), jnp.int32))


# Every FFI target that launches work, and the program above reaching it.
STEPS = {"normal": _normal, "normal_grad": _normal_grad, "low_latency": _low_latency,
         "engram": _engram, "grouped": _grouped, "grouped_fp8": _grouped_fp8}
LAUNCHING = set(_native.TARGETS) - {"jax_ep_side_done"}


@pytest.mark.parametrize("n", [None, 0, N])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_num_sms_reaches_every_kernel_call_as_an_attribute(kernels, step, n):
  """num_sms of the public op (0 / None: the op's default) is the num_sms
  attribute of every custom call it makes, backward ones included."""
  f, args = STEPS[step](n)
  calls = _calls(f, *args)
  assert calls, step
  for target, line in calls:
    if target == "jax_ep_side_done":  # no kernel: a stream wait
      assert "num_sms" not in line
      continue
    assert f"num_sms = {n or 0} : i32" in line, (target, line[:400])


def test_the_steps_reach_every_launching_target(kernels):
  seen = set()
  for build in STEPS.values():
    seen |= {t for t, _ in _calls(*_args_of(build))}
  assert seen >= LAUNCHING, LAUNCHING - seen


def _args_of(build):
  f, args = build(N)
  return (f, *args)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_a_bad_num_sms_raises_naming_it_on_every_op(bad):
  mesh = _mesh()
  x, idx = jnp.zeros((R * 8, 128), jnp.bfloat16), jnp.zeros((R * 8, 2), jnp.int32)
  w = jnp.ones((R * 8, 2), jnp.float32)
  ops = {
      "layout": lambda x, i, w: jax_ep.get_dispatch_layout(i, num_experts=4, num_sms=bad),
      "dispatch": lambda x, i, w: jax_ep.dispatch(x, i, num_experts=4, num_sms=bad).recv_x,
      "low_latency": lambda x, i, w: jax_ep.low_latency_dispatch(
          x, i, num_experts=4, max_tokens=8, num_sms=bad).recv_x,
      "engram": lambda x, i, w: jax_ep.engram_fetch(x, i, num_sms=bad),
  }
  for name, op in ops.items():
    with pytest.raises(ValueError, match="num_sms"):
      jax.jit(jax_ep.shard_map(op, mesh)).lower(x, idx, w)
  g = (jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16),
       jnp.zeros((2,), jnp.int32))
  for op in (jax_ep.grouped_matmul, jax_ep.grouped_matmul_fp8):
    with pytest.raises(ValueError, match="num_sms"):
      op(*g, num_sms=bad)
  with pytest.raises(ValueError, match="num_sms"):
    jax_ep.fp8_weights(g[1], num_sms=bad)


# ------------------------------------------------------------------ the corridor

def _py(path: pathlib.Path) -> str:
  return path.read_text()


def test_each_ffi_wrapper_module_is_named_after_its_handler():
  mods = {p.stem for p in (SRC / "_ffi").glob("*.py") if p.stem != "__init__"}
  handlers = {p.stem for p in (REPO / "ffi" / "handlers").glob("*.cc")} - {"bindings"}
  assert mods == handlers, (mods ^ handlers)


def test_every_target_has_one_wrapper_and_ffi_call_is_made_in_one_place():
  owners: dict[str, list[str]] = {}
  for p in (SRC / "_ffi").glob("*.py"):
    for t in re.findall(r'call\(\s*"(jax_ep_\w+)"', _py(p)):
      owners.setdefault(t, []).append(p.stem)
  assert set(owners) == set(_native.TARGETS), set(owners) ^ set(_native.TARGETS)
  assert all(len(v) == 1 for v in owners.values()), owners
  users = [p for p in SRC.rglob("*.py") if "ffi_call(" in _py(p)]
  assert users == [SRC / "_ffi" / "__init__.py"], users


def test_no_factory_or_getattr_hook_leads_to_a_wrapper():
  for p in SRC.rglob("*.py"):
    text = _py(p)
    assert "_factory" not in text, p
    assert not re.search(r"getattr\(\s*_?ffi", text), p


def test_the_backend_is_decided_only_by_the_one_chooser():
  """No op module decides a backend itself: no platform_dependent, no test
  of the build or of the user's `backend` string outside ops/_backend.py."""
  bad = re.compile(r"platform_dependent|_native\.cuda_built|(?<![.\w])backend\s*(==|!=|in\b)"
                   r"|def _choose|def _pick|_use_fp8_kernel")
  for p in (SRC / "ops").glob("*.py"):
    if p.name == "_backend.py":
      continue
    hits = [l for l in _py(p).splitlines() if bad.search(l)]
    assert not hits, (p.name, hits)
  # and every op module that runs kernels goes through it
  for name in ("dispatch", "engram", "grouped_gemm", "layout", "low_latency", "overlap"):
    assert "_backend.choose(" in _py(SRC / "ops" / f"{name}.py") or (
        "choice(" in _py(SRC / "ops" / f"{name}.py")), name


def test_window_formulas_have_one_python_owner():
  """Only jax_ep/_window.py sizes windows from the kernels' layout constants."""
  for p in SRC.rglob("*.py"):
    if p.name in ("_window.py", "_native.py"):
      continue
    text = _py(p)
    for const in ("WINDOW_HEADER_BYTES", "CHUNKS_PER_SOURCE", "_ALIGN = 256"):
      assert const not in text, (p, const)
  assert jax_ep.get_buffer_size_hint.__module__ == "jax_ep._window"


def test_no_environment_variable_sets_an_sm_count():
  for p in list(SRC.rglob("*.py")):
    assert "JAX_EP_NUM_SMS" not in _py(p) and "JAX_EP_RECV_SMS" not in _py(p), p
