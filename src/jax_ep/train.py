"""Example training run: a small MoE transformer learns a synthetic sequence task.

    python -m jax_ep.train [--steps 30] [--backend reference] [--compare-backends] ...
    python -m jax_ep.train --activation swiglu --fp8 [--compare-fp8] --hidden 1024 ...

Token embedding + learned positions, `--layers` blocks of causal
self-attention and a jax_ep.nn.MoE feed-forward (pre-RMSNorm, residuals), an
output head; cross-entropy on the next token, optax adam. The data: each
sequence starts with two random tokens, then x[t+1] = (perm[x[t]] +
x[t-1] % 2) % vocab for a fixed random permutation, so the loss falls from
log(vocab) as the model learns the permutation (from x[t] alone) and then
the parity bit (by attending to x[t-1]). `--engram` adds a jax_ep.nn.Engram
layer (hashed 2/3-gram rows of a table split over the EP ranks, gated into
the residual) after the embedding; its table is published once per step,
after the optimizer update, and the next step's lookups read that
publication (fetch -> loss -> grad -> update -> publish).

Runs on whatever devices exist: GPUs with the CUDA kernels when jax_ep was
built with CUDA (a Communicator on the EP axis), else 8 virtual CPU devices
with the pure-JAX reference. `--backend reference` forces the reference;
`--compare-backends` trains twice from the same start, kernels and
reference, and reports how far the loss curves drift apart.
`--activation swiglu` gives the MoE layers SwiGLU experts; `--fp8` runs their
expert GEMMs through FP8 (jax_ep.nn.MoE's precision="fp8"; hidden, ffn and
shared-ffn multiples of 128); `--compare-fp8` trains bf16 and FP8 from the
same start and data, reports the final losses' relative difference and
plots both curves. `--fused` runs the FP8 layers' routed experts as one
`jax_ep.mega_moe` op (with --activation swiglu and --fp8 or --compare-fp8).
`--eval-every N --eval-batches K` evaluates the loss on K
fixed held-out batches (drawn from their own seed, the same for every run)
before the first step, every N steps and after the last; with
`--compare-fp8` the final comparison is the final eval loss, with its
relative gap and a paired standard error over the eval batches.
`--lr-schedule {auto,constant,cosine}` with `--warmup-steps`: the learning
rate (auto: constant, as before). Several
processes: `--coordinator HOST:PORT --num-processes N --process-id I`
(jax.distributed); only process 0 prints and writes files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
import time
from typing import Callable, Optional

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.mesh import place_replicated  # noqa: E402
from jax_ep.nn import Engram, MoE  # noqa: E402

BACKENDS = {"auto": None, "reference": "reference", "cuda": "cuda"}


# ------------------------------------------------------------------ data

def task_permutation(vocab: int, *, seed: int = 0) -> np.ndarray:
  """The task's fixed permutation of the vocabulary."""
  return np.random.default_rng(seed).permutation(vocab).astype(np.int32)


def make_batch(rng: np.random.Generator, perm: np.ndarray, *, batch: int,
               seq: int) -> np.ndarray:
  """[batch, seq + 1] int32 sequences of the task (module docstring)."""
  vocab = len(perm)
  x = np.empty((batch, seq + 1), np.int32)
  x[:, :2] = rng.integers(0, vocab, (batch, 2))
  for t in range(1, seq):
    x[:, t + 1] = (perm[x[:, t]] + x[:, t - 1] % 2) % vocab
  return x


# Offset of the held-out eval batches' seed from --seed: they never share
# the training batches' stream.
EVAL_SEED_OFFSET = 1000


def eval_batches(args: argparse.Namespace, perm: np.ndarray) -> list[np.ndarray]:
  """The --eval-batches fixed held-out batches (each [batch, seq + 1]),
  drawn from their own seed: the same for every run of one --seed."""
  rng = np.random.default_rng(args.seed + EVAL_SEED_OFFSET)
  return [make_batch(rng, perm, batch=args.batch, seq=args.seq) for _ in range(args.eval_batches)]


def eval_points(steps: int, every: int) -> list[int]:
  """Steps after which the eval runs (0: before the first): 0, every,
  2 * every, ... and the last step; none without --eval-every."""
  if every <= 0:
    return []
  return sorted({0, steps, *range(every, steps + 1, every)})


def learning_rate(args: argparse.Namespace, step, xp=jnp):
  """The learning rate of optimizer step `step` (0-based; numpy or jax
  scalars). auto / constant: --lr; cosine: from --lr down towards 0 (reached
  after the last step). Either after a linear warm-up over --warmup-steps (from lr /
  warmup at the first step)."""
  warm = args.warmup_steps
  lr = args.lr * (xp.minimum(1.0, (step + 1) / warm) if warm > 0 else 1.0)
  if args.lr_schedule == "cosine":
    frac = xp.clip((step - warm) / max(1, args.steps - warm), 0.0, 1.0)
    lr = lr * 0.5 * (1.0 + xp.cos(math.pi * frac))
  return lr


def _schedule(args: argparse.Namespace):
  """What optax.adam takes: a float where the rate never changes."""
  if args.lr_schedule in ("auto", "constant") and args.warmup_steps <= 0:
    return args.lr
  return lambda count: learning_rate(args, count)


# ------------------------------------------------------------------ model

def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def causal_attention(x: jax.Array, wqkv: jax.Array, wo: jax.Array, *, heads: int) -> jax.Array:
  """Multi-head causal self-attention: x [B, S, H], wqkv [H, 3H], wo [H, H] -> [B, S, H]."""
  b, s, h = x.shape
  q, k, v = jnp.split((x @ wqkv).reshape(b, s, 3 * heads, h // heads), 3, axis=2)
  logits = jnp.einsum("bqnd,bknd->bnqk", q, k) / math.sqrt(h // heads)
  causal = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
  return jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, h) @ wo


class Block(nnx.Module):
  """h + Attn(RMSNorm(h)), then + MoE(RMSNorm(h))."""

  def __init__(self, hidden: int, *, heads: int, moe: MoE, rngs: nnx.Rngs):
    init = jax.nn.initializers.lecun_normal()
    self.heads = heads
    self.attn_norm = nnx.Param(jnp.ones((hidden,), jnp.float32))
    self.wqkv = nnx.Param(init(rngs.params(), (hidden, 3 * hidden), jnp.float32))
    self.wo = nnx.Param(init(rngs.params(), (hidden, hidden), jnp.float32))
    self.moe_norm = nnx.Param(jnp.ones((hidden,), jnp.float32))
    self.moe = moe

  def __call__(self, h: jax.Array) -> jax.Array:
    h = h + causal_attention(rms_norm(h, self.attn_norm[...]), self.wqkv[...], self.wo[...],
                             heads=self.heads)
    return h + self.moe(rms_norm(h, self.moe_norm[...]))


class MoETransformer(nnx.Module):
  """tokens [B, S] -> next-token logits [B, S, vocab] (f32)."""

  def __init__(self, *, vocab: int, seq: int, hidden: int, heads: int, layers: int,
               moe: Callable[[nnx.Rngs], MoE], remat: bool = False,
               engram: Optional[Callable[[nnx.Rngs], Engram]] = None, rngs: nnx.Rngs):
    if hidden % heads:
      raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, hidden), jnp.float32))
    self.pos = nnx.Param(0.1 * jax.random.normal(rngs.params(), (seq, hidden), jnp.float32))
    self.engram = engram(rngs) if engram is not None else None
    self.blocks = nnx.List([Block(hidden, heads=heads, moe=moe(rngs), rngs=rngs)
                            for _ in range(layers)])
    self.norm = nnx.Param(jnp.ones((hidden,), jnp.float32))
    self.head = nnx.Param(jax.nn.initializers.lecun_normal()(rngs.params(), (hidden, vocab),
                                                             jnp.float32))
    self.remat = remat

  def __call__(self, tokens: jax.Array, published=None) -> jax.Array:
    """published: the Engram layer's publication of its current table."""
    h = self.embed[...][tokens] + self.pos[...][:tokens.shape[1]]
    if self.engram is not None:
      h = self.engram(h, tokens, published)
    for block in self.blocks:
      h = nnx.remat(lambda blk, h: blk(h))(block, h) if self.remat else block(h)
    return rms_norm(h, self.norm[...]) @ self.head[...]


def next_token_loss(model: MoETransformer, tokens: jax.Array, published=None) -> jax.Array:
  """Mean cross-entropy of tokens[:, 1:] given tokens[:, :-1]."""
  logits = model(tokens[:, :-1], published)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


# ------------------------------------------------------------------ training

def build_mesh(dp: int) -> Mesh:
  """All devices as (dp, ep) (dp > 1) or ep alone."""
  devices = np.array(jax.devices())
  if devices.size % dp:
    raise ValueError(f"--dp {dp} must divide the {devices.size} devices")
  if dp == 1:
    return Mesh(devices, ("ep",))
  return Mesh(devices.reshape(dp, -1), ("dp", "ep"))


def train(args: argparse.Namespace, mesh: Mesh, *, backend: Optional[str],
          log: Callable[..., None], show_bar: bool, label: str = "train",
          precision: Optional[str] = None) -> dict:
  """Trains from the seed's start for args.steps; returns the losses, the
  learning rates, the step times, the tokens per second (steady state), how
  many programs the step compiled and the held-out evals ("eval": the steps
  after which each ran, each eval batch's loss there, their means).
  precision: the MoE layers' ("bf16" / "fp8"; default from
  args.fp8)."""
  if precision is None:
    precision = "fp8" if args.fp8 else "bf16"
  dp = "dp" in mesh.axis_names
  ep = mesh.shape["ep"]
  token_spec = P(("dp", "ep")) if dp else P("ep")
  moe_kwargs = dict(mesh=mesh, axis_name="ep", data_axis="dp" if dp else None, backend=backend,
                    score_fn=args.score_fn, shared_ffn=args.shared_ffn or None,
                    fp8_dispatch=args.fp8_dispatch, activation=args.activation,
                    precision=precision, fused=args.fused and precision == "fp8")
  experts = args.experts_per_rank * ep
  engram = None
  if args.engram:
    engram = lambda rngs: Engram(args.hidden, mesh=mesh, axis_name="ep",  # noqa: E731
                                 rows_per_head=args.engram_rows, head_dim=args.engram_dim,
                                 backend=backend, rngs=rngs)
  model = MoETransformer(
      vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers,
      moe=lambda rngs: MoE(args.hidden, args.ffn, experts, args.topk, rngs=rngs, **moe_kwargs),
      remat=args.remat, engram=engram, rngs=nnx.Rngs(args.seed))
  opt = nnx.Optimizer(model, optax.adam(_schedule(args)), wrt=nnx.Param)
  # The MoE layers placed their own weights; everything else (attention,
  # embeddings, the optimizer's counts) is replicated over the mesh, so the
  # second step reuses the first step's program.
  nnx.update((model, opt), place_replicated(nnx.state((model, opt)), mesh))
  graph, state = nnx.split((model, opt))

  def publish(model):  # the Engram table as it is now (None without Engram)
    return model.engram.publish() if model.engram is not None else None

  def step_fn(state, published, tokens):
    model, opt = nnx.merge(graph, state)
    loss, grads = nnx.value_and_grad(next_token_loss)(model, tokens, published)
    opt.update(model, grads)
    return loss, nnx.state((model, opt)), publish(model)

  published = jax.jit(lambda state: publish(nnx.merge(graph, state)[0]))(state)
  # The step returns its state and publication placed as it takes them, so
  # every step runs the first step's program (on one device XLA would
  # otherwise hand back single-device shardings and compile a second one).
  shardings = jax.tree.map(lambda a: a.sharding, (state, published))
  step = jax.jit(step_fn, out_shardings=(None, *shardings))

  perm = task_permutation(args.vocab, seed=args.seed)
  rng = np.random.default_rng(args.seed + 1)
  sharding = NamedSharding(mesh, token_spec)

  def place(host):  # every process draws the same global batch and keeps its own rows
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

  points = eval_points(args.steps, args.eval_every)
  held_out = [place(b) for b in eval_batches(args, perm)] if points else []
  eval_loss = jax.jit(lambda state, published, tokens: next_token_loss(
      nnx.merge(graph, state)[0], tokens, published))
  evals = dict(steps=[], batch_losses=[], losses=[])

  def evaluate(step):
    per = [float(eval_loss(state, published, t)) for t in held_out]
    evals["steps"].append(step)
    evals["batch_losses"].append(per)
    evals["losses"].append(float(np.mean(per)))

  losses, times = [], []
  if 0 in points:
    evaluate(0)
  bar = tqdm(range(args.steps), desc=label, unit="step", disable=not show_bar)
  for i in bar:
    tokens = place(make_batch(rng, perm, batch=args.batch, seq=args.seq))
    t0 = time.perf_counter()
    loss, state, published = step(state, published, tokens)
    loss = float(loss)
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{args.batch * args.seq / times[-1]:.0f}")
    if i + 1 in points[1:]:
      evaluate(i + 1)
      bar.set_postfix(loss=f"{loss:.4f}", eval=f"{evals['losses'][-1]:.4f}")
  steady = times[1:] or times
  tokens_per_s = args.batch * args.seq / float(np.median(steady))
  log(f"{label}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; {tokens_per_s:.0f} tokens/s "
      f"(median step {np.median(steady) * 1e3:.1f} ms; first step, with compilation, "
      f"{times[0]:.2f} s)" + (f"; eval loss {evals['losses'][0]:.4f} -> "
                              f"{evals['losses'][-1]:.4f}" if points else ""))
  # Where the Engram lookups ran: "auto" = the kernels on the CUDA platform.
  engram_path = published.backend if published is not None else None
  lrs = [float(learning_rate(args, np.float64(k), np)) for k in range(args.steps)]
  return dict(losses=losses, lrs=lrs, eval=evals, step_times_s=times, tokens_per_s=tokens_per_s,
              compiled_programs=step._cache_size(), engram_path=engram_path)


def fp8_eval_comparison(b16: dict, f8: dict) -> dict:
  """The final held-out eval of a bf16 and an FP8 run on the same batches:
  both mean losses, the relative gap (fp8 - bf16) / bf16 and its paired
  standard error over the eval batches (std of the per-batch differences /
  sqrt(K), relative to the bf16 mean), and whether any eval loss of either
  run was not finite."""
  b, f = np.asarray(b16["batch_losses"][-1]), np.asarray(f8["batch_losses"][-1])
  mb, mf = float(np.mean(b)), float(np.mean(f))
  k = len(b)
  se = float(np.std(f - b, ddof=1) / math.sqrt(k)) / abs(mb) if k > 1 else float("nan")
  finite = all(np.all(np.isfinite(r["batch_losses"])) for r in (b16, f8))
  return dict(fp8_eval_step=int(f8["steps"][-1]), fp8_eval_final_loss=dict(bf16=mb, fp8=mf),
              fp8_eval_relative_gap=(mf - mb) / abs(mb), fp8_eval_paired_se=se,
              fp8_eval_batches=k, fp8_eval_finite=bool(finite))


def max_relative_difference(a: list[float], b: list[float], steps: int) -> float:
  """max |a - b| / |b| over the first `steps` entries."""
  n = min(steps, len(a), len(b))
  x, y = np.asarray(a[:n]), np.asarray(b[:n])
  return float(np.max(np.abs(x - y) / np.maximum(np.abs(y), 1e-12))) if n else 0.0


def plot_losses(curves: dict[str, list[float]], path: str, *, title: str,
                log_y: bool = False,
                evals: Optional[dict[str, tuple[list[int], list[float]]]] = None) -> bool:
  """Writes a loss-curve PNG (log_y: a logarithmic loss axis, where curves
  that end close together are told apart; evals: per curve, the held-out
  eval losses after the given steps, drawn as markers of the curve's
  colour); False (and a note) without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, losses in curves.items():
    # Step i's loss is of the parameters after i updates, as the eval after i steps.
    line, = ax.plot(np.arange(len(losses)), losses, label=f"{name} train", alpha=0.6)
    if evals and evals.get(name) and evals[name][0]:
      ax.plot(*evals[name], "o-", color=line.get_color(), markersize=3,
              label=f"{name} held-out eval")
  ax.set_xlabel("optimizer steps taken")
  ax.set_ylabel("next-token cross-entropy")
  if log_y:
    ax.set_yscale("log")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jax_ep.train", description=__doc__.splitlines()[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=30, help="optimizer steps")
  p.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
  p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
  p.add_argument("--vocab", type=int, default=32, help="vocabulary size")
  p.add_argument("--hidden", type=int, default=64, help="model width H")
  p.add_argument("--heads", type=int, default=4, help="attention heads")
  p.add_argument("--layers", type=int, default=2, help="transformer blocks")
  p.add_argument("--ffn", type=int, default=128, help="expert width")
  p.add_argument("--experts-per-rank", type=int, default=2, help="experts on each EP rank")
  p.add_argument("--topk", type=int, default=2, help="experts per token")
  p.add_argument("--score-fn", choices=("softmax", "sigmoid"), default="softmax",
                 help="router scores")
  p.add_argument("--shared-ffn", type=int, default=0, help="shared expert width (0: none)")
  p.add_argument("--fp8-dispatch", action="store_true",
                 help="rows travel as FP8 (hidden must be a multiple of 128)")
  p.add_argument("--activation", choices=("gelu", "swiglu"), default="gelu",
                 help="the experts' activation (swiglu: fused gate/up weight w13)")
  p.add_argument("--fp8", action="store_true",
                 help="expert GEMMs through FP8, forward and backward (hidden, ffn, shared-ffn "
                      "multiples of 128)")
  p.add_argument("--compare-fp8", action="store_true",
                 help="train bf16 and FP8 from the same start; report the final losses' "
                      "relative difference and plot both curves")
  p.add_argument("--fused", action="store_true",
                 help="the FP8 layers' routed experts as one jax_ep.mega_moe op (needs "
                      "--activation swiglu and --fp8 or --compare-fp8)")
  p.add_argument("--remat", action="store_true", help="recompute each block in the backward")
  p.add_argument("--engram", action="store_true",
                 help="add a jax_ep.nn.Engram layer after the embedding")
  p.add_argument("--engram-rows", type=int, default=1021, help="Engram rows per (order, head)")
  p.add_argument("--engram-dim", type=int, default=16, help="Engram row width D")
  p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (mesh dp x ep)")
  p.add_argument("--lr", type=float, default=3e-3, help="adam learning rate (the peak, with "
                 "a schedule)")
  p.add_argument("--lr-schedule", choices=("auto", "constant", "cosine"), default="auto",
                 help="auto/constant: --lr throughout; cosine: from --lr down towards 0 at the "
                      "end; either after --warmup-steps")
  p.add_argument("--warmup-steps", type=int, default=0,
                 help="linear learning-rate warm-up steps (0: none)")
  p.add_argument("--eval-every", type=int, default=0,
                 help="held-out eval loss before the first step, every N steps and after the "
                      "last (0: no eval)")
  p.add_argument("--eval-batches", type=int, default=8,
                 help="fixed held-out batches of --batch sequences (their own seed) per eval")
  p.add_argument("--seed", type=int, default=0, help="parameters and data")
  p.add_argument("--backend", choices=tuple(BACKENDS), default="auto",
                 help="auto: CUDA kernels where they run, else the reference")
  p.add_argument("--compare-backends", action="store_true",
                 help="train with the kernels and with the reference; report the loss drift")
  p.add_argument("--compare-steps", type=int, default=10,
                 help="steps over which --compare-backends takes the max relative difference")
  p.add_argument("--plot", default="train_loss.png", help="loss-curve PNG")
  p.add_argument("--no-plot", action="store_true", help="write no PNG")
  p.add_argument("--json", default="train_losses.json", help="losses and timings as JSON")
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="virtual CPU devices per process; None: JAX_NUM_CPU_DEVICES, else 8")
  p.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (jax.distributed)")
  p.add_argument("--num-processes", type=int, default=None, help="with --coordinator")
  p.add_argument("--process-id", type=int, default=None, help="with --coordinator")
  return p.parse_args(argv)


def _start_jax(args: argparse.Namespace) -> None:
  """Device count and jax.distributed, before anything touches a device."""
  if args.cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  else:
    try:
      jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
    except Exception:  # already initialised, or an older jax: the env var covers it
      pass
  if args.coordinator is not None:
    if args.num_processes is None or args.process_id is None:
      raise SystemExit("--coordinator needs --num-processes and --process-id")
    # Collectives between CPU processes (the reference path) go over gloo;
    # GPU processes use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id)


def _command(argv) -> str:
  """The command as it could be typed again (settings that change what the
  run does first)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
         if k.startswith(("JAX_EP_", "XLA_FLAGS")) and k not in ("JAX_EP_COMMIT", "JAX_EP_CUDA")]
  return " ".join(env + ["python -m jax_ep.train", shlex.join(argv)]).strip()


def main(argv=None) -> dict:
  args = parse_args(argv)
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  _start_jax(args)
  main_process = jax.process_index() == 0
  log = print if main_process else (lambda *a, **k: None)
  if args.compare_fp8 and args.compare_backends:
    raise SystemExit("--compare-fp8 and --compare-backends each train twice: pick one")
  if args.fused and (args.activation != "swiglu" or not (args.fp8 or args.compare_fp8)):
    raise SystemExit("--fused runs SwiGLU experts in FP8: it needs --activation swiglu and "
                     "--fp8 or --compare-fp8")
  if args.eval_every > 0 and args.eval_batches < 1:
    raise SystemExit("--eval-every needs --eval-batches >= 1")
  if args.warmup_steps < 0:
    raise SystemExit("--warmup-steps must be >= 0")
  mesh = build_mesh(args.dp)
  if args.batch % mesh.size:
    raise SystemExit(f"--batch {args.batch} must be a multiple of the {mesh.size} devices "
                     "(the sequences are split over all of them)")
  comm = None
  if jax_ep.cuda_available() and (args.backend != "reference" or args.compare_backends):
    comm = jax_ep.Communicator.create(mesh, "ep")
  kernels = comm is not None
  devices = jax.devices()
  log(f"jax_ep train: {len(devices)} x {devices[0].platform} devices in {jax.process_count()} "
      f"process(es), mesh {dict(mesh.shape)}, {args.experts_per_rank * mesh.shape['ep']} experts "
      f"top-{args.topk} ({args.activation}{', FP8' if args.fp8 else ''}), {args.layers} blocks, "
      f"H={args.hidden}, {args.batch} x {args.seq} tokens "
      f"a step; MoE via {'CUDA kernels' if kernels and args.backend != 'reference' else 'pure-JAX reference'}")
  try:
    runs = {}
    if args.compare_backends:
      first = "kernels" if kernels else "auto"
      runs[first] = train(args, mesh, backend=None, log=log, show_bar=main_process, label=first)
      runs["reference"] = train(args, mesh, backend="reference", log=log, show_bar=main_process,
                                label="reference")
    elif args.compare_fp8:
      for precision in ("bf16", "fp8"):
        runs[precision] = train(args, mesh, backend=BACKENDS[args.backend], log=log,
                                show_bar=main_process, label=precision, precision=precision)
    else:
      name = "kernels" if kernels and args.backend != "reference" else "reference"
      runs[name] = train(args, mesh, backend=BACKENDS[args.backend], log=log,
                         show_bar=main_process, label=name)
  finally:
    if comm is not None:
      comm.close()
  result = dict(args=vars(args), command=_command(argv), date=started,
                platform=devices[0].platform, device_kind=devices[0].device_kind,
                devices=len(devices), processes=jax.process_count(), host_cpus=os.cpu_count(),
                kernels=kernels, runs=runs)
  if args.compare_backends:
    a, b = (r["losses"] for r in runs.values())
    result["max_relative_loss_difference"] = diff = max_relative_difference(
        a, b, args.compare_steps)
    log(f"max relative loss difference, kernels vs reference, over the first "
        f"{min(args.compare_steps, args.steps)} steps: {diff:.3e}"
        + ("" if kernels else " (both runs used the reference: no CUDA kernels here)"))
  if args.compare_fp8:
    b16, f8 = runs["bf16"]["losses"], runs["fp8"]["losses"]
    result["fp8_final_loss_relative_difference"] = rel = abs(f8[-1] - b16[-1]) / abs(b16[-1])
    # One step's loss is one batch's: the mean of the last tenth of the
    # steps says more about where each run ended.
    tail = max(1, len(b16) // 10)
    mb, mf = float(np.mean(b16[-tail:])), float(np.mean(f8[-tail:]))
    result["fp8_tail_mean_relative_difference"] = tail_rel = abs(mf - mb) / abs(mb)
    finite = bool(np.all(np.isfinite(f8)))
    log(f"final loss: bf16 {b16[-1]:.4f}, fp8 {f8[-1]:.4f}, relative difference {rel:.2%}; "
        f"mean of the last {tail} steps: bf16 {mb:.4f}, fp8 {mf:.4f}, {tail_rel:.2%}"
        + ("" if finite else "; the FP8 run has non-finite losses"))
    if args.eval_every > 0:
      result.update(fp8_eval_comparison(runs["bf16"]["eval"], runs["fp8"]["eval"]))
      c = result
      log(f"final eval loss ({args.eval_batches} held-out batches, step "
          f"{c['fp8_eval_step']}): bf16 {c['fp8_eval_final_loss']['bf16']:.4f}, fp8 "
          f"{c['fp8_eval_final_loss']['fp8']:.4f}, relative gap {c['fp8_eval_relative_gap']:+.2%} "
          f"(paired standard error {c['fp8_eval_paired_se']:.2%})")
  if main_process:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
    written = [args.json]
    if not args.no_plot and plot_losses({k: r["losses"] for k, r in runs.items()}, args.plot,
                                        title=f"jax_ep.train on {len(devices)} x "
                                              f"{devices[0].platform}",
                                        log_y=args.compare_fp8,
                                        evals={k: (r["eval"]["steps"], r["eval"]["losses"])
                                               for k, r in runs.items()}):
      written.append(args.plot)
    log("wrote " + ", ".join(written))
  return result


if __name__ == "__main__":
  main()
