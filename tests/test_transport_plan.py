"""The per-peer transport choice Communicator.create makes (LSA inside NCCL's
NVLink team, GIN beyond it, an error naming the peer and the reason when
neither), as the pure function the C++ side uses. Needs the CUDA build, no GPU."""
from __future__ import annotations

import pytest

from jax_ep import _native

pytestmark = pytest.mark.skipif(not _native.cuda_built(), reason="needs jax_ep's CUDA build")

NCCL_2_28_9 = 22809


def plan(rank, lsa, *, force=False, gin="not_built", version=NCCL_2_28_9):
  return _native.module().transport_plan(rank, [int(m) for m in lsa], force, gin, version)


def test_one_nvlink_domain_needs_no_gin_even_in_a_build_without_it():
  for rank in range(4):
    names, mask, err = plan(rank, [1, 1, 1, 1])
    assert names == ["self" if j == rank else "lsa" for j in range(4)]
    assert mask == 0 and err == ""


def test_peers_outside_the_lsa_team_go_over_gin_when_the_communicator_has_it():
  names, mask, err = plan(1, [1, 1, 0, 0], gin="available")
  assert names == ["lsa", "self", "gin", "gin"]
  assert mask == 0b1100 and err == ""


def test_nccl_2_28_cannot_tell_beforehand_so_the_plan_defers_to_devcomm_creation():
  names, mask, err = plan(3, [0, 0, 1, 1], gin="untested")
  assert names == ["gin", "gin", "lsa", "self"] and mask == 0b0011 and err == ""


@pytest.mark.parametrize("gin,why", [
    ("not_built", "built without NCCL's GIN device API"),
    ("no_device", "no GIN-capable network device"),
    ("rail_only", "same rail"),
])
def test_a_remote_peer_without_gin_is_an_error_naming_peer_reason_and_remedy(gin, why):
  names, mask, err = plan(0, [1, 1, 0, 0], gin=gin, version=23007)
  assert mask == 0b1100
  assert err.startswith("jax_ep: no transport from EP rank 0 ") and "to EP rank 2:" in err
  assert "2 of 4 ranks" in err and "GIN" in err and why in err
  assert "NCCL 2.30.7" in err and "one NVLink domain" in err
  assert "JAX_EP_TRANSPORT" not in err


def test_forcing_gin_moves_every_remote_peer_and_says_how_to_undo_it():
  names, mask, err = plan(2, [1, 1, 1], force=True, gin="available")
  assert names == ["gin", "gin", "self"] and mask == 0b011 and err == ""
  _, _, err = plan(1, [1, 1], force=True, gin="no_device")
  assert "to EP rank 0:" in err and "transport 'gin'" in err
  assert "transport='auto'" in err and "JAX_EP_TRANSPORT" not in err and "NCCL 2.28.9" in err


def test_a_single_rank_group_has_only_itself():
  assert plan(0, [1], force=True) == (["self"], 0, "")


def test_bad_arguments_are_rejected():
  with pytest.raises(ValueError):
    plan(2, [1, 1])
  with pytest.raises(ValueError, match="GIN support"):
    plan(0, [1, 0], gin="maybe")


def test_emulated_gin_puts_every_remote_peer_on_gin_without_asking_for_a_nic():
  # transport="gin_emulated": the GIN code path over NVLink, so neither a
  # GIN build nor a GIN device matters.
  for gin in ("not_built", "no_device", "rail_only", "available"):
    names, mask, err = _native.module().transport_plan(2, [1, 1, 1, 1], False, gin, NCCL_2_28_9,
                                                        emulate=True)
    assert names == ["gin", "gin", "self", "gin"] and mask == 0b1011 and err == "", gin


def test_emulated_gin_needs_every_peer_in_the_lsa_team():
  names, mask, err = _native.module().transport_plan(0, [1, 1, 0], False, "available", NCCL_2_28_9,
                                                      emulate=True)
  assert names == ["self", "gin", "gin"] and mask == 0b110
  assert err.startswith("jax_ep: no transport from EP rank 0 ") and "to EP rank 2:" in err
  assert "transport 'gin_emulated'" in err and "NVLink" in err
  assert "transport='auto'" in err and "JAX_EP_TRANSPORT" not in err


def test_emulated_gin_on_a_single_rank_group_has_only_itself():
  assert _native.module().transport_plan(0, [1], False, "not_built", NCCL_2_28_9,
                                         emulate=True) == (["self"], 0, "")
