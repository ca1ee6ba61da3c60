"""jax_ep: expert-parallel MoE dispatch/combine and Engram lookups for JAX.

The ops run inside `shard_map` over the EP mesh axis. On NVIDIA GPUs with a
`Communicator` they run CUDA kernels that move rows over NVLink through the
NCCL device API; everywhere else they run the pure-JAX reference
(`jax_ep.reference`), which has the same outputs and row order.
"""
from jax_ep._types import (DispatchHandle, DispatchOutput, Layout, LowLatencyDispatchOutput,
                           LowLatencyHandle, PublishedTable)
from jax_ep._checks import EpRuntimeError
from jax_ep.fp8 import dequantize, quantize
from jax_ep.mesh import shard_map
from jax_ep.ops.dispatch import combine, dispatch
from jax_ep.ops.overlap import (PendingCombine, PendingDispatch, combine_done, combine_start,
                                dispatch_done, dispatch_start, ordered_after)
from jax_ep.ops.grouped_gemm import (Fp8Weights, dequantize_weights_fp8, fp8_weights,
                                     grouped_matmul,
                                     grouped_matmul_fp8, masked_grouped_matmul,
                                     masked_grouped_matmul_fp8, quantize_weights_fp8)
from jax_ep.ops.engram import (engram_fetch, engram_fetch_start, engram_fetch_wait,
                               engram_publish)
from jax_ep.ops.layout import get_dispatch_layout
from jax_ep.ops.mega_moe import mega_moe
from jax_ep.ops.low_latency import (low_latency_combine, low_latency_combine_done,
                                    low_latency_combine_start, low_latency_dispatch,
                                    low_latency_dispatch_done, low_latency_dispatch_start)
from jax_ep.reference import default_capacity

from jax_ep._native import build_info, cuda_available, warn_if_shadowed as _warn_if_shadowed
from jax_ep.comm import Communicator, get_buffer_size_hint

__version__ = "0.1.0"

_warn_if_shadowed(__path__[0])


def __getattr__(name: str):
  # jax_ep.nn (the Flax layers) loads on first use: it imports flax, slow to
  # import, and the ops above, so `import jax_ep` stays as light as before.
  if name == "nn":
    import importlib
    return importlib.import_module("jax_ep.nn")
  raise AttributeError(f"module 'jax_ep' has no attribute {name!r}")


__all__ = [
    "Communicator", "DispatchHandle", "DispatchOutput", "EpRuntimeError", "Layout",
    "LowLatencyDispatchOutput", "LowLatencyHandle", "PendingCombine", "PendingDispatch",
    "PublishedTable", "build_info", "combine", "combine_done", "combine_start",
    "Fp8Weights", "fp8_weights", "cuda_available", "default_capacity", "dequantize", "dequantize_weights_fp8", "dispatch",
    "dispatch_done", "dispatch_start",
    "engram_fetch", "engram_fetch_start", "engram_fetch_wait", "engram_publish",
    "get_buffer_size_hint", "get_dispatch_layout", "grouped_matmul", "grouped_matmul_fp8",
    "low_latency_combine", "low_latency_combine_done", "low_latency_combine_start",
    "low_latency_dispatch", "low_latency_dispatch_done", "low_latency_dispatch_start",
    "masked_grouped_matmul", "masked_grouped_matmul_fp8", "mega_moe", "ordered_after",
    "quantize",
    "quantize_weights_fp8",
    "shard_map",
]
