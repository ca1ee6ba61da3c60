"""Wrapper of ffi/handlers/side_done.cc ("jax_ep_side_done")."""
from __future__ import annotations

import jax
import numpy as np

from jax_ep._ffi import call


def side_done(results: tuple, keep: tuple, *, comm_id: int) -> tuple:
  """`*_done` of a start/done pair (ffi/runtime/side_lane.h): XLA's stream
  waits for the start's kernels on the communicator's side stream. `results` (the
  start's outputs) come back aliased, so nothing reads them before the wait;
  `keep` (the start's inputs, the compute to overlap) are operands only, so
  XLA keeps them alive until here and computes them first. Launches no
  kernel (no num_sms)."""
  shapes = tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)
  out = call("jax_ep_side_done", shapes, has_side_effect=True,
             input_output_aliases={i: i for i in range(len(results))})(
                 *results, *keep, comm_id=np.int64(comm_id))
  return tuple(out)
