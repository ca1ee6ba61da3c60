"""MoE training step (docs/design.md §6 "MoE step"): one MoE layer's jitted
forward + backward, jax_ep against the MoE layers a JAX user would write.

Shape: T = 4096 tokens/rank, H = 7168, expert width F = 2048, top-8 of 256
experts, bf16 parameters and activations, over every GPU found (EP = R). In
one run, each variant warmed up before any is timed:

  jax_ep               dispatch (expert layout) -> grouped_matmul -> gelu ->
                       grouped_matmul -> combine: the kernels on GPU
  jax_ep_rank_combine  rank-layout dispatch, rows regrouped by expert on each
                       rank, per-rank partial sums, one combined row per
                       (token, rank): jax_ep.nn.MoE's default at EP >= 2
                       (`jax_ep` is its layout at one rank)
  reference            the same layer with dispatch / combine on jax_ep's
                       pure-JAX reference backend (the expert GEMMs stay on
                       grouped_matmul: ragged_dot's backward does not fit)
  jax_native_dense_a2a one row per (token, destination rank) + dense
                       all_to_all, a local slot assignment per expert with a
                       capacity factor, padded batched matmuls, and back: the
                       strongest JAX-native layer we know (drops past capacity)
  jax_native_ragged_a2a the MaxText-style layer: (token, k) pairs sorted by
                       expert, lax.ragged_all_to_all of each rank's chunk (and
                       back), a local slot assignment per expert with the same
                       capacity factor and padded batched matmuls (not
                       ragged_dot, see below); GPU only (XLA:CPU has no
                       ragged-all-to-all), left out, saying why, if it fails
                       or disagrees; also once more in a fresh process with
                       XLA's symmetric-memory ragged-all-to-all kernel
                       (bench_normal.RAGGED_XLA_MODES), impl
                       jax_native_ragged_a2a[symmetric_memory], where the
                       plugin accepts the flag (else a record saying why)
  expert_gemms         jax_ep's two grouped matmuls alone (forward + backward)
                       on the same routing: the floor the step is held to

The loss is mean(out²) summed over ranks; gradients w.r.t. router, w_in and
w_out. The jax_ep step is also profiled (jax.profiler): GPU time per step in
dispatch / combine, in the expert GEMMs and in the rest. Before timing, all variants are run at a capacity with no drops and
their losses and gradients compared (bf16 tolerance). Records: bench =
moe_step (a run file under results/moe/); `--tokens 512` and `--sweep` for other sizes.
The MaxText layer's own expert compute, ragged_dot, is not used: its backward
at this shape needs a 56.8 GiB temporary (grouped GEMM bench, 2026-12-01)
and its forward alone takes ~186 ms per 32768 rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import sys
from typing import Callable, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_grouped_gemm as bg  # noqa: E402
import bench_normal as bn  # noqa: E402

# Where a MoE step's GPU time goes (jax_ep's kernel names, then XLA's). The
# grouped GEMM's families come first: CUTLASS's kernel names spell out their
# template arguments, `cutlass::layout::RowMajor` among them, which the
# dispatch layout kernel's "Layout" would otherwise claim (a run at acabcad,
# 2026-12-01, counted the GEMMs as dispatch that way).
STEP_FAMILIES = (("GemmUniversal", "expert_gemms"), ("PrepGroups", "expert_gemms"),
                 ("ZeroTailRows", "expert_gemms"), ("ZeroEmptyGroups", "expert_gemms"),
                 ("Dispatch", "dispatch_combine"), ("Combine", "dispatch_combine"))


@dataclasses.dataclass(frozen=True)
class MoEShape:
  tokens: int = 4096      # per rank
  hidden: int = 7168
  ffn: int = 2048
  experts: int = 256
  topk: int = 8
  align: int = 8          # jax_ep's expert_alignment
  capacity_factor: float = 1.25   # the native layer's


# ---------------------------------------------------------------- the layers (per rank)

def _route(x, router, topk):
  import jax
  import jax.numpy as jnp
  logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
  top, idx = jax.lax.top_k(logits, topk)
  return idx.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def jax_ep_layer(x, router, w_in, w_out, *, shape: MoEShape, backend=None):
  """jax_ep's MoE layer body (as jax_ep.nn.MoE, with bf16 parameters)."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  idx, w = _route(x, router, shape.topk)
  out = jax_ep.dispatch(x, idx, w, num_experts=shape.experts, layout="expert",
                        expert_alignment=shape.align, backend=backend)
  gemm = jax_ep.grouped_matmul
  h = jax.nn.gelu(gemm(out.recv_x, w_in, out.counts, out_dtype=jnp.float32)).astype(x.dtype)
  y = gemm(h, w_out, out.counts)
  return jax_ep.combine(y, out.handle, out.recv_topk_weights, backend=backend)


def jax_ep_rank_layer(x, router, w_in, w_out, *, shape: MoEShape, backend=None):
  """jax_ep_layer with the combine in rank layout (jax_ep.nn.MoE's
  combine_layout="rank"): one row per (token, rank) each way over the link,
  rows grouped by local expert and summed back on each rank."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  from jax_ep.ops import regroup
  idx, w = _route(x, router, shape.topk)
  out = jax_ep.dispatch(x, idx, w, num_experts=shape.experts, layout="rank", backend=backend)
  g = regroup.group_by_expert(out.recv_topk_idx, num_local_experts=w_in.shape[0],
                              expert_alignment=shape.align)
  gemm = jax_ep.grouped_matmul
  h = jax.nn.gelu(gemm(regroup.expert_rows(out.recv_x, g), w_in, g.counts,
                       out_dtype=jnp.float32)).astype(x.dtype)
  y = gemm(h, w_out, g.counts)
  part = regroup.sum_expert_rows(y, g, out.recv_topk_weights, x.dtype)
  return jax_ep.combine(part, out.handle, None, backend=backend)


def jax_ep_shared_layer(x, router, w_in, w_out, *, shape: MoEShape, s_in, s_out, overlap: bool):
  """jax_ep_layer plus a dense shared expert (gelu(x @ s_in) @ s_out, as
  DeepSeek-V3's): with `overlap`, its forward runs between dispatch_start and
  dispatch_done (the kernels on the communicator's stream meanwhile)."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  from jax_ep.nn.moe import shared_expert
  idx, w = _route(x, router, shape.topk)
  kw = dict(num_experts=shape.experts, layout="expert", expert_alignment=shape.align)
  if overlap:
    p = jax_ep.dispatch_start(x, idx, w, **kw)
    p, x2 = jax_ep.ordered_after(p, x)
    dense = shared_expert(x2, s_in, s_out, dtype=x.dtype)
    out = jax_ep.dispatch_done(p, after=dense)
  else:
    out = jax_ep.dispatch(x, idx, w, **kw)
    dense = shared_expert(x, s_in, s_out, dtype=x.dtype)
  gemm = jax_ep.grouped_matmul
  h = jax.nn.gelu(gemm(out.recv_x, w_in, out.counts, out_dtype=jnp.float32)).astype(x.dtype)
  y = gemm(h, w_out, out.counts)
  routed = jax_ep.combine(y, out.handle, out.recv_topk_weights)
  return (routed.astype(jnp.float32) + dense).astype(x.dtype)


def _gelu(h, dtype):
  import jax
  return jax.nn.gelu(h).astype(dtype)


def native_dense_a2a_layer(x, router, w_in, w_out, *, shape: MoEShape, capacity_factor: float,
                           act=_gelu):
  """A MoE layer in plain JAX: every token sent once to each rank that holds
  one of its experts (dense all_to_all of [R, T, H]), slots per local expert
  up to a capacity (pairs past it are dropped, as such layers do), padded
  batched matmuls, then the weighted rows back the same way. act(h f32,
  dtype): the activation between the matmuls."""
  import jax.numpy as jnp
  from jax import lax
  from jax_ep import reference as ref
  r_count = ref.axis_size("ep")
  t, h = x.shape
  e_l = shape.experts // r_count
  k = shape.topk
  idx, w = _route(x, router, k)
  ranks = jnp.arange(r_count, dtype=jnp.int32)
  dest = idx // e_l                                                  # [T, K]
  goes = (dest[None, :, :] == ranks[:, None, None])                  # [R, T, K]
  send_x = jnp.where(goes.any(-1)[..., None], x[None], jnp.zeros((), x.dtype))
  send_e = jnp.where(goes, idx[None] - ranks[:, None, None] * e_l, -1)
  send_w = jnp.where(goes, w[None], 0.0)
  a2a = functools.partial(lax.all_to_all, axis_name="ep", split_axis=0, concat_axis=0, tiled=True)
  rx, re, rw = a2a(send_x), a2a(send_e), a2a(send_w)                 # [R, T, ...] from each source
  n = r_count * t
  rx, re, rw = rx.reshape(n, h), re.reshape(n * k), rw.reshape(n * k)
  cap = int(np.ceil(capacity_factor * n * k / shape.experts / 8) * 8)
  pair_row = jnp.arange(n * k, dtype=jnp.int32) // k
  got = _capacity_experts(rx, pair_row, jnp.where(re >= 0, re, e_l), re >= 0, w_in, w_out,
                          e_l=e_l, cap=cap, act=act)
  rows = jnp.sum(got.reshape(n, k, h).astype(jnp.float32) * rw.reshape(n, k, 1), axis=1)
  back = a2a(rows.reshape(r_count, t, h))                           # [R(dest ranks), T, H]
  return jnp.sum(back, axis=0).astype(x.dtype)


def _capacity_experts(rows, row_of, local_e, valid, w_in, w_out, *, e_l: int, cap: int,
                      act=_gelu):
  """Pair p (row rows[row_of[p]], local expert local_e[p]) gets a slot of its
  expert up to `cap` (pairs past it dropped), padded batched matmuls, and
  each pair's output back in pair order (zeros when dropped or invalid):
  the expert part both native layers share."""
  import jax.numpy as jnp
  h = rows.shape[1]
  onehot = (local_e[:, None] == jnp.arange(e_l, dtype=jnp.int32)[None, :]).astype(jnp.int32)
  pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, jnp.clip(local_e, 0, e_l - 1)[:, None],
                            1)[:, 0]
  keep = valid & (pos < cap)
  slot = jnp.where(keep, local_e * cap + pos, e_l * cap)
  src = jnp.full((e_l * cap,), -1, jnp.int32).at[slot].set(row_of, mode="drop")
  xin = jnp.where((src >= 0)[:, None], rows[jnp.maximum(src, 0)], jnp.zeros((), rows.dtype))
  hid = jnp.einsum("ech,ehf->ecf", xin.reshape(e_l, cap, h), w_in,
                   preferred_element_type=jnp.float32)
  y = jnp.einsum("ecf,efh->ech", act(hid, rows.dtype), w_out).reshape(e_l * cap, h)
  return jnp.where(keep[:, None], y[jnp.minimum(slot, e_l * cap - 1)], jnp.zeros((), y.dtype))


def native_ragged_a2a_layer(x, router, w_in, w_out, *, shape: MoEShape, capacity_factor: float):
  """The MaxText-style MoE layer in plain JAX: (token, k) pairs sorted by
  expert, each rank's chunk sent with lax.ragged_all_to_all (sizes exchanged
  by all_gather), experts as padded batched matmuls with a capacity, and the
  rows back the same way, then the weighted sum per token."""
  import jax.numpy as jnp
  from jax import lax
  from jax_ep import reference as ref
  r_count = ref.axis_size("ep")
  me = lax.axis_index("ep")
  t, h = x.shape
  k = shape.topk
  e_l = shape.experts // r_count
  idx, w = _route(x, router, k)
  flat_e = idx.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)                           # pairs by expert, so by rank
  sorted_e = flat_e[order]
  rows = x[order // k]                                               # [T*K, H]
  send = jnp.zeros((r_count,), jnp.int32).at[sorted_e // e_l].add(1)
  sizes = lax.all_gather(send, "ep")                                 # [source, destination]
  starts = jnp.cumsum(sizes, axis=1) - sizes                         # chunk starts in each sender
  in_off = starts[me]
  # Where my chunk lands in each destination: after the chunks of lower ranks.
  out_off = jnp.sum(jnp.where(jnp.arange(r_count)[:, None] < me, sizes, 0), axis=0)
  recv = sizes[:, me]
  n = r_count * t * k
  a2a = functools.partial(lax.ragged_all_to_all, axis_name="ep")
  got = a2a(rows, jnp.zeros((n, h), x.dtype), in_off, send, out_off, recv)
  got_e = a2a(sorted_e[:, None], jnp.zeros((n, 1), jnp.int32), in_off, send, out_off, recv)[:, 0]
  valid = jnp.arange(n) < jnp.sum(recv)
  cap = int(np.ceil(capacity_factor * n / shape.experts / 8) * 8)
  y = _capacity_experts(got, jnp.arange(n, dtype=jnp.int32), jnp.where(valid, got_e - me * e_l, e_l),
                        valid, w_in, w_out, e_l=e_l, cap=cap)
  # Back: my received chunk from source s returns to where s sent it from.
  back_in = jnp.cumsum(recv) - recv
  back_out = starts[:, me]
  ret = a2a(y, jnp.zeros((t * k, h), y.dtype), back_in, recv, back_out, send)
  pairs = jnp.zeros_like(ret).at[order].set(ret).reshape(t, k, h)
  out = jnp.sum(pairs.astype(jnp.float32) * w[:, :, None], axis=1)
  return out.astype(x.dtype)


def _expert_counts(x, router, shape: MoEShape) -> np.ndarray:
  idx, _ = _route(x, router, shape.topk)
  return np.bincount(np.asarray(idx).reshape(-1), minlength=shape.experts)


def drops(x, router, *, shape: MoEShape, r_count: int, capacity_factor: float) -> int:
  """(token, expert) pairs the native layer drops at this capacity (global)."""
  counts = _expert_counts(x, router, shape)
  n = r_count * shape.tokens
  cap = int(np.ceil(capacity_factor * n * shape.topk / shape.experts / 8) * 8)
  return int(np.maximum(counts - cap, 0).sum())


def no_drop_factor(x, router, *, shape: MoEShape, r_count: int) -> float:
  """The native layer's smallest capacity factor that drops nothing here."""
  mean = r_count * shape.tokens * shape.topk / shape.experts
  return float(_expert_counts(x, router, shape).max()) / mean


# ---------------------------------------------------------------- steps

def make_step(layer: Callable, mesh) -> Callable:
  """jit(value_and_grad) of sum over ranks of mean(out²); every argument's
  leading axis is split over 'ep' (the router is stacked per rank)."""
  import jax
  import jax.numpy as jnp
  import jax_ep

  def per_rank(x, router, w_in, w_out):
    out = layer(x, router[0], w_in, w_out)
    return jnp.mean(jnp.square(out.astype(jnp.float32)))[None]

  f = jax_ep.shard_map(per_rank, mesh)

  def loss(params, x):
    return jnp.sum(f(x, *params))

  return jax.jit(jax.value_and_grad(loss))


def make_expert_gemm_step(shape: MoEShape, mesh, x, params):
  """The two grouped matmuls alone, forward + backward, on the rows and
  counts one jax_ep dispatch of this routing produces."""
  import jax
  import jax.numpy as jnp
  import jax_ep

  def disp(x, router):
    idx, w = _route(x, router[0], shape.topk)
    out = jax_ep.dispatch(x, idx, w, num_experts=shape.experts, layout="expert",
                          expert_alignment=shape.align)
    return out.recv_x, out.counts

  rows, counts = jax.jit(jax_ep.shard_map(disp, mesh))(x, params[0])

  def per_rank(rows, counts, w_in, w_out):
    h = jax.nn.gelu(jax_ep.grouped_matmul(rows, w_in, counts, out_dtype=jnp.float32))
    y = jax_ep.grouped_matmul(h.astype(rows.dtype), w_out, counts)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))[None]

  f = jax_ep.shard_map(per_rank, mesh)
  step = jax.jit(jax.value_and_grad(lambda w, rows, counts: jnp.sum(f(rows, counts, *w))))
  return step, (params[1:], rows, counts)


def make_inputs(shape: MoEShape, mesh, key):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  r_count = mesh.size
  kx, kr, k1, k2 = jax.random.split(key, 4)
  shard = NamedSharding(mesh, P("ep"))
  put = lambda a: jax.device_put(a, shard)  # noqa: E731
  x = put(jax.random.normal(kx, (r_count * shape.tokens, shape.hidden), jnp.bfloat16))
  router = jax.random.normal(kr, (shape.hidden, shape.experts), jnp.float32) / np.sqrt(shape.hidden)
  router = put(jnp.broadcast_to(router, (r_count, *router.shape)))
  w_in = put((jax.random.normal(k1, (shape.experts, shape.hidden, shape.ffn), jnp.bfloat16)
              / np.sqrt(shape.hidden)).astype(jnp.bfloat16))
  w_out = put((jax.random.normal(k2, (shape.experts, shape.ffn, shape.hidden), jnp.bfloat16)
               / np.sqrt(shape.ffn)).astype(jnp.bfloat16))
  return x, (router, w_in, w_out)


def layers(shape: MoEShape, capacity_factor: float) -> dict:
  return {
      "jax_ep": functools.partial(jax_ep_layer, shape=shape),
      "reference": functools.partial(jax_ep_layer, shape=shape, backend="reference"),
      "jax_ep_rank_combine": functools.partial(jax_ep_rank_layer, shape=shape),
      "jax_native_dense_a2a": functools.partial(native_dense_a2a_layer, shape=shape,
                                                capacity_factor=capacity_factor),
      "jax_native_ragged_a2a": functools.partial(native_ragged_a2a_layer, shape=shape,
                                                 capacity_factor=capacity_factor),
  }


# Variants that may fail or disagree on some platforms without failing the
# run: reported and left out (XLA:CPU has no ragged-all-to-all).
OPTIONAL = ("jax_native_ragged_a2a",)
EXCLUDED: set = set()  # optional variants the agreement check left out


def compare(shape: MoEShape, mesh, x, params, *, tol: float = 3e-2,
            impls: Optional[list[str]] = None) -> dict:
  """Loss and gradients of every variant (or of those in `impls`) at a
  capacity with no drops, against jax_ep's; returns {impl: (rel loss diff,
  max rel grad diff)}."""
  import jax
  if impls is not None and not set(impls) & set(layers(shape, shape.capacity_factor)):
    return {}  # e.g. only the shared-expert pair, which checks itself
  no_drop = no_drop_factor(np.asarray(x), np.asarray(params[0][0]), shape=shape,
                           r_count=mesh.size)
  base_loss, base_grads = make_step(layers(shape, no_drop)["jax_ep"], mesh)(params, x)
  out = {}
  for impl, layer in layers(shape, no_drop).items():
    if impls is not None and impl not in impls:
      continue  # compiling and running a variant not timed costs minutes (ragged: 0.5 s a step)
    try:
      loss, grads = make_step(layer, mesh)(params, x)
    except Exception as e:  # noqa: BLE001 - an optional variant may not run here
      if impl not in OPTIONAL:
        raise
      print(f"  {impl}: left out, it does not run here: {type(e).__name__}: {str(e)[:200]}",
            flush=True)
      EXCLUDED.add(impl)
      continue
    dl = abs(float(loss) - float(base_loss)) / max(abs(float(base_loss)), 1e-30)
    dg = max(float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                   / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)))
    out[impl] = (dl, dg)
    if dl > tol or dg > tol:
      msg = (f"{impl}: loss differs by {dl:.2e}, gradients by {dg:.2e} (tolerance {tol}) "
             "from jax_ep's")
      if impl not in OPTIONAL:
        raise AssertionError(msg)
      print(f"  {msg}; left out", flush=True)
      EXCLUDED.add(impl)
  return out


# ---------------------------------------------------------------- driver

def ensure_communicator(mesh, shape: MoEShape) -> None:
  """A Communicator over `mesh`'s "ep" axis (where jax_ep has its CUDA
  build and none is open), so the layers' dispatch and combine run the
  kernels rather than the reference."""
  import jax_ep
  if not jax_ep.cuda_available():
    return
  from jax_ep import comm as _comm
  from jax_ep._window import normal_bytes as window_bytes_needed
  if _comm.current("ep") is None:
    nbytes = max(1 << 30, window_bytes_needed(
        num_ranks=mesh.size, tokens_per_rank=max(4096, shape.tokens), hidden=shape.hidden,
        topk=shape.topk, num_experts=shape.experts))
    bn.run_records.note_communicator(jax_ep.Communicator.create(mesh, "ep", num_bytes=nbytes))


def run(shape: MoEShape, *, quick: bool, check: bool = True,
        impls: Optional[list[str]] = None) -> list[dict]:
  """Times every layer of `layers` (or only those in `impls`; with
  "jax_ep_shared" in it, also the shared-expert overlap pair)."""
  import jax
  from jax.sharding import Mesh
  import jax_ep
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("ep",))
  r_count = mesh.size
  ensure_communicator(mesh, shape)
  x, params = make_inputs(shape, mesh, jax.random.key(0))
  if check:
    try:
      diffs = compare(shape, mesh, x, params, impls=impls)
      if diffs:
        print("  agreement with jax_ep at no drops (loss, grads): " +
              ", ".join(f"{k} {a:.1e}/{b:.1e}" for k, (a, b) in diffs.items()), flush=True)
    except AssertionError:
      raise
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: say so, time anyway
      print(f"  agreement check FAILED to run: {type(e).__name__}: {str(e)[:300]}", flush=True)
  steps = {impl: make_step(layer, mesh) for impl, layer in
           layers(shape, shape.capacity_factor).items()
           if impl not in EXCLUDED and (impls is None or impl in impls)}
  gemm_step, gemm_args = make_expert_gemm_step(shape, mesh, x, params)
  for impl, s in list(steps.items()):
    try:
      jax.block_until_ready(s(params, x))
    except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
      print(f"  {impl}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      steps[impl] = None
  jax.block_until_ready(gemm_step(*gemm_args))
  dropped = drops(np.asarray(x), np.asarray(params[0][0]), shape=shape, r_count=r_count,
                  capacity_factor=shape.capacity_factor)
  t_gemm = bn.time_or_none("expert_gemms", gemm_step, gemm_args, quick, max_iters=5)
  records = []
  for impl, s in list(steps.items()) + [("expert_gemms", "gemms")]:
    if s == "gemms":
      t = t_gemm
    else:
      t = None if s is None else bn.time_or_none(impl, s, (params, x), quick, max_iters=5)
    records.append(dict(
        bench="moe_step", impl=impl, dtype="bf16", tokens_per_rank=shape.tokens,
        hidden=shape.hidden, ffn=shape.ffn, topk=shape.topk, experts=shape.experts,
        ranks=r_count, time_us=None if t is None else t * 1e6,
        tokens_per_s=None if t is None else r_count * shape.tokens / t,
        ratio_to_expert_gemms=None if (t is None or t_gemm is None) else t / t_gemm,
        dropped_pairs=dropped if impl.startswith("jax_native") else 0,
        capacity_factor=shape.capacity_factor if impl.startswith("jax_native") else None))
    ratio = records[-1]["ratio_to_expert_gemms"]
    timing = "-" if t is None else f"{t * 1e3:9.2f} ms"
    gemms = "" if ratio is None else f"  x{ratio:.2f} of its GEMMs"
    print(f"  T={shape.tokens:5d} {impl:22s} {timing:>12s}{gemms}", flush=True)
  # Profile the layout jax_ep.nn.MoE uses by default at this EP size.
  layer = "jax_ep_rank_combine" if r_count > 1 and steps.get("jax_ep_rank_combine") else "jax_ep"
  if steps.get(layer) is not None:
    _profile_step(steps[layer], (params, x), records, quick, impl=layer)
  # The variants above and the GEMM step's operands held ~7 GiB buffers
  # each; the shared-expert steps ran out of memory behind them on one H200.
  del steps, gemm_step, gemm_args
  gc.collect()
  if impls is None or "jax_ep_shared" in impls:
    records += _overlap_records(shape, mesh, x, params, quick)
  return records


def _overlap_records(shape: MoEShape, mesh, x, params, quick: bool) -> list[dict]:
  """The layer with a shared expert (width F), its forward overlapped with
  the dispatch or not: step times, and how much of the dispatch's time
  (bench_normal-style per-call time measured here) the overlap hid. The two
  must give the same loss and gradients bit for bit."""
  import jax
  import jax.numpy as jnp
  import jax_ep
  k1, k2 = jax.random.split(jax.random.key(7))
  s_in = (jax.random.normal(k1, (shape.hidden, shape.ffn)) / np.sqrt(shape.hidden)).astype(jnp.bfloat16)
  s_out = (jax.random.normal(k2, (shape.ffn, shape.hidden)) / np.sqrt(shape.ffn)).astype(jnp.bfloat16)
  steps = {impl: make_step(functools.partial(jax_ep_shared_layer, shape=shape, s_in=s_in,
                                             s_out=s_out, overlap=ov), mesh)
           for impl, ov in (("jax_ep_shared", False), ("jax_ep_shared_overlap", True))}
  try:
    a = jax.block_until_ready(steps["jax_ep_shared"](params, x))
    b = jax.block_until_ready(steps["jax_ep_shared_overlap"](params, x))
    same = all(np.array_equal(np.asarray(u), np.asarray(v))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    del a, b
  except Exception as e:  # noqa: BLE001 - the overlap must not hide the other records
    print(f"  shared-expert overlap: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return []
  if not same:
    print("  shared-expert overlap: DISAGREES with the fused layer; not timed", flush=True)
    return []

  def disp(x, router):
    idx, w = _route(x, router[0], shape.topk)
    return jax_ep.dispatch(x, idx, w, num_experts=shape.experts, layout="expert",
                           expert_alignment=shape.align).recv_x
  t_disp = bn.time_or_none("dispatch", jax_ep.shard_map(disp, mesh), (x, params[0]), quick)
  out = []
  times = {impl: bn.time_or_none(impl, s, (params, x), quick, max_iters=5)
           for impl, s in steps.items()}
  for impl, t in times.items():
    rec = dict(bench="moe_step", impl=impl, dtype="bf16", tokens_per_rank=shape.tokens,
               hidden=shape.hidden, ffn=shape.ffn, topk=shape.topk, experts=shape.experts,
               ranks=mesh.size, shared_ffn=shape.ffn, time_us=None if t is None else t * 1e6,
               tokens_per_s=None if t is None else mesh.size * shape.tokens / t,
               dispatch_us=None if t_disp is None else t_disp * 1e6)
    out.append(rec)
    print(f"  T={shape.tokens:5d} {impl:22s} {'-' if t is None else f'{t * 1e3:9.2f} ms':>12s}",
          flush=True)
  for rec, s in zip(out, steps.values()):
    rec.update(_concurrency(s, (params, x)))
  t0, t1 = times["jax_ep_shared"], times["jax_ep_shared_overlap"]
  if t0 and t1 and t_disp:
    hidden = (t0 - t1) / t_disp
    out[-1]["dispatch_hidden_share"] = hidden
    print(f"  overlap saved {(t0 - t1) * 1e6:.0f} us per step = {hidden:.0%} of one dispatch "
          f"({t_disp * 1e6:.0f} us)", flush=True)
  return out


def _is_comm(name: str) -> bool:
  return any(k in name for k, fam in STEP_FAMILIES if fam == "dispatch_combine")


def _concurrency(step, args) -> dict:
  """From a profile of 3 steps, per step: the GPU µs of dispatch / combine
  kernels and of those µs during which a compute kernel ran on another
  stream (the overlap the profile shows)."""
  try:
    evs, names = bn.profile_step(step, args, 1)
    comm, both = bn.concurrent_us(bn._gpu_events(evs, names), _is_comm)
  except Exception as e:  # noqa: BLE001 - the profile must not hide the timings
    print(f"  concurrency profile: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return {}
  print(f"  profile: dispatch/combine kernels {comm / 3:.0f} us per step, {both / 3:.0f} us of it "
        f"beside compute on another stream", flush=True)
  return dict(comm_kernel_us=comm / 3, comm_concurrent_us=both / 3)


def _profile_step(step, args, records: list[dict], quick: bool, impl: str = "jax_ep") -> None:
  """A jax_ep step (its records: `impl`) under jax.profiler: GPU time per
  step in dispatch / combine kernels, in the expert GEMMs, and in
  everything else (XLA)."""
  import tempfile
  import jax
  iters, repeats = (1, 1) if quick else (2, 2)
  try:
    tdir = tempfile.mkdtemp(prefix="jax_ep_moe_prof_")
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
      bn._time_step(step, args, iters=iters, repeats=repeats)
    summ = bg.kernel_summary(bn.gpu_kernel_events(tdir), calls=iters * (2 + repeats),
                             families=STEP_FAMILIES)
  except Exception as e:  # noqa: BLE001 - the profile must not hide the timings
    print(f"  profile: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return
  total = summ["all_kernels"]
  comm = summ.get("dispatch_combine", 0.0)
  gemm = summ.get("expert_gemms", 0.0)
  print(f"  profile (GPU µs per step): all kernels {total:.0f}, dispatch/combine {comm:.0f} "
        f"({comm / max(total, 1e-9):.0%}), expert GEMMs {gemm:.0f} "
        f"({gemm / max(total, 1e-9):.0%})", flush=True)
  for r in records:
    if r["impl"] == impl:
      r.update(gpu_kernel_us=total, dispatch_combine_us=comm, expert_gemm_us=gemm,
               dispatch_combine_share=comm / max(total, 1e-9))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
  ap.add_argument("--quick", action="store_true", help="fewer iterations")
  ap.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 4096)")
  ap.add_argument("--sweep", action="store_true", help="tokens 512..4096, writes a PNG")
  ap.add_argument("--impls", default=None,
                  help="comma list of layers to time (jax_ep_shared: the overlap pair); default all")
  ap.add_argument("--activation", choices=("gelu", "swiglu"), default="gelu",
                  help="swiglu: nn.MoE with SwiGLU experts, bf16 against FP8 (moe_swiglu.py)")
  ap.add_argument("--no-ragged-modes", action="store_true",
                  help="skip the ragged layer's symmetric-memory run in its own process")
  args = ap.parse_args(argv)
  impls = args.impls.split(",") if args.impls else None
  gpus = bn.require_two_gpus("bench_moe", need=1)
  if gpus is None:
    return 2
  sizes = [512, 1024, 2048, 4096] if args.sweep else [args.tokens or 4096]
  records = []
  if args.activation == "swiglu":
    import moe_swiglu
    for t in sizes:
      records += moe_swiglu.run(MoEShape(tokens=t), quick=args.quick, impls=impls)
    sizes = []
  for t in sizes:
    records += run(MoEShape(tokens=t), quick=args.quick, check=(t == sizes[0]), impls=impls)
  ragged = "jax_native_ragged_a2a"
  if args.activation == "gelu" and not args.no_ragged_modes and (impls is None or ragged in impls):
    records += symmetric_memory_ragged(args.tokens or 4096, quick=args.quick)
  for r in records:
    if r.get("impl") == "expert_gemms":  # jax_ep's grouped matmuls, named for what they floor
      r["path"] = "cuda"
  bn.run_records.stamp(records, bn._machine(gpus))
  path = bn.write_records(records, args.out, "moe")
  if args.sweep:
    _plot(records, path[:-len(".json")] + ".png")
  return 0


def symmetric_memory_ragged(tokens: int, *, quick: bool, timeout_s: int = 400) -> list[dict]:
  """The MaxText-style layer once more, in a fresh process under XLA's
  symmetric-memory ragged-all-to-all mode (a flag read once per process);
  a refused flag or a failed run gives a record with time_us None and why."""
  impl, mode = "jax_native_ragged_a2a", "symmetric_memory"
  flag = bn.RAGGED_XLA_MODES[mode]
  xla = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  argv = ["--tokens", str(tokens), "--impls", impl, "--no-ragged-modes"] + (
      ["--quick"] if quick else [])
  got, rc, tail = bn.records_from_script(os.path.abspath(__file__), argv, "moe", impl,
                                         {"XLA_FLAGS": xla}, timeout_s)
  for r in got:
    r.update(impl=f"{impl}[{mode}]", xla_flags=flag)
  if not got:
    why = bn.failure_reason(rc, tail)
    got = [dict(bench="moe_step", impl=f"{impl}[{mode}]", tokens_per_rank=tokens, time_us=None,
                xla_flags=flag, failed=why, log_tail=tail)]
  t = got[0].get("time_us")
  print(f"  {impl} [{mode}] {flag}: " + (f"{t:.1f} us" if t else f"- ({got[0]['failed']})"),
        flush=True)
  return got


def _plot(records, path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for impl in sorted({r["impl"] for r in records}):
    pts = [(r["tokens_per_rank"], r["time_us"] / 1e3) for r in records
           if r["impl"] == impl and r["time_us"] is not None]
    if pts:
      ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
  ax.set_xlabel("tokens per rank")
  ax.set_ylabel("forward + backward, ms")
  ax.set_xscale("log", base=2)
  ax.legend()
  ax.grid(alpha=0.3)
  fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
  sys.exit(main())
