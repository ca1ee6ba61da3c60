"""jax_ep.mega_moe on one GPU with a Communicator: the automatic choice runs
the unfused FP8 path on its kernels (FP8 dispatch, the FP8 grouped GEMMs,
combine), within FP8 rounding of the float64 oracle of the op's casts;
backend="cuda" asks for the fused kernels, which this build lacks."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import _native
from test_mega_moe import _inputs, _rel, np_mega_moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and a GPU"),
]


def _mesh():
  return Mesh(np.array(jax.devices("cuda")[:1]), ("ep",))


@pytest.fixture(scope="module", autouse=True)
def _communicator():
  from jax_ep.comm import Communicator
  c = Communicator.create(_mesh(), "ep", 256 << 20)
  yield c
  c.close()


@pytest.mark.parametrize("mode", ["random", "skewed"])
def test_mega_moe_on_the_fp8_kernels_is_within_fp8_rounding_of_the_oracle(mode):
  x, idx, w, w13, w2 = _inputs(1, mode, seed=5)
  mesh = _mesh()
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))  # noqa: E731
  f = jax.jit(jax_ep.shard_map(functools.partial(jax_ep.mega_moe, num_experts=w13.shape[0]),
                               mesh))
  args = (put(jnp.asarray(x, jnp.bfloat16)), put(jnp.asarray(idx)), put(jnp.asarray(w)),
          put(jnp.asarray(w13)), put(jnp.asarray(w2)))
  hlo = f.lower(*args).as_text()
  assert hlo.count("jax_ep_grouped_gemm_fp8") >= 2 and "jax_ep_dispatch" in hlo
  got = np.asarray(f(*args), np.float64)
  wv = np.where(idx >= 0, w, 0)
  want = np_mega_moe(x, idx, wv, w13, w2)
  cast_effect = _rel(want, np_mega_moe(x, idx, wv, w13, w2, casts=False))
  # Looser than the CPU reference's 0.1 (test_mega_moe.py). On the GPU two
  # small differences reach the output through the chain of roundings after
  # GEMM 1 (bf16, bf16, e4m3), where one flipped step of h moves it by 1/16:
  # GEMM 1 on the FP8 tensor cores (norm-wise as close to the exact product
  # as its bf16 rounding, but 5 % of its elements a bf16 step or more off)
  # and a step after GEMM 1 that XLA computes differently on the GPU, not
  # pinned down yet (the reference backend, its GEMM 1 exact to bf16 and its
  # casts bit-exact, lands 0.20-0.24 of the casts' effect from the oracle
  # there, 0.04 on the CPU). Measured on one H100: the kernels at 0.11 and
  # 0.20 (random, skewed). scripts/diag_swiglu_xla.py on one H100 cleared
  # the steps after GEMM 1: SwiGLU, h's cast and combine's sum differ from
  # XLA:CPU in 4e-6, 1e-7 and 6e-5 of their outputs, far too few; x's cast
  # and GEMM 2 are what is left to compare.
  assert _rel(got, want) < 0.25 * cast_effect, (_rel(got, want), cast_effect)


def test_backend_cuda_asks_for_the_fused_kernels_this_build_lacks():
  x, idx, w, w13, w2 = _inputs(1, "random")
  f = jax_ep.shard_map(functools.partial(jax_ep.mega_moe, num_experts=w13.shape[0],
                                         backend="cuda"), _mesh())
  with pytest.raises(ValueError, match="fused kernels are not in this build"):
    f(jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(w13),
      jnp.asarray(w2))
