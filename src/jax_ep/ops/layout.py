"""`get_dispatch_layout`: per-rank and per-expert token counts."""
from __future__ import annotations

from typing import Optional

import jax

from jax_ep import reference as ref
from jax_ep._checks import check_routing, check_sms
from jax_ep._ffi import layout as ffi
from jax_ep._types import Layout
from jax_ep.ops import _backend


def get_dispatch_layout(topk_idx: jax.Array, *, num_experts: int, axis_name: str = "ep",
                        num_sms: Optional[int] = 0, backend: Optional[str] = None) -> Layout:
  """Counts this rank's routing (inside shard_map over `axis_name`).

  Args:
    topk_idx: [T, K] int32 expert ids, -1 for none.
    num_sms: CUDA: at most this many SMs (0 or None: the kernel's own, one
      CTA). The reference ignores it.
  Returns:
    Layout(num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32,
    is_token_in_rank [T, R] bool). A token counts once per rank even if
    several of its experts live there; per expert, once per (token, k).
  """
  num_ranks = ref.axis_size(axis_name)
  check_routing(topk_idx, None, num_tokens=topk_idx.shape[0], num_experts=num_experts,
                num_ranks=num_ranks)
  sms = check_sms(num_sms)

  def reference(idx):
    layout = ref.get_dispatch_layout(idx, num_experts=num_experts, axis_name=axis_name)
    return ref._check_ids("get_dispatch_layout", idx, num_experts, axis_name, layout)

  choice = _backend.choose(backend, op="get_dispatch_layout", axis_name=axis_name)

  def kernel(idx):
    per_rank, per_expert, in_rank, _ = ffi.layout(idx, num_experts=num_experts,
                                                  num_ranks=num_ranks, comm_id=choice.comm_id,
                                                  num_sms=sms)
    return Layout(per_rank, per_expert, in_rank)

  return _backend.run(choice, reference, kernel, topk_idx)
