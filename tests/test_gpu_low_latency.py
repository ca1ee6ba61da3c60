"""Low-latency dispatch / combine on GPU against the low-latency reference:
the public ops on the dedicated kernels (backend="cuda", and the automatic
choice on CUDA), fused and split: counts, handle and every valid row
bitwise, rows past the counts not compared (the contract leaves them
unspecified), the combine bitwise."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep import _native
from oracle import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep built with CUDA and 2 GPUs"),
]

if _native.cuda_available():
  import gpu_helpers as h

# The kernels' area sits above LL_RESERVED (the normal ops of the other
# tests here use the bytes below it): ~970 MB at the design shape.
LL_RESERVED = 1 << 30
COMM_BYTES = LL_RESERVED + (1 << 30)


@pytest.fixture(scope="module")
def comm(gpu_comm):
  return gpu_comm


def _compare(got, want, R, mt, what):
  """Counts and handle equal, recv_x equal on the valid rows, combine equal."""
  gx, gc, ge, go = got
  wx, wc, we, wo = want
  np.testing.assert_array_equal(np.asarray(gc), np.asarray(wc), err_msg=f"{what}: counts")
  np.testing.assert_array_equal(np.asarray(ge), np.asarray(we), err_msg=f"{what}: src_entry")
  counts = np.asarray(wc)                                    # [R, E_l]
  valid = np.arange(R * mt)[None, None, :] < counts[:, :, None]
  lg, lw = jax.tree.leaves(gx), jax.tree.leaves(wx)
  assert len(lg) == len(lw), what
  for j, (a, b) in enumerate(zip(lg, lw)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, j, a.shape, b.shape, a.dtype, b.dtype)
    np.testing.assert_array_equal(bits(a)[valid], bits(b)[valid], err_msg=f"{what}: recv_x leaf {j}")
  go, wo = np.asarray(go), np.asarray(wo)
  assert go.dtype == wo.dtype, (what, go.dtype, wo.dtype)
  np.testing.assert_array_equal(bits(go), bits(wo), err_msg=f"{what}: combine")


@pytest.mark.parametrize("T,H,K,E,mt,fp8,split", [
    (128, 7168, 8, 256, 128, True, False),   # docs/design.md §6 low-latency shape
    (128, 7168, 8, 256, 128, False, True),
    (37, 2048, 6, 64, 64, True, True),
    (1, 128, 1, 8, 4, False, False),
    (0, 128, 2, 8, 4, False, False),
])
def test_low_latency_auto_runs_the_kernels_and_equals_the_reference(comm, T, H, K, E, mt, fp8,
                                                                    split):
  """backend=None on CUDA with a Communicator: the program holds the kernels'
  custom calls, and its results are the reference's."""
  R = comm.num_ranks
  rng = np.random.default_rng(T + H + K + E + mt + fp8 + 2 * split)
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
  w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
  x = (rng.standard_normal((R, T, H)) * 3).astype(jnp.bfloat16)
  y = (rng.standard_normal((R, E // R, R * mt, H))).astype(jnp.bfloat16)

  def per_rank(x, i, w, y):
    outs = []
    for backend in (None, "reference"):
      kw = dict(num_experts=E, max_tokens=mt, fp8=fp8, backend=backend)
      if split:
        o = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(x, i, **kw))
        out = jax_ep.low_latency_combine_done(
            jax_ep.low_latency_combine_start(y, i, w, o.handle, backend=backend))
      else:
        o = jax_ep.low_latency_dispatch(x, i, **kw)
        out = jax_ep.low_latency_combine(y, i, w, o.handle, backend=backend)
      outs.append((o.recv_x, o.recv_count, o.handle.src_entry, out))
    return outs

  f = h.per_rank_jit(comm.mesh, per_rank)
  args = [h.put(comm.mesh, np.asarray(v)) for v in (x, idx, w, y)]
  text = f.lower(*args).as_text()
  names = ("jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
           "jax_ep_ll_combine_recv") if split else ("jax_ep_ll_dispatch", "jax_ep_ll_combine")
  for name in names:
    assert f"@{name}(" in text or f'"{name}"' in text, name
  got, want = jax.block_until_ready(f(*args))
  comm.check()
  _compare(got, want, R, mt, "auto")


def _kernel_round(comm, T, H, K, E, mt, fp8, ue8m0, seed, calls=1, split=False):
  """`calls` dispatch -> combine rounds on the kernels (backend="cuda") in one
  program, fresh inputs each, against the reference; returns nothing,
  asserts bitwise. split: the send and receive halves as separate calls
  (*_start / *_done)."""
  R = comm.num_ranks
  rng = np.random.default_rng(seed)
  xs, idxs, ws, ys = [], [], [], []
  for _ in range(calls):
    idxs.append(np.stack([h.random_topk(rng, T, K, E) for _ in range(R)]))
    ws.append(rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32))
    xs.append((rng.standard_normal((R, T, H)) * 3).astype(jnp.bfloat16))
    ys.append(rng.standard_normal((R, E // R, R * mt, H)).astype(jnp.bfloat16))

  def per_rank(xs, idxs, ws, ys):
    outs = []
    for x, i, w, y in zip(xs, idxs, ws, ys):
      kw = dict(num_experts=E, max_tokens=mt, fp8=fp8, ue8m0=ue8m0, reserved_bytes=LL_RESERVED,
                backend="cuda")
      ckw = dict(reserved_bytes=LL_RESERVED, backend="cuda")
      if split:
        o = jax_ep.low_latency_dispatch_done(jax_ep.low_latency_dispatch_start(x, i, **kw))
        out = jax_ep.low_latency_combine_done(jax_ep.low_latency_combine_start(y, i, w, o.handle,
                                                                               **ckw))
      else:
        o = jax_ep.low_latency_dispatch(x, i, **kw)
        out = jax_ep.low_latency_combine(y, i, w, o.handle, **ckw)
      r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, fp8=fp8, ue8m0=ue8m0,
                                      backend="reference")
      want = jax_ep.low_latency_combine(y, i, w, r.handle, backend="reference")
      outs.append(((o.recv_x, o.recv_count, o.handle.src_entry, out),
                   (r.recv_x, r.recv_count, r.handle.src_entry, want)))
    return outs

  f = h.per_rank_jit(comm.mesh, per_rank)
  args = [[h.put(comm.mesh, np.asarray(v)) for v in group] for group in (xs, idxs, ws, ys)]
  res = jax.block_until_ready(f(*args))
  comm.check()
  for c, (got, want) in enumerate(res):
    _compare(got, want, R, mt, f"call {c}")


@pytest.mark.parametrize("T,H,K,E,mt,fp8,ue8m0", [
    (128, 7168, 8, 256, 128, False, False),  # docs/design.md §6 low-latency shape
    (128, 7168, 8, 256, 128, True, False),
    (37, 2048, 6, 64, 64, True, True),
    (1, 128, 1, 8, 4, False, False),
    (0, 128, 2, 8, 4, False, False),        # a rank with no tokens
    (50, 256, 32, 64, 50, False, False),    # K = 32: one lane per slot
])
def test_low_latency_kernels_bitwise_equal_reference(comm, T, H, K, E, mt, fp8, ue8m0):
  _kernel_round(comm, T, H, K, E, mt, fp8, ue8m0, seed=T + H + K + E + mt + 2 * fp8 + ue8m0)


def test_low_latency_kernels_many_calls_in_one_program_alternating_buffers(comm):
  """Five rounds in one program: both buffers used twice or more; the
  sequence numbers carry over between programs (second run)."""
  for run in range(2):
    _kernel_round(comm, 64, 512, 4, 32, 64, False, False, seed=900 + run, calls=5)


def test_low_latency_kernels_fp8_and_bf16_calls_share_the_area(comm):
  _kernel_round(comm, 32, 1024, 4, 16, 32, True, False, seed=950)
  _kernel_round(comm, 32, 1024, 4, 16, 32, False, False, seed=951)
  _kernel_round(comm, 32, 1024, 4, 16, 32, True, True, seed=952)


def test_low_latency_kernel_bad_expert_id_is_reported_and_next_call_works(comm):
  from jax_ep._checks import EpRuntimeError
  R, T, H, K, E, mt = comm.num_ranks, 16, 256, 2, 8, 16
  rng = np.random.default_rng(977)
  idx = np.stack([h.random_topk(rng, T, K, E) for _ in range(R)])
  idx[R - 1, 3, 0] = E + 2
  x = rng.standard_normal((R, T, H)).astype(jnp.bfloat16)
  f = h.per_rank_jit(comm.mesh, lambda x, i: jax_ep.low_latency_dispatch(
      x, i, num_experts=E, max_tokens=mt, reserved_bytes=LL_RESERVED, backend="cuda").recv_count)
  jax.block_until_ready(f(h.put(comm.mesh, x), h.put(comm.mesh, idx)))
  with pytest.raises(EpRuntimeError, match="expert id"):
    comm.check()
  _kernel_round(comm, T, H, K, E, mt, False, False, seed=978)


def test_low_latency_kernels_survive_layout_changes(comm):
  """Shapes A, B, A, B on one communicator: each change moves the areas and
  takes the reset path (two barriers, count words cleared)."""
  for n, (T, H, K, E, mt) in enumerate([(16, 512, 4, 16, 16), (40, 1024, 8, 32, 48)] * 2):
    _kernel_round(comm, T, H, K, E, mt, n % 2 == 1, False, seed=990 + n, calls=2)


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_kernels_split_into_send_and_receive(comm, fp8):
  """*_start / *_done as separate kernels: the same bits as the reference
  (and so as the fused kernels), three rounds in one program."""
  _kernel_round(comm, 128, 7168, 8, 256, 128, fp8, False, seed=1200 + fp8, calls=3, split=True)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("cmdbuf", [False, True], ids=["plain", "command_buffers"])
def test_low_latency_kernels_in_a_decode_loop_with_and_without_command_buffers(comm, cmdbuf,
                                                                               split):
  """A jitted fori_loop of dispatch -> combine on the kernels (8 steps) in a fresh
  process, with XLA's command buffers on for custom calls or off: bitwise
  the reference loop; prints the time per step of each."""
  out = h.run_worker("gpu_ll_cmdbuf_worker.py", command_buffers=cmdbuf,
                     env_extra={"JAX_EP_TEST_GPUS": str(comm.num_ranks),
                                "LL_SPLIT": "1" if split else "0"})
  # The module's communicator holds these GPUs' windows; the worker makes its own.
  line = [l for l in out.splitlines() if l.startswith("LL_CMDBUF")]
  assert line, out[-2000:]
  print(line[0], "(command buffers)" if cmdbuf else "(plain)")
  assert "equal=True" in line[0], line[0]


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_low_latency_dispatch_at_under_and_one_row_over_r_times_max_tokens(comm, extra):
  """The GPU twin of test_low_latency.py's edge test: an expert receiving
  R*max_tokens - 1 or R*max_tokens rows equals the reference (counts and
  every valid row); one row more raises "overflow" (when a result is read,
  or at comm.check() in deferred mode), never drops a row. backend="cuda"
  runs the dedicated kernels."""
  R, T, K, H = comm.num_ranks, 8, 2, 256
  E, mt = 4 * R, T
  idx = np.full((R, T, K), -1, np.int32)
  idx[:, :, 0] = 0
  if extra == 1:
    idx[R - 1, T - 1, 1] = 0
  elif extra == -1:
    idx[0, 0, 0] = 1
  x = np.random.default_rng(990 + extra).standard_normal((R, T, H)).astype(jnp.bfloat16)

  def per_rank(x, i):
    o = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, backend="cuda")
    r = jax_ep.low_latency_dispatch(x, i, num_experts=E, max_tokens=mt, backend="reference") \
        if extra < 1 else o
    return o.recv_x, o.recv_count, r.recv_x, r.recv_count

  f = h.per_rank_jit(comm.mesh, per_rank)
  args = (h.put(comm.mesh, x), h.put(comm.mesh, idx))
  if extra == 1:
    try:
      jax.block_until_ready(f(*args))
      comm.check()
    except jax.errors.JaxRuntimeError as e:   # EpRuntimeError (check()) is one
      assert "overflow" in str(e), str(e)
    else:
      pytest.fail("one row over R*max_tokens was not reported")
    _kernel_round(comm, T, H, K, E, mt, False, False, seed=991)  # the next call works
    return
  recv, count, want, want_count = (np.asarray(a) for a in jax.block_until_ready(f(*args)))
  comm.check()
  np.testing.assert_array_equal(count, want_count)
  assert count.reshape(R, -1)[0, 0] == R * mt + extra
  recv, want = recv.reshape(R, E // R, R * mt, H), want.reshape(R, E // R, R * mt, H)
  for r in range(R):
    for l in range(E // R):
      n = int(want_count.reshape(R, -1)[r, l])
      np.testing.assert_array_equal(bits(recv[r, l, :n]), bits(want[r, l, :n]), err_msg=f"{r} {l}")
