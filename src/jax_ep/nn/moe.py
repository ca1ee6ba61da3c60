"""An expert-parallel MoE feed-forward layer (Flax NNX).

Routing runs on the global, token-sharded activations (`route`); the expert
part runs inside shard_map: dispatch (expert layout) -> two grouped matmuls
on this rank's experts (jax_ep.grouped_matmul: tensor-core grouped kernels on
GPU, `lax.ragged_dot` elsewhere) -> weighted combine, plus an optional shared
expert (`shared_expert`, a dense MLP every token goes through).

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
from jax_ep import reference as _ref
from jax_ep.ops.dispatch import combine, dispatch
from jax_ep.ops.overlap import dispatch_done, dispatch_start, ordered_after
from jax_ep.ops.grouped_gemm import grouped_matmul
from jax_ep.ops import regroup as _regroup

SCORE_FNS = ("softmax", "sigmoid")


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


# ------------------------------------------------------------ shared expert

def shared_expert(x: jax.Array, w_in: jax.Array, w_out: jax.Array,
                  w_gate: Optional[jax.Array] = None, *, dtype=jnp.bfloat16,
                  out_dtype=jnp.float32) -> jax.Array:
  """The shared expert: a dense MLP every token goes through.

  plain: gelu(x @ w_in) @ w_out; gated: (gelu(x @ w_gate) * (x @ w_in)) @ w_out.
  f32 accumulation; the hidden activations are rounded to `dtype` before the
  second matmul, as the routed experts' are. Depends on nothing the dispatch
  produces, so it can run while a dispatch is in flight.

  Args:
    x: [T, H] in dtype; w_in, w_gate: [H, Fs]; w_out: [Fs, H] (in dtype).
  Returns:
    [T, H] in out_dtype (f32 by default, so that adding it to the routed
    output rounds once).
  """
  h = jnp.dot(x, w_in, preferred_element_type=jnp.float32)
  if w_gate is None:
    h = jax.nn.gelu(h)
  else:
    h = jax.nn.gelu(jnp.dot(x, w_gate, preferred_element_type=jnp.float32)) * h
  return jnp.dot(h.astype(dtype), w_out, preferred_element_type=jnp.float32).astype(out_dtype)


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


def _check_int(name: str, value, *, low: int = 1) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_config(*, hidden, ffn, num_experts, topk, mesh, axis_name, data_axis, score_fn,
                  routed_scaling_factor, num_groups, topk_groups, shared_ffn,
                  fp8_dispatch) -> None:
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


class MoE(nnx.Module):
  """y = sum_k w_k * Expert_{e_k}(x) [+ SharedExpert(x)], top-k routing.

  Args:
    hidden: model width H; ffn: expert width F; num_experts: E (divisible by
      the EP axis size); topk: K.
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
      rank: the two are level, benchmarks/RESULTS.md session 12, and
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
               overlap_shared: bool = False, combine_layout: Optional[str] = None, rngs: nnx.Rngs):
    _check_config(hidden=hidden, ffn=ffn, num_experts=num_experts, topk=topk, mesh=mesh,
                  axis_name=axis_name, data_axis=data_axis, score_fn=score_fn,
                  routed_scaling_factor=routed_scaling_factor, num_groups=num_groups,
                  topk_groups=topk_groups, shared_ffn=shared_ffn, fp8_dispatch=fp8_dispatch)
    self.num_experts, self.topk = num_experts, topk
    self.mesh, self.axis_name, self.data_axis = mesh, axis_name, data_axis
    self.expert_alignment, self.backend, self.dtype = expert_alignment, backend, dtype
    self.score_fn, self.routed_scaling_factor = score_fn, float(routed_scaling_factor)
    self.num_groups, self.topk_groups = num_groups, topk_groups
    self.fp8_dispatch = bool(fp8_dispatch)
    if overlap_shared and (shared_ffn is None or fp8_dispatch):
      raise ValueError("overlap_shared needs a shared expert (shared_ffn) and a bf16 dispatch "
                       "(fp8_dispatch=False)")
    self.overlap_shared = bool(overlap_shared)
    if combine_layout is None:
      combine_layout = "rank" if mesh.shape[axis_name] > 1 else "expert"
    if combine_layout not in ("expert", "rank"):
      raise ValueError(f"combine_layout must be 'expert' or 'rank', got {combine_layout!r}")
    self.combine_layout = combine_layout
    init = jax.nn.initializers.lecun_normal()
    expert_init = jax.nn.initializers.lecun_normal(in_axis=1, out_axis=2)
    split = NamedSharding(mesh, P(axis_name))
    replicated = NamedSharding(mesh, P())

    def param(key, shape, sharding, initializer=init, dtype=jnp.float32):
      return nnx.Param(jax.device_put(initializer(key, shape, jnp.float32).astype(dtype), sharding))

    # Drawn in this order so that a layer without the new parts gets the
    # same weights from the same seed as before.
    self.router = param(rngs.params(), (hidden, num_experts), replicated)
    self.w_in = param(rngs.params(), (num_experts, hidden, ffn), split, expert_init, param_dtype)
    self.w_out = param(rngs.params(), (num_experts, ffn, hidden), split, expert_init, param_dtype)
    shared = {}
    if shared_ffn is not None:
      shared["shared_w_in"] = param(rngs.params(), (hidden, shared_ffn), replicated, init,
                                    param_dtype)
      if shared_gated:
        shared["shared_w_gate"] = param(rngs.params(), (hidden, shared_ffn), replicated, init,
                                        param_dtype)
      shared["shared_w_out"] = param(rngs.params(), (shared_ffn, hidden), replicated, init,
                                     param_dtype)
    # Absent parts are None, data either way (nnx would take a None for static).
    for name in ("shared_w_in", "shared_w_gate", "shared_w_out"):
      setattr(self, name, nnx.data(shared.get(name)))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., H] tokens; the flattened token axis N is split over the EP
    axis (and `data_axis`), so N must be a multiple of their sizes. Returns
    x's shape in x's dtype."""
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
    cfg = _Cfg(self.num_experts, self.axis_name, self.expert_alignment, self.backend, self.dtype,
               self.fp8_dispatch, self.overlap_shared, self.combine_layout)
    tokens = P(axes if len(axes) > 1 else axes[0])
    args = [x2.astype(self.dtype), topk_idx, topk_weights,
            self.w_in[...].astype(self.dtype), self.w_out[...].astype(self.dtype)]
    specs = [tokens, tokens, tokens, P(self.axis_name), P(self.axis_name)]
    if self.shared_w_in is not None:
      shared = [self.shared_w_in, self.shared_w_out]
      if self.shared_w_gate is not None:
        shared.append(self.shared_w_gate)
      args += [w[...].astype(self.dtype) for w in shared]
      specs += [P()] * len(shared)
    f = _mesh.shard_map(functools.partial(_moe_shard, cfg=cfg), self.mesh,
                        axis_name=self.axis_name, in_specs=tuple(specs), out_specs=tokens)
    return f(*args).astype(x.dtype).reshape(shape)


def _moe_shard(x, topk_idx, topk_weights, w_in, w_out, *shared, cfg: _Cfg):
  """Per rank: x [T, H], topk_* [T, K], w_in [E_l, H, F], w_out [E_l, F, H],
  shared: () or (w_in [H, Fs], w_out [Fs, H][, w_gate [H, Fs]]). -> [T, H]."""
  by_rank = cfg.combine_layout == "rank"
  kw = dict(num_experts=cfg.num_experts, axis_name=cfg.axis_name,
            layout="rank" if by_rank else "expert", backend=cfg.backend)
  if not by_rank:
    kw["expert_alignment"] = cfg.expert_alignment
  dense = None
  if cfg.fp8:
    out = _fp8_dispatch(x, topk_idx, topk_weights, cfg)
  elif cfg.overlap and shared:
    # The shared expert between start and done: on CUDA it computes while
    # the rows move (jax_ep.ops.overlap).
    pending = dispatch_start(x, topk_idx, topk_weights, **kw)
    pending, (x_s, shared) = ordered_after(pending, (x, tuple(shared)))
    dense = shared_expert(x_s, shared[0], shared[1], *shared[2:], dtype=cfg.dtype)
    out = dispatch_done(pending, after=dense)
  else:
    out = dispatch(x, topk_idx, topk_weights, **kw)
  if by_rank:
    g = _regroup.group_by_expert(out.recv_topk_idx, num_local_experts=w_in.shape[0],
                                 expert_alignment=cfg.expert_alignment)
    y = _experts(_regroup.expert_rows(out.recv_x, g), w_in, w_out, g.counts, cfg)
    part = _regroup.sum_expert_rows(y, g, out.recv_topk_weights, cfg.dtype)
    routed = combine(part, out.handle, None, axis_name=cfg.axis_name, backend=cfg.backend)
  else:
    y = _experts(out.recv_x, w_in, w_out, out.counts, cfg)
    routed = combine(y, out.handle, out.recv_topk_weights, axis_name=cfg.axis_name,
                     backend=cfg.backend)
  if not shared:
    return routed
  if dense is None:
    s_in, s_out, *s_gate = shared
    dense = shared_expert(x, s_in, s_out, *s_gate, dtype=cfg.dtype)
  return (routed.astype(jnp.float32) + dense).astype(cfg.dtype)


def _experts(rows, w_in, w_out, counts, cfg: _Cfg):
  # The expert GEMMs need no communicator: the kernel runs wherever CUDA is
  # the platform and the operands are bf16 (else lax.ragged_dot), unless
  # the layer is told to use the reference.
  gemm = functools.partial(grouped_matmul,
                           backend="reference" if cfg.backend == "reference" else None)
  h = gemm(rows, w_in, counts, out_dtype=jnp.float32)
  h = jax.nn.gelu(h).astype(cfg.dtype)
  return gemm(h, w_out, counts, out_dtype=cfg.dtype)


# An FP8 dispatch alone passes no gradient to x (jax_ep.dispatch stops it:
# FP8 payloads are forward-only), which would cut every layer below this one
# off from the loss; the straight-through backward here sends the rows'
# cotangents back as a bf16 dispatch's would.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_dispatch(x, topk_idx, topk_weights, cfg: _Cfg):
  return _fp8_dispatch_fwd(x, topk_idx, topk_weights, cfg)[0]


def _fp8_dispatch_fwd(x, topk_idx, topk_weights, cfg: _Cfg):
  # Rows per (token, rank) or per (token, expert), as the combine wants;
  # either way the backward below is that dispatch's exact bf16 transpose.
  kw = (dict(layout="rank") if cfg.combine_layout == "rank" else
        dict(layout="expert", expert_alignment=cfg.expert_alignment))
  out = dispatch(x, topk_idx, topk_weights, num_experts=cfg.num_experts,
                 axis_name=cfg.axis_name, fp8=True, backend=cfg.backend, **kw)
  q, scales = out.recv_x
  out = out._replace(recv_x=_fp8.dequantize(q, scales, cfg.dtype))
  return out, out.handle


def _fp8_dispatch_bwd(cfg: _Cfg, handle, ct):
  dx = combine(ct.recv_x.astype(cfg.dtype), handle, None, axis_name=cfg.axis_name,
               backend=cfg.backend)
  dw = _ref.return_row_weights(ct.recv_topk_weights, handle, cfg.axis_name)
  return dx, None, dw


_fp8_dispatch.defvjp(_fp8_dispatch_fwd, _fp8_dispatch_bwd)
