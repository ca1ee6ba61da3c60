"""The communicator probe (ffi/testing/probe.cc): the smallest op that
exercises a whole Communicator (LSA stores into the peers' symmetric windows,
ncclDevComm LSA barriers). It is a test, not an op, so it lives in the
module only when built with the test harness (JAX_EP_TESTING=ON), and its
wrapper here rather than in the package."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_ep import _native
from jax_ep._ffi import call as _call

# For tests that call the probe or the harness' device helpers.
needs_harness = pytest.mark.skipif(
    not _native.testing_built(),
    reason="jax_ep was built without its test harness (rebuild with JAX_EP_TESTING=ON, as "
           "scripts/gpu_check.sh does)")


def probe_all_to_all_cuda(x: jax.Array, *, comm_id: int) -> jax.Array:
  """out[s] = x_s[this rank]: `lax.all_to_all(x, axis, 0, 0)` through the
  communicator's symmetric window and LSA barriers.

  Args:
    x: [R, ...] any dtype; row j goes to rank j.
  Returns:
    [R, ...] like x; row s came from rank s.
  """
  if x.ndim < 1:
    raise ValueError("x must have a leading axis of size num_ranks")
  # Every rank must make the same sequence of calls, so a batch under vmap
  # must stay a sequence of whole exchanges.
  return _call("jax_ep_probe_all_to_all", jax.ShapeDtypeStruct(x.shape, x.dtype))(
      x, comm_id=np.int64(comm_id))
