"""The NCCL unique id of each EP group travels under the group's mesh-wide
index, so processes that hold devices of different groups agree on it
(simulated: fake devices, a dict as the key-value store, no GPU)."""
from __future__ import annotations

import types

import jax

from jax_ep import comm


class _Store:
  def __init__(self):
    self.kv = {}

  def key_value_set(self, key, value):
    assert key not in self.kv, f"{key} published twice"
    self.kv[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    return self.kv[key]


def test_each_group_id_is_shared_under_its_mesh_wide_index(monkeypatch):
  dev = [types.SimpleNamespace(process_index=p) for p in range(4)]
  groups = [[dev[0], dev[2]], [dev[1], dev[3]]]  # group g's rank 0 lives in process g
  store = _Store()
  counter = iter(range(100))
  monkeypatch.setattr(comm, "_kv_client", lambda: store)
  monkeypatch.setattr(comm._native, "module",
                      lambda: types.SimpleNamespace(get_unique_id=lambda: b"id%d" % next(counter)))
  got = {}
  for pid in (0, 1, 2, 3):  # publishers (0, 1) before readers (2, 3)
    monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
    mine = [(gi, g) for gi, g in enumerate(groups) if any(d.process_index == pid for d in g)]
    got[pid] = comm._share_unique_ids(mine, seq=0, timeout_s=1.0)
  assert got[0] == got[2] == [b"id0"]
  assert got[1] == got[3] == [b"id1"]
