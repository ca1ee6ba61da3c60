"""Virtual EP ranks on one GPU (ffi/testing/loopback.cc, docs/design.md §8).

The normal and low-latency kernels of R ranks, each rank on its own stream,
their windows side by side in one GPU's memory: the multi-rank paths
(counts exchange, barriers, peer stores, chunk signals, emulated GIN) run
where only one GPU is lent. Host arrays in and out, stacked on a leading
rank axis as in tests/oracle.py; no XLA, no NCCL.
"""
from __future__ import annotations

import numpy as np

from jax_ep import _native, _window
from oracle import BF16, F32, FP8

F16 = np.dtype(np.float16)
_DTYPE_CODE = {BF16: 0, F16: 1, F32: 2, FP8: 3}  # ffi/kernels/ep_kernels.h EpDtype
_LAYOUT_CODE = {"rank": 0, "expert": 1}


# What the harness fills every output with before a call (loopback.cc Out).
_FILL_I32 = np.int32(np.uint32(0xA5A5A5A5).view(np.int32))


class LoopbackError(RuntimeError):
  """A kernel reported an error on some virtual rank (status word)."""


class Loopback:
  def __init__(self, nranks: int, window_bytes: int, *, gin_emulated: bool = False,
               timeout_s: float = 10.0, device: int = 0):
    self.R = nranks
    if not _native.testing_built():
      raise RuntimeError("the virtual-rank harness is in jax_ep only when built with "
                         "JAX_EP_TESTING=ON (scripts/gpu_check.sh does)")
    self._m = _native.module()
    self.id = self._m.loopback_create(device, nranks, int(window_bytes), timeout_s, gin_emulated)

  def close(self):
    self._m.loopback_destroy(self.id)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def run(self, op: str, scalars: dict, inputs: list, outputs: dict, *, check: bool = True,
          skip=(), overrides: dict | None = None, refuse=()):
    """inputs: per rank {name: array}; outputs: {name: (shape, dtype)}, the
    same on every rank; scalars: the same on every rank, but for
    `overrides` {rank: {name: value}}; ranks in `skip` do not call the op,
    ranks in `refuse` launch what a handler that refuses it launches
    (kernels/abort.h); neither returns outputs. Returns (per rank {name: array}, per rank
    report)."""
    ins = [{k: np.ascontiguousarray(v).tobytes() for k, v in d.items()} for d in inputs]
    sizes = {k: int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
             for k, (shape, dt) in outputs.items()}
    per_rank = [{k: int(v) for k, v in {**scalars, **(overrides or {}).get(r, {})}.items()}
                for r in range(self.R)]
    outs, reports = self._m.loopback_run(self.id, op, per_rank, ins, sizes, list(skip), list(refuse))
    arrays = [{k: np.frombuffer(o[k], dtype=outputs[k][1]).reshape(outputs[k][0]) for k in o}
              for o in outs]
    if check and any(reports):
      extra = ""
      if op == "dispatch":  # outputs a rank's kernels never wrote keep the 0xA5 fill
        unset = [int(np.sum(a["pos_in_rank"] == _FILL_I32)) if "pos_in_rank" in a else None
                 for a in arrays]
        extra = f"\npos_in_rank entries still at the output fill, per rank: {unset}"
      raise LoopbackError("; ".join(r for r in reports if r) + "\n" +
                          self.describe(per_rank[0] if op == "dispatch" else None) + extra)
    return arrays, reports

  def describe(self, dispatch: dict | None = None) -> str:
    """Each rank's barrier epoch, the barrier flags in its window and its
    non-zero chunk counters (window_layout.h): where a wait stopped. After a
    dispatch (its scalars), also each rank's agreed words (kOk, kSendOk),
    the tokens it sends to each rank and the rows it expects from each."""
    lines, chunks_per_source = [], self._m.chunks_per_source  # window_layout.h
    if dispatch is not None:
      R, E = self.R, dispatch["num_experts"]
      off, fields = _window.dispatch_scratch(num_ranks=R, num_experts=E)
      sends, recvs = fields["tokens_per_rank"], fields["recv_counts"]
    for r in range(self.R):
      epoch = int(np.frombuffer(self._m.loopback_peek(self.id, r, "counters", 0, 8), np.uint64)[0])
      flags = np.frombuffer(self._m.loopback_peek(self.id, r, "window", 0, 8 * self.R), np.uint64)
      cc = np.frombuffer(self._m.loopback_peek(self.id, r, "window", _native.WINDOW_HEADER_BYTES,
                                               4 * self.R * chunks_per_source), np.uint32)
      cc = cc.reshape(self.R, chunks_per_source)
      chunks = {s: [(int(c), int(cc[s, c])) for c in np.nonzero(cc[s])[0][:6]] for s in range(self.R)}
      lines.append(f"rank {r}: epoch {epoch}, barrier flags {[hex(int(f)) for f in flags]}, "
                   f"chunk counters (source: [(chunk, count)]) {chunks}")
      if dispatch is not None:
        sc = np.frombuffer(self._m.loopback_peek(self.id, r, "window", off, 4 * fields["count"]),
                           np.int32)
        lines.append(f"  dispatch scratch: ok {sc[fields['ok']]}, bad ids {sc[fields['bad_ids']]}, "
                     f"send ok {sc[fields['send_ok']]}, "
                     f"tokens to each rank {sc[sends:sends + R].tolist()}, "
                     f"rows from each rank {sc[recvs:recvs + R].tolist()}")
    return "\n".join(lines)

  def dispatch(self, payload: tuple, idx, w, *, E: int, C: int, layout: str, align: int = 1,
               cast_fp8: bool = False, ue8m0: bool = False, num_sms: int = 0, check: bool = True,
               skip=(), overrides: dict | None = None, refuse=()):
    """payload: (x[R, T, H],) or an FP8 pair (q, scales[R, T, H/128]);
    idx / w [R, T, K]. Returns per rank the dispatch's outputs by their FFI
    names (ffi/handlers/dispatch.cc)."""
    R, T, K = idx.shape
    x = payload[0]
    H = x.shape[2]
    fp8 = x.dtype == FP8 or cast_fp8
    El = E // R
    meta = (C, K) if layout == "rank" else (C,)
    outputs = dict(
        recv_x=((C, H), FP8 if fp8 else x.dtype), recv_topk_idx=(meta, np.int32),
        recv_topk_weights=(meta, np.float32),
        counts=((R,) if layout == "rank" else (El,), np.int32),
        pos_in_rank=((T, R), np.int32), recv_src_rank=((C,), np.int32),
        recv_src_token=((C,), np.int32), recv_src_k=((C,), np.int32),
        recv_counts=((R,), np.int32))
    if fp8:
      outputs["recv_scales"] = ((C, H // 128), np.float32)
    inputs = []
    for r in range(R):
      d = dict(x=x[r], topk_idx=idx[r].astype(np.int32), topk_weights=w[r].astype(np.float32))
      if len(payload) > 1:
        d["x_scales"] = payload[1][r].astype(np.float32)
      inputs.append(d)
    scalars = dict(x_dtype=_DTYPE_CODE[np.dtype(x.dtype)], cast_fp8=cast_fp8, ue8m0=ue8m0,
                   num_tokens=T, hidden=H, topk=K, num_experts=E, capacity=C,
                   expert_alignment=align, layout=_LAYOUT_CODE[layout], num_sms=num_sms)
    return self.run("dispatch", scalars, inputs, outputs, check=check, skip=skip, overrides=overrides,
                    refuse=refuse)

  def combine(self, y, weights, handles: list, idx, *, E: int, layout: str, num_sms: int = 0,
              check: bool = True, skip=(), overrides: dict | None = None, refuse=()):
    """y [R, C, H]; weights [R, C] or None; handles: per rank the dispatch's
    outputs (pos_in_rank, recv_src_*, recv_counts); idx [R, T, K]."""
    R, C, H = y.shape
    T, K = idx.shape[1:]
    names = ("pos_in_rank", "recv_src_rank", "recv_src_token", "recv_src_k", "recv_counts")
    inputs = []
    for r in range(R):
      d = dict(y=y[r], topk_idx=idx[r].astype(np.int32), **{n: handles[r][n] for n in names})
      if weights is not None:
        d["weights"] = weights[r].astype(np.float32)
      inputs.append(d)
    scalars = dict(y_dtype=_DTYPE_CODE[np.dtype(y.dtype)], num_tokens=T, hidden=H, topk=K,
                   num_experts=E, capacity=C, layout=_LAYOUT_CODE[layout], num_sms=num_sms)
    outs, reports = self.run("combine", scalars, inputs, dict(out=((T, H), y.dtype)), check=check, skip=skip,
                             overrides=overrides, refuse=refuse)
    if skip or refuse:
      return [o.get("out") for o in outs], reports
    return np.stack([o["out"] for o in outs]), reports

  def engram(self, table, indices, *, num_sms: int = 0, check: bool = True, overrides: dict | None = None,
             refuse=()):
    """Publish then fetch (with emulated GIN the fetch exchanges requests
    and answers, engram_gin.cu). table [V, D], rank s holding rows [s V/R,
    (s+1) V/R); indices [R, T, e] global ids in [-1, V). Returns (rows [R,
    T, e, D], tokens [R], reports); with `refuse` (ranks whose handler
    refuses the call) per-rank lists, None for those ranks."""
    R = self.R
    V, D = table.shape
    rpr = V // R
    shards = table.reshape(R, rpr, D)
    n = int(np.prod(indices.shape[1:]))
    inputs = [dict(table=shards[r], indices=indices[r].astype(np.int32).reshape(-1)) for r in range(R)]
    scalars = dict(rows_per_rank=rpr, row_bytes=D * table.dtype.itemsize, num_rows=n, num_sms=num_sms)
    outs, reports = self.run("engram", scalars, inputs,
                             dict(rows=((n, D), table.dtype), token=((1,), np.int32)), check=check,
                             overrides=overrides, refuse=refuse)
    if refuse:
      return ([o["rows"].reshape(indices.shape[1:] + (D,)) if "rows" in o else None for o in outs],
              [o["token"][0] if "token" in o else None for o in outs], reports)
    rows = np.stack([o["rows"].reshape(indices.shape[1:] + (D,)) for o in outs])
    return rows, np.array([o["token"][0] for o in outs]), reports

  def ll_dispatch(self, x, idx, *, E: int, max_tokens: int, fp8: bool = False, ue8m0: bool = False,
                  check: bool = True, overrides: dict | None = None, refuse=()):
    """x [R, T, H] bf16, idx [R, T, K] -> per rank recv_x [E_l, R*M, H],
    recv_scales (FP8), recv_count [E_l], src_entry [E_l, R*M]."""
    R, T, K = idx.shape
    H = x.shape[2]
    El, RM = E // R, R * max_tokens
    outputs = dict(recv_x=((El, RM, H), FP8 if fp8 else BF16), recv_count=((El,), np.int32),
                   src_entry=((El, RM), np.int32))
    if fp8 or any(o.get("fp8") for o in (overrides or {}).values()):
      outputs["recv_scales"] = ((El, RM, H // 128), np.float32)
    inputs = [dict(x=x[r], topk_idx=idx[r].astype(np.int32)) for r in range(R)]
    scalars = dict(num_tokens=T, max_tokens=max_tokens, hidden=H, topk=K, num_experts=E, fp8=fp8,
                   ue8m0=ue8m0)
    return self.run("ll_dispatch", scalars, inputs, outputs, check=check, overrides=overrides,
                    refuse=refuse)

  def ll_combine(self, y, idx, w, handles: list, *, E: int, max_tokens: int, check: bool = True,
                 overrides: dict | None = None, refuse=()):
    """y [R, E_l, R*M, H] bf16; handles: ll_dispatch's outputs per rank."""
    R, T, K = idx.shape
    H = y.shape[3]
    inputs = [dict(y=y[r], src_entry=handles[r]["src_entry"], recv_count=handles[r]["recv_count"],
                   topk_idx=idx[r].astype(np.int32), topk_weights=w[r].astype(np.float32))
              for r in range(R)]
    scalars = dict(num_tokens=T, max_tokens=max_tokens, hidden=H, topk=K, num_experts=E)
    outs, reports = self.run("ll_combine", scalars, inputs, dict(out=((T, H), BF16)), check=check,
                             overrides=overrides, refuse=refuse)
    if refuse:
      return [o.get("out") for o in outs], reports
    return np.stack([o["out"] for o in outs]), reports
