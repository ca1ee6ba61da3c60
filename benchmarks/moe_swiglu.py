"""bench_moe's SwiGLU run (`bench_moe.py --activation swiglu`): jax_ep.nn.MoE
itself with SwiGLU experts, bf16 against FP8, training steps and inference
forwards, each next to its floor.

Shape (docs/design.md §6): T = 4096 tokens/rank, H = 7168, w13 [E_l, 7168,
4096], w2 [E_l, 2048, 7168], top-8 of 256, bf16 weights (the FP8 layer's
master copies) over every GPU found. Every variant shares the same bf16
weight arrays; each is built, warmed up, timed and dropped in turn, so
that one variant's FP8 blocks do not sit in memory through another's step
(E_l = 256 on one GPU: 21 GiB of bf16 weights; the FP8 step with the
cast inside holds those, both FP8 orientations and the gradients, ~63 GiB
before its temporaries). Every variant ran on one 80 GB H100 with
XLA_PYTHON_CLIENT_MEM_FRACTION=.95 (docs/fp8_layer.md). Impls (bench = moe_step,
activation = swiglu):

  jax_ep                 nn.MoE(precision="bf16"): forward + backward
  jax_ep_fp8             nn.MoE(precision="fp8"), the weights cast to their
                         FP8 blocks inside the step
  jax_ep_fp8_cached      the same step with the blocks cast once before
                         (layer.fp8_weights(), as once per optimizer update)
  jax_ep_fp8_weight_cast layer.fp8_weights() alone: what the in-step cast costs
  jax_native_dense_a2a   the JAX-native layer (dense all_to_all, capacity-
                         padded einsums) with the same SwiGLU experts
  jax_ep_inference       the bf16 layer's forward alone
  jax_ep_fp8_inference   the forward with held FP8 blocks (to_fp8_inference)

floor_us: the step's expert GEMMs (T*K rows per rank through w13 and w2;
forward only for inference, forward + dgrad + wgrad for the steps) at the
dense bf16 or e4m3 matmul rate measured in the same run (XLA's dot,
cuBLAS(Lt)), and share_of_floor = floor_us / time_us.
bytes_floor_us: what the expert weights alone cost at the HBM rate measured
in the same run (a device copy): each GEMM reads its weights once (bf16, or
e4m3 + block scales), the weight gradients are written once in the param
dtype, and the in-step cast reads the bf16 weights and writes both FP8
copies. At E_l = 256 experts of ~128 rows each the weights outweigh the
rows, so this floor, not the FLOPs', bounds the step. kernel_parts: GPU µs
per step by kernel name (the largest), from a profile of one step.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

import bench_moe as bm
import bench_normal as bn


def gemm_flops(shape: "bm.MoEShape") -> float:
  """Forward FLOPs of one rank's routed expert GEMMs at T*K rows: 2*M*H*2F
  (w13) + 2*M*F*H (w2)."""
  m = shape.tokens * shape.topk
  return 2.0 * m * shape.hidden * 3 * shape.ffn


def dense_rates(shape: "bm.MoEShape", quick: bool) -> dict:
  """FLOP/s of a dense [T*K, H] @ [H, 2F] matmul in bf16 and in e4m3 (bf16
  out), timed here: the rates the floors use."""
  import jax
  import jax.numpy as jnp
  m, k, n = shape.tokens * shape.topk, shape.hidden, 2 * shape.ffn
  ka, kb = jax.random.split(jax.random.key(11))
  a = jax.random.normal(ka, (m, k), jnp.bfloat16)
  b = (jax.random.normal(kb, (k, n), jnp.bfloat16) / np.sqrt(k)).astype(jnp.bfloat16)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
  a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
  rates = {}
  for name, fn, args in (("bf16", dot, (a, b)), ("fp8", dot, (a8, b8))):
    jax.block_until_ready(fn(*args))
    t = bn.time_or_none(f"dense_{name}", fn, args, quick)
    rates[name] = None if t is None else 2.0 * m * k * n / t
  return rates


def hbm_rate(quick: bool) -> Optional[float]:
  """Bytes/s of a device-to-device copy of 2 GiB (read + write counted;
  2 MiB when quick), timed here: the rate the bytes floors use."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(12), (1 << (20 if quick else 30),), jnp.bfloat16)
  copy = jax.jit(lambda a: a + jnp.bfloat16(1))
  jax.block_until_ready(copy(a))
  # At most 5 chained copies: the timing chain returns every call's output,
  # and 50 of 2 GiB (what a ~1 ms call gets) is more than an 80 GB card.
  t = bn.time_or_none("hbm_copy", copy, (a,), quick, max_iters=5)
  return None if t is None else 2.0 * a.nbytes / t


def weight_bytes(shape: "bm.MoEShape", ranks: int, kind: str, precision: str) -> float:
  """HBM bytes of one rank's expert weights for a step / forward / cast
  (bytes_floor_us in the module's docstring)."""
  n = (shape.experts // ranks) * shape.hidden * 3 * shape.ffn
  w16, w8 = 2.0 * n, n * (1.0 + 4.0 / (128 * 128))
  if kind == "cast":
    return w16 + 2 * w8
  if kind == "forward":
    return w16 if precision == "bf16" else w8
  return (3 * w16) if precision == "bf16" else (2 * w8 + w16)


def profile_parts(fn, args) -> Optional[tuple[float, dict]]:
  """(GPU busy µs per call, µs per call of every kernel by name) of a
  profiled call of `fn`; None when the trace cannot be read."""
  try:
    evs, names = bn.profile_step(fn, args, 1)
  except Exception as e:  # noqa: BLE001 - the profile must not hide the timings
    print(f"  profile: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return None
  tr = bn.chain_times(bn._gpu_events(evs, names), None, 3)
  return tr["gpu_us"], tr["kernel_parts"] or {}


def top_parts(parts: dict, top: int = 10) -> dict:
  """The `top` kernels of `parts` by µs, names cut to 100 characters."""
  ranked = sorted(parts.items(), key=lambda kv: -kv[1])[:top]
  return {k[:100]: round(v, 1) for k, v in ranked}


def kernel_parts(fn, args, top: int = 10) -> tuple[Optional[float], Optional[dict]]:
  """(GPU busy µs per call, the `top` kernels by µs per call) of a profiled
  call of `fn`; (None, None) when the trace cannot be read."""
  got = profile_parts(fn, args)
  return (None, None) if got is None else (got[0], top_parts(got[1], top))


def _layer(shape, mesh, precision: str, *, backend=None):
  import jax.numpy as jnp
  from flax import nnx
  from jax_ep.nn import MoE
  return MoE(shape.hidden, shape.ffn, shape.experts, shape.topk, mesh=mesh,
             activation="swiglu", precision=precision, backend=backend,
             dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, expert_alignment=shape.align,
             rngs=nnx.Rngs(0))


def _share_weights(dst, src) -> None:
  """dst's expert weights and router become src's arrays (no copy)."""
  from flax import nnx
  for name in ("router", "w13", "w2"):
    setattr(dst, name, nnx.Param(getattr(src, name)[...]))


def _loss_step(graphdef, *, cached: bool):
  """jit(value_and_grad) of mean(out²) w.r.t. the layer's Params."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  def loss(params, rest, x, q):
    m = nnx.merge(graphdef, params, rest)
    y = m(x, fp8_weights=q) if cached else m(x)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return jax.jit(jax.value_and_grad(loss))


def _forward(graphdef):
  import jax
  from flax import nnx
  return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))


def native_swiglu_layer(x, router, w13, w2, *, shape, capacity_factor: float):
  """bench_moe's JAX-native dense all_to_all layer with SwiGLU experts."""
  from jax_ep.nn.moe import swiglu
  return bm.native_dense_a2a_layer(x, router, w13, w2, shape=shape,
                                   capacity_factor=capacity_factor,
                                   act=lambda h, dtype: swiglu(h.astype(dtype)))


def run(shape: "bm.MoEShape", *, quick: bool, backend: Optional[str] = None,
        impls: Optional[list[str]] = None) -> list[dict]:
  """Times the SwiGLU variants (or those in `impls`); returns their records."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("ep",))
  r_count = mesh.size
  bm.ensure_communicator(mesh, shape)
  want = lambda impl: impls is None or impl in impls  # noqa: E731
  x = jax.device_put(jax.random.normal(jax.random.key(0), (r_count * shape.tokens, shape.hidden),
                                       jnp.bfloat16), NamedSharding(mesh, P("ep")))
  bf16 = _layer(shape, mesh, "bf16", backend=backend)
  fp8 = _layer(shape, mesh, "fp8", backend=backend)
  _share_weights(fp8, bf16)
  g16, p16, rest16 = nnx.split(bf16, nnx.Param, ...)
  g8, p8, rest8 = nnx.split(fp8, nnx.Param, ...)
  cast = jax.jit(lambda state: nnx.merge(nnx.graphdef(fp8), state).fp8_weights())
  state8 = nnx.state(fp8)

  # Built when its turn comes, dropped once timed (module docstring: memory).
  def native_step():
    # The router is the layer's; the native layer routes with plain top-k
    # softmax as nn.MoE's default score_fn does.
    layer = functools.partial(native_swiglu_layer, shape=shape,
                              capacity_factor=shape.capacity_factor)
    router = jax.device_put(jnp.broadcast_to(bf16.router[...], (r_count, *bf16.router.shape)),
                            NamedSharding(mesh, P("ep")))
    params = (router, bf16.w13[...], bf16.w2[...])
    return bm.make_step(layer, mesh), (params, x)

  def fp8_inference():
    held = _layer(shape, mesh, "fp8", backend=backend)
    _share_weights(held, bf16)
    held.to_fp8_inference()
    return _forward(nnx.graphdef(held)), (nnx.state(held), x)

  builders = {  # impl -> (build() -> (fn, args), kind, precision)
      "jax_ep": (lambda: (_loss_step(g16, cached=False), (p16, rest16, x, None)), "step", "bf16"),
      "jax_ep_fp8": (lambda: (_loss_step(g8, cached=False), (p8, rest8, x, None)), "step", "fp8"),
      "jax_ep_fp8_cached": (lambda: (_loss_step(g8, cached=True), (p8, rest8, x, cast(state8))),
                            "step", "fp8"),
      "jax_ep_fp8_weight_cast": (lambda: (cast, (state8,)), "cast", "fp8"),
      "jax_native_dense_a2a": (native_step, "step", "bf16"),
      "jax_ep_inference": (lambda: (_forward(nnx.graphdef(bf16)), (nnx.state(bf16), x)),
                           "forward", "bf16"),
      "jax_ep_fp8_inference": (fp8_inference, "forward", "fp8"),
  }
  rates = dense_rates(shape, quick)
  hbm = hbm_rate(quick)
  fwd = gemm_flops(shape)
  records, times = [], {}
  for impl, (build, kind, precision) in builders.items():
    if not want(impl):
      continue
    t = busy = parts = None
    try:
      fn, args = build()
      jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
      print(f"  {impl}: FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    else:
      t = bn.time_or_none(impl, fn, args, quick, max_iters=5)
      busy, parts = (None, None) if t is None or quick else kernel_parts(fn, args)
    fn = args = None
    times[impl] = t
    wbytes = weight_bytes(shape, r_count, kind, precision)
    flops = {"step": 3 * fwd, "forward": fwd, "cast": 0.0}[kind]
    rate = rates.get(precision)
    floor = None if (rate is None or not flops) else flops / rate
    records.append(dict(
        bench="moe_step", impl=impl, activation="swiglu", dtype=precision, kind=kind,
        tokens_per_rank=shape.tokens, hidden=shape.hidden, ffn=shape.ffn, topk=shape.topk,
        experts=shape.experts, ranks=r_count, time_us=None if t is None else t * 1e6,
        tokens_per_s=None if t is None else r_count * shape.tokens / t,
        gemm_tflops=flops / 1e12, floor_us=None if floor is None else floor * 1e6,
        share_of_floor=None if (floor is None or t is None) else floor / t,
        dense_tflops_per_s=None if rate is None else rate / 1e12,
        weight_gbytes=wbytes / 1e9, hbm_gbps=None if hbm is None else hbm / 1e9,
        bytes_floor_us=None if hbm is None else wbytes / hbm * 1e6,
        gpu_busy_us=busy, kernel_parts=parts,
        dropped_pairs=None, capacity_factor=(shape.capacity_factor
                                             if impl.startswith("jax_native") else None)))
  base = {"step": times.get("jax_ep"), "forward": times.get("jax_ep_inference")}
  native = times.get("jax_native_dense_a2a")
  for r in records:
    t, b = times[r["impl"]], base.get(r["kind"])
    r["speedup_vs_jax_ep_bf16"] = None if (t is None or b is None) else b / t
    if r["kind"] == "step":
      r["speedup_vs_jax_native"] = None if (t is None or native is None) else native / t
    share, up = r["share_of_floor"], r["speedup_vs_jax_ep_bf16"]
    timing = "-" if t is None else f"{t * 1e3:9.2f} ms"
    bfloor = r["bytes_floor_us"]
    print(f"  T={shape.tokens:5d} {r['impl']:24s} {timing:>12s}"
          + ("" if share is None else f"  {share:.2f} of its floor")
          + ("" if bfloor is None or t is None else f", {bfloor / (t * 1e6):.2f} of its bytes floor")
          + ("" if up is None else f"  x{up:.2f} vs bf16"), flush=True)
    for name, us in (r["kernel_parts"] or {}).items():
      print(f"      {us:9.1f} us  {name}", flush=True)
  return records
