"""An expert-parallel MoE feed-forward layer (Flax NNX).

Routing runs on the global, token-sharded activations (`route`); the expert
part runs inside shard_map: dispatch (expert layout) -> two grouped matmuls
on this rank's experts (jax_ep.grouped_matmul: tensor-core grouped kernels on
GPU, `lax.ragged_dot` elsewhere) with GELU or SwiGLU between them (`swiglu`)
-> weighted combine, plus an optional shared expert (`shared_expert`, a dense
MLP every token goes through). `precision="fp8"` runs every expert GEMM
through FP8 casts (`expert_matmul`, the one place that choice is made).

Tokens are split over the EP axis, or over a data axis and the EP axis
together (`data_axis`); experts over the EP axis alone, replicated over the
data axis, so each data-parallel replica is its own EP group.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_ep import fp8 as _fp8
from jax_ep import mesh as _mesh
from jax_ep.ops.dispatch import combine, dispatch, dispatch_fp8_rows
from jax_ep.ops.overlap import dispatch_done, dispatch_start, ordered_after
from jax_ep.ops.grouped_gemm import (Fp8Weights, fp8_expert_matmul,
                                     fp8_weights as _fp8_weights, grouped_matmul,
                                     masked_grouped_matmul)
from jax_ep.ops.low_latency import low_latency_combine, low_latency_dispatch
from jax_ep.ops.mega_moe import mega_moe, swiglu
from jax_ep.ops import regroup as _regroup

SCORE_FNS = ("softmax", "sigmoid")
WEIGHT_NAMES = ("w_in", "w_out", "w13", "w2", "shared_w_in", "shared_w_gate", "shared_w_out",
                "shared_w13", "shared_w2")
ACTIVATIONS = ("gelu", "swiglu")
PRECISIONS = ("bf16", "fp8")


# ------------------------------------------------------------------ routing

def group_limited_mask(scores: jax.Array, *, num_groups: int, topk_groups: int) -> jax.Array:
  """DeepSeek-V3 group-limited routing: which experts each token may pick.

  The E experts are split into `num_groups` contiguous groups; a group's
  score is the sum of its two best expert scores (its one score when a group
  holds a single expert); the `topk_groups` best groups stay open.

  Args:
    scores: [N, E] router scores (after softmax or sigmoid).
  Returns:
    [N, E] bool, True for the experts of the kept groups.
  """
  n, e = scores.shape
  size = e // num_groups
  grouped = scores.reshape(n, num_groups, size)
  if size == 1:
    group_scores = grouped[..., 0]
  else:
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  _, kept = jax.lax.top_k(group_scores, topk_groups)                      # [N, topk_groups]
  open_groups = jnp.any(kept[..., None] == jnp.arange(num_groups), axis=-2)  # [N, num_groups]
  return jnp.repeat(open_groups, size, axis=-1)


def route(logits: jax.Array, *, topk: int, score_fn: str = "softmax",
          num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
          routed_scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Top-k routing of router logits.

  softmax: the k largest logits, weights softmax over those k (= the softmax
  probabilities renormalised over the chosen k). sigmoid (DeepSeek-V3): the k
  largest sigmoid scores, weights those scores renormalised to sum 1. With
  `num_groups`, experts outside the `topk_groups` best groups
  (`group_limited_mask`) are out of reach. The weights are then multiplied
  by `routed_scaling_factor`.

  Args:
    logits: [N, E] float32.
  Returns:
    (topk_idx [N, K] int32, topk_weights [N, K] float32).
  """
  logits = logits.astype(jnp.float32)
  scores = jax.nn.softmax(logits, axis=-1) if score_fn == "softmax" else jax.nn.sigmoid(logits)
  # softmax is monotone: selecting on the logits picks the same experts as on
  # the probabilities without their rounding ties.
  key = logits if score_fn == "softmax" else scores
  if num_groups is not None:
    mask = group_limited_mask(scores, num_groups=num_groups, topk_groups=topk_groups)
    key = jnp.where(mask, key, -jnp.inf)
  _, topk_idx = jax.lax.top_k(key, topk)
  if score_fn == "softmax":
    weights = jax.nn.softmax(jnp.take_along_axis(logits, topk_idx, axis=-1), axis=-1)
  else:
    chosen = jnp.take_along_axis(scores, topk_idx, axis=-1)
    # sigmoid scores are > 0, but all k can underflow for very negative logits.
    weights = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + 1e-20)
  if routed_scaling_factor != 1.0:
    weights = weights * jnp.float32(routed_scaling_factor)
  return topk_idx.astype(jnp.int32), weights


# ------------------------------------------------------------ experts

def fuse_gate_up(gate: jax.Array, up: jax.Array) -> jax.Array:
  """The fused SwiGLU weight from its two halves: gate, up [..., H, F] ->
  w13 [..., H, 2F] (gate first), as MoE(activation="swiglu") stores it.
  Checkpoints in the Linear layout ([F, H] per expert) are transposed first."""
  if gate.shape != up.shape:
    raise ValueError(f"gate and up must have the same shape, got {list(gate.shape)} and "
                     f"{list(up.shape)}")
  return jnp.concatenate([gate, up], axis=-1)


def expert_matmul(x: jax.Array, w, group_sizes: jax.Array, *, precision: str = "bf16",
                  out_dtype=None, backend: Optional[str] = None,
                  x_fp8: Optional[tuple[jax.Array, jax.Array]] = None,
                  w_fp8: Optional[Fp8Weights] = None, masked: bool = False) -> jax.Array:
  """The layer's expert GEMM (x [M, K] groups times w [G, K, N]) at its
  precision; every expert matmul of the layer goes through here.

  "bf16": jax_ep.grouped_matmul (the CUDA kernel for bf16 operands on GPU,
  unless backend is "reference"). "fp8": activations cast to e4m3 per token
  and 128 channels (or x_fp8, rows already in FP8), weights per 128 x 128
  block (or w_fp8, the blocks cached since the last optimizer update), f32
  accumulation; the backward casts dy the same way (dgrad) and x, dy per 128
  tokens of each group (wgrad): jax_ep.grouped_matmul_fp8's training form,
  on the FP8 kernels on GPU and the same casts in pure JAX elsewhere. w may
  also be held FP8 blocks (wq [G, N, K], ws), as `MoE.to_fp8_inference`
  keeps them: the forward product alone, not differentiable in w. masked:
  x is the decode grid [G, S, K] with group_sizes rows valid per group
  (masked_grouped_matmul[_fp8]; forward only). Its products come out in
  bf16.
  """
  be = "reference" if backend == "reference" else None
  if precision == "fp8":
    out = fp8_expert_matmul(x, w, group_sizes, x_fp8=x_fp8, w_fp8=w_fp8, masked=masked,
                            backend=be)
    return out.astype(out_dtype or x.dtype)
  matmul = masked_grouped_matmul if masked else grouped_matmul
  return matmul(x, w, group_sizes, out_dtype=out_dtype, backend=be)


def _dense(x, w, *, precision: str, out_dtype, w_fp8=None):
  """x [T, K] @ w [K, N] with f32 accumulation: XLA's dot in bf16, the FP8
  expert GEMM (one group of every row) in fp8 (w, or its held blocks, and
  w_fp8 with one group axis)."""
  if precision == "fp8":
    sizes = jnp.full((1,), x.shape[0], jnp.int32)
    w = w if isinstance(w, tuple) else w[None]
    return expert_matmul(x, w, sizes, precision=precision, out_dtype=out_dtype, w_fp8=w_fp8)
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def shared_expert(x: jax.Array, w_in: jax.Array, w_out: jax.Array,
                  w_gate: Optional[jax.Array] = None, *, activation: str = "gelu",
                  dtype=jnp.bfloat16, out_dtype=jnp.float32, precision: str = "bf16",
                  w_fp8: Optional[tuple] = None) -> jax.Array:
  """The shared expert: a dense MLP every token goes through.

  gelu, plain: gelu(x @ w_in) @ w_out; gated: (gelu(x @ w_gate) * (x @ w_in))
  @ w_out, the hidden activations rounded to `dtype` before the second
  matmul, as the routed experts' are. swiglu: w_in is the fused gate/up
  weight [H, 2Fs] and the result swiglu(x @ w_in) @ w_out, the first product
  in `dtype` (as the routed SwiGLU experts compute it). f32 accumulation.
  Depends on nothing the dispatch produces, so it can run while a dispatch
  is in flight.

  Args:
    x: [T, H] in dtype; w_in, w_gate: [H, Fs] (swiglu: w_in [H, 2Fs], no
      w_gate); w_out: [Fs, H] (in dtype).
    precision: "bf16" or "fp8" (`expert_matmul`; with fp8 each weight may be
      held FP8 blocks).
    w_fp8: fp8 only: (w_in, w_out, w_gate)'s cached Fp8Weights (one group
      axis), entries None where the step casts the weight itself.
  Returns:
    [T, H] in out_dtype (f32 by default, so that adding it to the routed
    output rounds once).
  """
  w_fp8 = tuple(w_fp8 or ()) + (None,) * 3
  dense = functools.partial(_dense, precision=precision)
  if activation == "swiglu":
    if w_gate is not None:
      raise ValueError("a SwiGLU shared expert takes its gate in w_in ([H, 2Fs], gate then up); "
                       "w_gate must be None")
    h = swiglu(dense(x, w_in, out_dtype=dtype, w_fp8=w_fp8[0]), dtype)
  else:
    h = dense(x, w_in, out_dtype=jnp.float32, w_fp8=w_fp8[0])
    if w_gate is None:
      h = jax.nn.gelu(h)
    else:
      h = jax.nn.gelu(dense(x, w_gate, out_dtype=jnp.float32, w_fp8=w_fp8[2])) * h
    h = h.astype(dtype)
  return dense(h, w_out, out_dtype=out_dtype, w_fp8=w_fp8[1])


# ------------------------------------------------------------ the layer

class _Cfg(NamedTuple):
  num_experts: int
  axis_name: str
  expert_alignment: int
  backend: Optional[str]
  dtype: object
  fp8: bool
  overlap: bool = False
  combine_layout: str = "expert"
  activation: str = "gelu"
  precision: str = "bf16"
  fused: bool = False


def _check_int(name: str, value, *, low: int = 1) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_config(*, hidden, ffn, num_experts, topk, mesh, axis_name, data_axis, score_fn,
                  routed_scaling_factor, num_groups, topk_groups, shared_ffn,
                  fp8_dispatch, activation="gelu", precision="bf16",
                  param_dtype=jnp.float32) -> None:
  """ValueErrors naming the argument, before any array is made (an expert
  count the EP axis does not divide would otherwise surface as JAX's
  sharding error from the weights' device_put)."""
  for name, value in (("hidden", hidden), ("ffn", ffn), ("num_experts", num_experts),
                      ("topk", topk)):
    _check_int(name, value)
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
  if data_axis is not None:
    if data_axis not in mesh.axis_names:
      raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}")
    if data_axis == axis_name:
      raise ValueError(f"data_axis must differ from axis_name ({axis_name!r})")
  ranks = mesh.shape[axis_name]
  if num_experts % ranks:
    raise ValueError(f"num_experts={num_experts} must be divisible by the size of the EP axis "
                     f"{axis_name!r} ({ranks} ranks)")
  if topk > num_experts:
    raise ValueError(f"topk={topk} must be <= num_experts={num_experts}")
  if score_fn not in SCORE_FNS:
    raise ValueError(f"score_fn must be one of {SCORE_FNS}, got {score_fn!r}")
  if not isinstance(routed_scaling_factor, (int, float)) or not routed_scaling_factor > 0:
    raise ValueError(f"routed_scaling_factor must be a float > 0, got {routed_scaling_factor!r}")
  if (num_groups is None) != (topk_groups is None):
    raise ValueError("num_groups and topk_groups go together: give both or neither "
                     f"(got num_groups={num_groups!r}, topk_groups={topk_groups!r})")
  if num_groups is not None:
    _check_int("num_groups", num_groups)
    _check_int("topk_groups", topk_groups)
    if num_experts % num_groups:
      raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
    if topk_groups > num_groups:
      raise ValueError(f"topk_groups={topk_groups} must be <= num_groups={num_groups}")
    reachable = topk_groups * (num_experts // num_groups)
    if topk > reachable:
      raise ValueError(f"topk={topk} must be <= the experts in the kept groups "
                       f"(topk_groups * num_experts / num_groups = {reachable})")
  if shared_ffn is not None:
    _check_int("shared_ffn", shared_ffn)
  if fp8_dispatch and hidden % _fp8.BLOCK:
    raise ValueError(f"fp8_dispatch needs hidden to be a multiple of {_fp8.BLOCK}, got {hidden}")
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
  if precision == "fp8":
    # The FP8 tiles are 128 channels wide and the weight blocks 128 x 128.
    for name, value in (("hidden", hidden), ("ffn", ffn), ("shared_ffn", shared_ffn)):
      if value is not None and value % _fp8.BLOCK:
        raise ValueError(f"precision='fp8' needs {name} to be a multiple of {_fp8.BLOCK}, "
                         f"got {value}")
    if jnp.dtype(param_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError("precision='fp8' casts float32 or bfloat16 master weights to FP8; "
                       f"param_dtype is {jnp.dtype(param_dtype)}")


class MoE(nnx.Module):
  """y = sum_k w_k * Expert_{e_k}(x) [+ SharedExpert(x)], top-k routing.

  Experts: activation="gelu": gelu(x @ w_in[e]) @ w_out[e], w_in [E, H, F],
  w_out [E, F, H]. activation="swiglu" (DeepSeek-V3/V4, Qwen3-MoE, Mixtral):
  (silu(x @ gate_e) * (x @ up_e)) @ down_e, stored as w13 [E, H, 2F], gate in
  w13[e, :, :F] and up in w13[e, :, F:], and w2 [E, F, H] (down): one grouped
  GEMM for w13 (out in `dtype`), then `swiglu` in one fused elementwise pass,
  then one for w2.

  Loading a checkpoint (Hugging Face layout: a Linear's weight is [out, in],
  so each is transposed; `fuse_gate_up` builds w13):
    DeepSeek-V3/V4, Qwen3-MoE: mlp.experts.{e}.gate_proj.weight [F, H] ->
      w13[e, :, :F] (transposed), up_proj.weight [F, H] -> w13[e, :, F:],
      down_proj.weight [H, F] -> w2[e] ([F, H]); mlp.gate.weight [E, H] ->
      router [H, E] (DeepSeek-V3: score_fn="sigmoid", num_groups,
      topk_groups, routed_scaling_factor; its e_score_correction_bias has no
      counterpart here). DeepSeek's shared expert
      (mlp.shared_experts.gate_proj / up_proj / down_proj) -> shared_w13
      [H, 2Fs] / shared_w2 [Fs, H] the same way, shared_ffn = Fs. DeepSeek's
      FP8 checkpoints store e4m3 weights with a scale per 128 x 128 block
      (weight_scale_inv); dequantise them to load master weights.
    Mixtral: block_sparse_moe.experts.{e}.w1.weight (gate) -> w13[e, :, :F],
      w3.weight (up) -> w13[e, :, F:], w2.weight (down) -> w2[e], each
      transposed; block_sparse_moe.gate.weight -> router (softmax top-2).

  Args:
    hidden: model width H; ffn: expert width F; num_experts: E (divisible by
      the EP axis size); topk: K.
    activation: "gelu" (default) or "swiglu" (above). With "swiglu" the
      shared expert, if any, is SwiGLU too (shared_gated changes nothing).
    precision: "bf16" (default) or "fp8": every expert GEMM (routed and
      shared) runs through FP8 casts, DeepSeek-V3's recipe: activations
      e4m3 per token and 128 channels, weights per 128 x 128 block cast from
      the master copy inside the step, f32 accumulation, the backward's
      dgrad and wgrad through FP8 too (`expert_matmul`); the rows travel as
      FP8 (fp8_dispatch) and go into the first GEMM as they arrived. hidden,
      ffn and shared_ffn must be multiples of 128 and param_dtype float32 or
      bfloat16. On GPU the FP8 grouped GEMM kernels (grouped_matmul_fp8),
      elsewhere the same casts in pure JAX.
    fused: the routed experts run as one `jax_ep.mega_moe` op (the same
      outputs and gradients as the unfused FP8 path); needs
      activation="swiglu", precision="fp8" and the "expert" combine layout.
      Until the fused kernels land, mega_moe runs that unfused path.
    mesh, axis_name: experts are split over `axis_name`; tokens too.
    data_axis: a second mesh axis for data parallelism: tokens are split over
      (data_axis, axis_name) together, experts over `axis_name` and
      replicated over `data_axis`; every dispatch stays inside its replica's
      EP group. None: tokens over `axis_name` only.
    expert_alignment: group padding for the grouped matmul.
    backend: None (auto), "reference" or "cuda"; see jax_ep.dispatch. The
      expert matmuls (jax_ep.grouped_matmul) run their GPU kernel unless it
      is "reference".
    dtype: compute dtype of the tokens and expert matmuls.
    param_dtype: storage dtype of the expert weights (default float32). With
      param_dtype == dtype the step skips casting them: at H = 7168, F = 2048
      and 128 experts a rank each f32 -> bf16 cast reads 7.5 GB and writes
      3.8 GB per weight and step.
    score_fn: "softmax" (softmax over the top-k logits) or "sigmoid"
      (DeepSeek-V3: top-k of sigmoid scores, renormalised over the k); see
      `route`. routed_scaling_factor multiplies the routing weights.
    num_groups, topk_groups: group-limited routing (`group_limited_mask`):
      only the experts of each token's `topk_groups` best groups (of
      `num_groups`) can be chosen.
    shared_ffn: width of a shared expert (`shared_expert`) added to every
      token's routed output; None: none. shared_gated: make it a gated MLP.
    overlap_shared: compute the shared expert's forward between
      `dispatch_start` and `dispatch_done`, so that on CUDA it runs while the
      dispatch kernels move rows on the communicator's stream (identical
      results; bf16 dispatch only). Off by default until measured on GPUs.
    combine_layout: "expert": the rows travel per (token, expert) and the
      combine sums all of a token's expert outputs in f32 in one fixed
      order. "rank": the dispatch moves one row per (token, rank), the rows
      are grouped by local expert on each rank (`jax_ep.ops.regroup`), each
      token's local expert outputs are summed there (f32, then `dtype`) and
      the combine adds one row per rank: at EP >= 2 the combine's link
      bytes shrink K / R-fold (DeepEP's scheme), for one more rounding of
      the partial sums and two local gathers. None (default): "rank" when
      `axis_name` has more than one rank (at the design shape, EP2, its
      combine sends ~4 100 rows instead of ~16 400), else "expert" (one
      rank: the two are level, benchmarks/RESULTS.md, 2026-12-02, and
      "expert" rounds once).
    fp8_dispatch: the rows travel as FP8 (e4m3, a scale per 128 channels) and
      are dequantised to `dtype` before the expert matmuls; H must be a
      multiple of 128. The backward is a straight-through estimator: the
      rows' cotangents go back by the bf16 combine, the exact transpose of a
      bf16 dispatch (the quantisation counts as the identity).

  Every parameter is placed on the mesh at construction (experts split over
  `axis_name`, the router and the shared expert replicated), so a jitted
  step compiled for the first call is reused on the next ones.
  """

  def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, *, mesh: Mesh,
               axis_name: str = "ep", expert_alignment: int = 8,
               backend: Optional[str] = None, dtype=jnp.bfloat16, param_dtype=jnp.float32,
               data_axis: Optional[str] = None, score_fn: str = "softmax",
               routed_scaling_factor: float = 1.0, num_groups: Optional[int] = None,
               topk_groups: Optional[int] = None, shared_ffn: Optional[int] = None,
               shared_gated: bool = False, fp8_dispatch: bool = False,
               overlap_shared: bool = False, combine_layout: Optional[str] = None,
               activation: str = "gelu", precision: str = "bf16", fused: bool = False,
               rngs: nnx.Rngs):
    _check_config(hidden=hidden, ffn=ffn, num_experts=num_experts, topk=topk, mesh=mesh,
                  axis_name=axis_name, data_axis=data_axis, score_fn=score_fn,
                  routed_scaling_factor=routed_scaling_factor, num_groups=num_groups,
                  topk_groups=topk_groups, shared_ffn=shared_ffn, fp8_dispatch=fp8_dispatch,
                  activation=activation, precision=precision, param_dtype=param_dtype)
    self.hidden, self.ffn, self.shared_ffn = hidden, ffn, shared_ffn
    self.activation, self.precision = activation, precision
    # FP8 experts take their rows as the FP8 dispatch delivers them.
    fp8_dispatch = bool(fp8_dispatch) or precision == "fp8"
    self.num_experts, self.topk = num_experts, topk
    self.mesh, self.axis_name, self.data_axis = mesh, axis_name, data_axis
    self.expert_alignment, self.backend, self.dtype = expert_alignment, backend, dtype
    self.score_fn, self.routed_scaling_factor = score_fn, float(routed_scaling_factor)
    self.num_groups, self.topk_groups = num_groups, topk_groups
    self.fp8_dispatch = bool(fp8_dispatch)
    if overlap_shared and (shared_ffn is None or fp8_dispatch):
      raise ValueError("overlap_shared needs a shared expert (shared_ffn) and a bf16 dispatch "
                       "(fp8_dispatch=False, precision='bf16')")
    self.overlap_shared = bool(overlap_shared)
    layout_given = combine_layout is not None
    if combine_layout is None:
      combine_layout = "rank" if mesh.shape[axis_name] > 1 else "expert"
    if combine_layout not in ("expert", "rank"):
      raise ValueError(f"combine_layout must be 'expert' or 'rank', got {combine_layout!r}")
    if fused:
      if activation != "swiglu" or precision != "fp8":
        raise ValueError("fused=True runs SwiGLU experts in FP8 (jax_ep.mega_moe): it needs "
                         "activation='swiglu' and precision='fp8'")
      if layout_given and combine_layout == "rank":
        raise ValueError("fused=True sends one row per (token, expert): combine_layout must "
                         "be 'expert' (or None)")
      combine_layout = "expert"
    self.fused = bool(fused)
    self.combine_layout = combine_layout
    init = jax.nn.initializers.lecun_normal()
    expert_init = jax.nn.initializers.lecun_normal(in_axis=1, out_axis=2)
    split = NamedSharding(mesh, P(axis_name))
    replicated = NamedSharding(mesh, P())

    def param(key, shape, sharding, initializer=init, dtype=jnp.float32):
      # Drawn and cast in one program that gives each device only its shard:
      # an eager draw would first hold the whole array in f32 on one device
      # (28 GiB for w13 at 256 experts x 7168 x 4096).
      draw = jax.jit(lambda k: initializer(k, shape, jnp.float32).astype(dtype),
                     out_shardings=sharding)
      return nnx.Param(draw(key))

    # Drawn in this order so that a layer without the new parts gets the
    # same weights from the same seed as before.
    self.router = param(rngs.params(), (hidden, num_experts), replicated)
    w = {}
    if activation == "swiglu":
      w["w13"] = param(rngs.params(), (num_experts, hidden, 2 * ffn), split, expert_init,
                       param_dtype)
      w["w2"] = param(rngs.params(), (num_experts, ffn, hidden), split, expert_init, param_dtype)
    else:
      w["w_in"] = param(rngs.params(), (num_experts, hidden, ffn), split, expert_init,
                        param_dtype)
      w["w_out"] = param(rngs.params(), (num_experts, ffn, hidden), split, expert_init,
                         param_dtype)
    if shared_ffn is not None:
      if activation == "swiglu":
        w["shared_w13"] = param(rngs.params(), (hidden, 2 * shared_ffn), replicated, init,
                                param_dtype)
        w["shared_w2"] = param(rngs.params(), (shared_ffn, hidden), replicated, init,
                               param_dtype)
      else:
        w["shared_w_in"] = param(rngs.params(), (hidden, shared_ffn), replicated, init,
                                 param_dtype)
        if shared_gated:
          w["shared_w_gate"] = param(rngs.params(), (hidden, shared_ffn), replicated, init,
                                     param_dtype)
        w["shared_w_out"] = param(rngs.params(), (shared_ffn, hidden), replicated, init,
                                  param_dtype)
    # Absent parts are None, data either way (nnx would take a None for static).
    for name in WEIGHT_NAMES:
      setattr(self, name, nnx.data(w.get(name)))
    self.fp8_blocks = nnx.data(None)  # to_fp8_inference's held blocks

  def _weight_names(self) -> tuple[list, list]:
    """(routed, shared): (name, shape) of each expert weight in the order
    the per-rank body takes them."""
    e, h, f, fs = self.num_experts, self.hidden, self.ffn, self.shared_ffn
    if self.activation == "swiglu":
      routed = [("w13", (e, h, 2 * f)), ("w2", (e, f, h))]
      shared = [("shared_w13", (h, 2 * fs)), ("shared_w2", (fs, h))] if fs else []
    else:
      routed = [("w_in", (e, h, f)), ("w_out", (e, f, h))]
      shared = []
      if fs:
        shared = [("shared_w_in", (h, fs)), ("shared_w_out", (fs, h))]
        if self.shared_w_gate is not None or "shared_w_gate" in (self.fp8_blocks or {}):
          shared.append(("shared_w_gate", (h, fs)))
    return routed, shared

  def _expert_weights(self) -> tuple[list, list]:
    """(routed, shared) weights in the order _moe_shard takes them, each
    checked against the layer's shapes (a checkpoint loaded into the layer
    is checked here, before shard_map turns a wrong shape into its own
    error). A weight the layer holds as FP8 blocks (`to_fp8_inference`)
    comes as its (wq, ws) pair."""
    got = []
    for names in self._weight_names():
      arrays = []
      for name, want in names:
        if self.fp8_blocks is not None and name in self.fp8_blocks:
          arrays.append(tuple(v[...] for v in self.fp8_blocks[name]))
          continue
        a = getattr(self, name)[...]
        if tuple(a.shape) != want:
          what = {"w13": f"[E, H, 2F] = {list(want)} (gate then up: the last axis is 2F)",
                  "shared_w13": f"[H, 2Fs] = {list(want)} (gate then up)"}.get(name, list(want))
          raise ValueError(f"{name} must be {what}, got shape {list(a.shape)}")
        if self.precision == "fp8" and a.dtype not in (jnp.dtype(jnp.float32),
                                                       jnp.dtype(jnp.bfloat16)):
          raise ValueError(f"{name}: precision='fp8' casts float32 or bfloat16 master weights to "
                           f"FP8, got {a.dtype}")
        arrays.append(a)
      got.append(arrays)
    return got[0], got[1]

  def _shard_map(self, body, in_specs, out_specs):
    return _mesh.shard_map(body, self.mesh, axis_name=self.axis_name, in_specs=in_specs,
                           out_specs=out_specs)

  def fp8_weights(self) -> dict:
    """The expert weights' FP8 blocks in both orientations (jax_ep.Fp8Weights
    per weight, keyed by name; the shared expert's with one group axis),
    cast from the master weights on each rank: make them once per optimizer
    update and pass them as `layer(x, fp8_weights=...)`, so the steps
    between updates skip the weights' cast. precision='fp8' only. The
    master weights still get their gradients (the FP8 weight gradient does
    not read the blocks)."""
    if self.precision != "fp8":
      raise ValueError("fp8_weights() needs precision='fp8'")
    if self.fp8_blocks is not None:
      raise ValueError("this layer holds FP8 inference blocks (to_fp8_inference): it has no "
                       "master weights to cast")
    (routed_names, shared_names), (routed, shared) = self._weight_names(), self._expert_weights()

    def body(routed, shared):
      return ([_fp8_weights(w) for w in routed], [_fp8_weights(w[None]) for w in shared])

    split = P(self.axis_name)
    f = self._shard_map(body, (split, P()), (split, P()))
    r, sh = f(routed, shared)
    return {n: q for (n, _), q in zip(routed_names + shared_names, r + sh)}

  def to_fp8_inference(self) -> None:
    """Replace the expert weights by their FP8 forward blocks (e4m3 per
    128 x 128 block, f32 scales), held by the layer for prefill and decode:
    no cast in the step and a quarter of f32 master weights' memory. The
    layer is then forward-only in its expert weights (they are no longer
    nnx.Params: nnx.grad and optimizers leave them out); the router stays a
    Param. precision='fp8' only."""
    cached = self.fp8_weights()
    self.fp8_blocks = nnx.data({n: (Fp8Block(w.q), Fp8Block(w.s)) for n, w in cached.items()})
    for name in cached:
      setattr(self, name, nnx.data(None))

  def _route(self, x: jax.Array):
    """x [..., H] -> (x2 [N, H] in dtype, topk_idx, topk_weights, token spec),
    with the input checks of both forward forms."""
    shape = x.shape
    hidden = self.router.shape[0]
    if x.ndim < 1 or shape[-1] != hidden:
      raise ValueError(f"x must be [..., hidden={hidden}] (the layer's width), got shape "
                       f"{list(shape)}")
    x2 = x.reshape(-1, shape[-1])
    axes = (self.axis_name,) if self.data_axis is None else (self.data_axis, self.axis_name)
    parts = 1
    for a in axes:
      parts *= self.mesh.shape[a]
    if x2.shape[0] % parts:
      raise ValueError(f"x has {x2.shape[0]} tokens; they must split evenly over the mesh axes "
                       f"{axes} ({parts} parts)")
    topk_idx, topk_weights = route(
        x2.astype(jnp.float32) @ self.router[...], topk=self.topk, score_fn=self.score_fn,
        num_groups=self.num_groups, topk_groups=self.topk_groups,
        routed_scaling_factor=self.routed_scaling_factor)
    return x2.astype(self.dtype), topk_idx, topk_weights, P(axes if len(axes) > 1 else axes[0])

  def _cfg(self) -> _Cfg:
    return _Cfg(self.num_experts, self.axis_name, self.expert_alignment, self.backend,
                self.dtype, self.fp8_dispatch, self.overlap_shared, self.combine_layout,
                self.activation, self.precision, self.fused)

  def _weights_for_step(self, fp8_weights):
    routed, shared = self._expert_weights()
    if self.precision == "fp8":
      # FP8 casts the master weights to its blocks itself (or takes the
      # cached ones); held blocks go in as they are.
      names = [n for n, _ in sum(self._weight_names(), [])]
      if fp8_weights is not None and self.fp8_blocks is not None:
        raise ValueError("fp8_weights: this layer already holds FP8 blocks (to_fp8_inference)")
      if fp8_weights is not None and set(fp8_weights) != set(names):
        raise ValueError(f"fp8_weights must hold {sorted(names)} (layer.fp8_weights()), got "
                         f"{sorted(fp8_weights)}")
      cached = None if fp8_weights is None else [fp8_weights[n] for n in names]
      return routed, shared, cached
    if fp8_weights is not None:
      raise ValueError("fp8_weights goes with precision='fp8'")
    # bf16 casts the master weights to the compute dtype (a no-op when they
    # are stored in it).
    cast = lambda w: w.astype(self.dtype)  # noqa: E731
    return list(map(cast, routed)), list(map(cast, shared)), None

  def __call__(self, x: jax.Array, *, fp8_weights: Optional[dict] = None) -> jax.Array:
    """x: [..., H] tokens; the flattened token axis N is split over the EP
    axis (and `data_axis`), so N must be a multiple of their sizes. Returns
    x's shape in x's dtype. fp8_weights: `fp8_weights()`'s cached blocks
    (precision='fp8')."""
    x2, topk_idx, topk_weights, tokens = self._route(x)
    routed, shared, cached = self._weights_for_step(fp8_weights)
    split = P(self.axis_name)
    cached_specs = P() if cached is None else [split] * len(routed) + [P()] * len(shared)
    f = self._shard_map(functools.partial(_moe_shard, cfg=self._cfg()),
                        (tokens, tokens, tokens, split, P(), cached_specs), tokens)
    return f(x2, topk_idx, topk_weights, routed, shared, cached).astype(x.dtype).reshape(x.shape)

  def decode(self, x: jax.Array) -> jax.Array:
    """The layer for decode steps (a few tokens per rank): low-latency
    dispatch (FP8 rows with precision='fp8') -> masked grouped GEMMs on the
    fixed [E_l, R * T, H] grid (FP8 with precision='fp8', from the held
    blocks or cast in the step) -> low-latency combine, plus the shared
    expert. Forward only; the same outputs as `__call__` up to the order of
    the top-k sum (the low-latency combine's). x: [..., H] as `__call__`;
    T = tokens per rank is the low-latency ops' max_tokens."""
    if self.data_axis is not None:
      raise ValueError("decode runs over the EP axis alone; this layer has a data_axis")
    x2, topk_idx, topk_weights, tokens = self._route(x)
    routed, shared, _ = self._weights_for_step(None)
    f = self._shard_map(functools.partial(_decode_shard, cfg=self._cfg()),
                        (tokens, tokens, tokens, P(self.axis_name), P()), tokens)
    return f(x2, topk_idx, topk_weights, routed, shared).astype(x.dtype).reshape(x.shape)


class Fp8Block(nnx.Variable):
  """FP8 weight blocks (e4m3 values or their f32 scales) an inference layer
  holds: a Variable, not a Param, so gradients and optimizers skip it."""


def _moe_shard(x, topk_idx, topk_weights, routed, shared, cached, *, cfg: _Cfg):
  """Per rank: x [T, H], topk_* [T, K]; routed = (w_in [E_l, H, F] (swiglu:
  w13 [E_l, H, 2F]), w_out [E_l, F, H]), shared = () or (w_in [H, Fs]
  (swiglu: [H, 2Fs]), w_out [Fs, H][, w_gate [H, Fs]]); FP8 held weights as
  (wq, ws) pairs; cached: None or the Fp8Weights of routed + shared. -> [T, H]."""
  w_in, w_out = routed
  c_routed, c_shared = (None, None), None
  if cached is not None:
    c_routed, c_shared = tuple(cached[:2]), tuple(cached[2:])
  by_rank = cfg.combine_layout == "rank"
  kw = dict(num_experts=cfg.num_experts, axis_name=cfg.axis_name,
            layout="rank" if by_rank else "expert", backend=cfg.backend)
  if not by_rank:
    kw["expert_alignment"] = cfg.expert_alignment
  dense = None
  rows_fp8 = None
  if cfg.fused:
    routed = mega_moe(x, topk_idx, topk_weights, w_in, w_out, num_experts=cfg.num_experts,
                      axis_name=cfg.axis_name, expert_alignment=cfg.expert_alignment,
                      w_fp8=None if c_routed[0] is None else c_routed, dtype=cfg.dtype,
                      backend=cfg.backend)
  elif cfg.fp8:
    out, rows_fp8 = _fp8_dispatch(x, topk_idx, topk_weights, cfg)
    if cfg.precision != "fp8":
      rows_fp8 = None  # the experts take the dequantised rows
  elif cfg.overlap and shared:
    # The shared expert between start and done: on CUDA it computes while
    # the rows move (jax_ep.ops.overlap).
    pending = dispatch_start(x, topk_idx, topk_weights, **kw)
    pending, (x_s, shared) = ordered_after(pending, (x, tuple(shared)))
    dense = _shared(x_s, shared, cfg)
    out = dispatch_done(pending, after=dense)
  else:
    out = dispatch(x, topk_idx, topk_weights, **kw)
  if cfg.fused:
    pass  # mega_moe above did the dispatch, the experts and the combine
  elif by_rank:
    g = _regroup.group_by_expert(out.recv_topk_idx, num_local_experts=_local_experts(w_in),
                                 expert_alignment=cfg.expert_alignment)
    if rows_fp8 is not None:
      rows_fp8 = tuple(_regroup._gather_rows(a, g.source) for a in rows_fp8)
    y = _experts(_regroup.expert_rows(out.recv_x, g), w_in, w_out, g.counts, cfg, rows_fp8,
                 c_routed)
    part = _regroup.sum_expert_rows(y, g, out.recv_topk_weights, cfg.dtype)
    routed = combine(part, out.handle, None, axis_name=cfg.axis_name, backend=cfg.backend)
  else:
    y = _experts(out.recv_x, w_in, w_out, out.counts, cfg, rows_fp8, c_routed)
    routed = combine(y, out.handle, out.recv_topk_weights, axis_name=cfg.axis_name,
                     backend=cfg.backend)
  if not shared:
    return routed
  if dense is None:
    dense = _shared(x, shared, cfg, c_shared)
  return (routed.astype(jnp.float32) + dense).astype(cfg.dtype)


def _local_experts(w) -> int:
  return (w[0] if isinstance(w, tuple) else w).shape[0]


def _shared(x, shared, cfg: _Cfg, cached=None):
  s_in, s_out, *s_gate = shared
  return shared_expert(x, s_in, s_out, *s_gate, activation=cfg.activation, dtype=cfg.dtype,
                       precision=cfg.precision, w_fp8=cached)


def _activate(rows, cfg: _Cfg, gemm, w_in, counts, rows_fp8, w_fp8=None):
  """The first GEMM and the activation, in the compute dtype."""
  if cfg.activation == "swiglu":
    # The first GEMM writes its [M, 2F] in the compute dtype and swiglu
    # reads it once: no f32 pass over HBM between the two GEMMs.
    return swiglu(gemm(rows, w_in, counts, out_dtype=cfg.dtype, x_fp8=rows_fp8, w_fp8=w_fp8),
                  cfg.dtype)
  h = gemm(rows, w_in, counts, out_dtype=jnp.float32, x_fp8=rows_fp8, w_fp8=w_fp8)
  return jax.nn.gelu(h).astype(cfg.dtype)


def _experts(rows, w_in, w_out, counts, cfg: _Cfg, rows_fp8=None, cached=(None, None)):
  # The expert GEMMs need no communicator: the kernel runs wherever CUDA is
  # the platform and the operands are bf16 (else lax.ragged_dot), unless
  # the layer is told to use the reference.
  gemm = functools.partial(expert_matmul, precision=cfg.precision, backend=cfg.backend)
  h = _activate(rows, cfg, gemm, w_in, counts, rows_fp8, cached[0])
  return gemm(h, w_out, counts, out_dtype=cfg.dtype, w_fp8=cached[1])


def _decode_shard(x, topk_idx, topk_weights, routed, shared, *, cfg: _Cfg):
  """Per rank, the decode form of `_moe_shard`: the low-latency grid
  [E_l, R * T, H] and masked GEMMs."""
  w_in, w_out = routed
  fp8 = cfg.precision == "fp8"
  out = low_latency_dispatch(x, topk_idx, num_experts=cfg.num_experts, max_tokens=x.shape[0],
                             axis_name=cfg.axis_name, fp8=fp8, backend=cfg.backend)
  gemm = functools.partial(expert_matmul, precision=cfg.precision, backend=cfg.backend,
                           masked=True)
  # FP8 rows go into the first GEMM as they arrived.
  h = _activate(None if fp8 else out.recv_x, cfg, gemm, w_in, out.recv_count,
                out.recv_x if fp8 else None)
  y = gemm(h, w_out, out.recv_count, out_dtype=cfg.dtype)
  routed = low_latency_combine(y, topk_idx, topk_weights, out.handle, axis_name=cfg.axis_name,
                               backend=cfg.backend)
  if not shared:
    return routed
  return (routed.astype(jnp.float32) + _shared(x, shared, cfg)).astype(cfg.dtype)


def _fp8_dispatch(x, topk_idx, topk_weights, cfg: _Cfg):
  # Rows per (token, rank) or per (token, expert), as the combine wants.
  return dispatch_fp8_rows(x, topk_idx, topk_weights, num_experts=cfg.num_experts,
                           axis_name=cfg.axis_name, layout=cfg.combine_layout,
                           expert_alignment=cfg.expert_alignment, dtype=cfg.dtype,
                           backend=cfg.backend)
