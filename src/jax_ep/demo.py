"""Main job: a few training steps of a small expert-parallel MoE layer.

    python -m jax_ep.demo [--steps 20] [--tokens-per-rank 256] ...

Runs on whatever devices exist: all GPUs with the CUDA kernels when jax_ep was
built with CUDA, else 8 virtual CPU devices with the pure-JAX reference.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.nn import MoE  # noqa: E402


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--tokens-per-rank", type=int, default=64)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--ffn", type=int, default=256)
  p.add_argument("--experts-per-rank", type=int, default=2)
  p.add_argument("--topk", type=int, default=2)
  p.add_argument("--lr", type=float, default=3e-3)
  args = p.parse_args(argv)

  try:
    jax.config.update("jax_num_cpu_devices", 8)
  except Exception:  # already initialised, or an older jax: the env var covers it
    pass
  devices = jax.devices()
  r = len(devices)
  mesh = Mesh(np.array(devices), ("ep",))
  comm = None
  if jax_ep.cuda_available():
    comm = jax_ep.Communicator.create(mesh, "ep")
  path = "CUDA kernels" if comm is not None else "pure-JAX reference"
  e = args.experts_per_rank * r
  n = args.tokens_per_rank * r
  print(f"jax_ep demo: {r} x {devices[0].platform} devices, EP={r}, {e} experts, top-{args.topk}, "
        f"{args.tokens_per_rank} tokens/rank, H={args.hidden}; dispatch/combine via {path}")

  model = MoE(args.hidden, args.ffn, e, args.topk, mesh=mesh, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
  # Everything not already split over the mesh (router, step counts) is
  # replicated on it up front, so the second step reuses the first's program.
  replicated = NamedSharding(mesh, P())

  def on_mesh(a):
    if isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding):
      return a
    return jax.device_put(a, replicated)

  nnx.update((model, opt), jax.tree.map(on_mesh, nnx.state((model, opt))))
  rng = np.random.default_rng(0)
  shard = NamedSharding(mesh, P("ep"))
  x = jax.device_put(jnp.asarray(rng.standard_normal((n, args.hidden)), jnp.float32), shard)
  target = jax.device_put(jnp.tanh(x @ jnp.asarray(rng.standard_normal((args.hidden, args.hidden))
                                                   / np.sqrt(args.hidden), jnp.float32)), shard)

  @nnx.jit
  def step(model, opt, x, target):
    def loss_fn(model):
      return jnp.mean((model(x) - target) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses, times = [], []
  bar = tqdm(range(args.steps), desc="train", unit="step")
  for i in bar:
    t0 = time.perf_counter()
    loss = float(step(model, opt, x, target))
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    bar.set_postfix(loss=f"{loss:.4f}", ms=f"{times[-1] * 1e3:.1f}")
  steady = times[1:] or times
  print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step {np.median(steady) * 1e3:.2f} ms "
        f"(first step, with compilation, {times[0]:.2f} s)")
  if comm is not None:
    comm.close()


if __name__ == "__main__":
  main()
