"""The kernels' multi-rank paths on one GPU: 2, 4 and 8 virtual ranks
(tests/loopback.py), LSA and emulated GIN, against the NumPy oracle, bitwise:
every dispatch output (rows, FP8 scales, routing metadata, counts and the
whole handle, padding included: the harness fills outputs with 0xA5 first)
and the combine in its fixed f32 order; the low-latency kernels' counts,
source entries, valid rows and combine; Engram publish + fetch from every
shard (over emulated GIN by request and answer). And the failures a peer must report, not wait out: a bad expert id
or Engram index on one rank, a configuration that differs between ranks
(named, both values), a rank that never calls (reported within the
timeout).

What this does not cover: NVLink itself (peer windows are local memory, so a
missing fence may pass here), NCCL's windows and XLA. test_gpu_dispatch.py
and test_gpu_gin_emulated.py run the same kernels across two GPUs."""
from __future__ import annotations

import time

import numpy as np
import pytest

from jax_ep import _native
import oracle
from oracle import BF16, F32, stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _native.cuda_available(), reason="needs jax_ep's CUDA build and a GPU"),
    pytest.mark.skipif(not _native.testing_built(),
                       reason="the virtual-rank harness is not in this build of jax_ep "
                              "(rebuild with JAX_EP_TESTING=ON, as scripts/gpu_check.sh does)"),
]

if _native.cuda_available():
  from jax_ep import _window
  from loopback import Loopback

DTYPES = {"bf16": BF16, "f16": np.dtype(np.float16), "f32": F32}


def _data_sms(R: int) -> int:
  """Data-kernel CTAs per rank: every rank's waiting CTAs must be resident
  together on one GPU (132 SMs on an H200), so 12 each at 8 ranks; the
  model's default (24) below that."""
  return 12 if R > 4 else 0


def _inputs(rng, R, T, H, K, E, dtype, mode):
  idx, w = oracle.make_topk(rng, R, T, K, E, mode=mode)
  if dtype == "fp8_pair":
    return oracle.make_fp8_tuple(rng, R, T, H), idx, w
  return (oracle.make_x(rng, (R, T, H), DTYPES[dtype]),), idx, w


def _normal_window(R, T, H, K, E, x_bytes, fp8, y_bytes=4):
  return _window.normal_bytes(num_ranks=R, tokens_per_rank=T, hidden=H, topk=K,
                                           num_experts=E, x_bytes=x_bytes, fp8=fp8, y_bytes=y_bytes)


def _eq(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
  if np.array_equal(oracle.bits(got), oracle.bits(want)):
    return
  bad = oracle.bits(got) != oracle.bits(want)
  rows = np.unique(np.nonzero(bad.reshape(bad.shape[0], -1) if bad.ndim > 1 else bad)[0])
  raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements differ, rows {rows[:12].tolist()}"
                       f"{' ...' if rows.size > 12 else ''}")


def _check_dispatch(outs, disp, hd, layout, fp8):
  for r, (got, d) in enumerate(zip(outs, disp)):
    pad = f" (rank {r}, {d.num_rows} rows used)"
    _eq(got["recv_x"], d.payload[0], "recv_x" + pad)
    if fp8:
      _eq(got["recv_scales"], d.payload[1], "recv_scales" + pad)
    _eq(got["recv_topk_idx"], d.topk_idx, "recv_topk_idx" + pad)
    _eq(got["recv_topk_weights"], d.topk_weights, "recv_topk_weights" + pad)
    _eq(got["counts"], d.counts if layout == "rank" else d.group_sizes, "counts" + pad)
    for name in ("recv_src_rank", "recv_src_token", "recv_src_k", "recv_counts", "pos_in_rank"):
      _eq(got[name], hd[name][r], name + pad)


def _capacity(R, T, K, E, layout, align=1):
  """The oracle's default capacity, at least 1 (zero tokens)."""
  if layout == "rank":
    return max(1, oracle.default_capacity_rank(R, T))
  return max(1, oracle.default_capacity_expert(R, T, K, E // R, align))


def _round(lb, rng, T, H, K, E, dtype, mode, layout, *, align=1, cast_fp8=False, weighted=True):
  """One dispatch -> combine against the oracle."""
  R = lb.R
  payload, idx, w = _inputs(rng, R, T, H, K, E, dtype, mode)
  C = _capacity(R, T, K, E, layout, align)
  want_payload = oracle.quantize_fp8(payload[0]) if cast_fp8 else payload
  if layout == "rank":
    disp = oracle.dispatch_rank(want_payload, idx, w, E, C)
  else:
    disp = oracle.dispatch_expert(want_payload, idx, w, E, align, C)
  outs, _ = lb.dispatch(payload, idx, w, E=E, C=C, layout=layout, align=align, cast_fp8=cast_fp8,
                        num_sms=_data_sms(R))
  _check_dispatch(outs, disp, oracle.dispatch_handle(disp, idx, E, layout, C), layout,
                  fp8=dtype == "fp8_pair" or cast_fp8)

  ydt = BF16 if dtype == "fp8_pair" else DTYPES[dtype]
  y = oracle.make_x(rng, (R, C, payload[0].shape[2]), ydt)
  cw = rng.uniform(0.25, 1.5, size=(R, C)).astype(np.float32) if weighted else None
  got, _ = lb.combine(y, cw, outs, idx, E=E, layout=layout, num_sms=_data_sms(R))
  rows = [d.rows for d in disp]
  oracle.assert_fixed_order_exact(got, lambda m: oracle.combine(y, rows, cw, T, mode=m),
                                  f"combine R={R} {layout}")


CASES = [
    # R, T, H, K, E, dtype, mode
    (2, 0, 128, 1, 8, "bf16", "random"),
    (2, 1, 128, 1, 8, "bf16", "random"),
    (2, 127, 2048, 8, 64, "bf16", "random"),
    (2, 127, 128, 6, 8, "bf16", "skewed"),
    (2, 127, 2048, 8, 64, "bf16", "empty_rank"),
    (2, 127, 7168, 8, 256, "f16", "random"),
    (2, 64, 2048, 8, 256, "f32", "random"),
    (2, 127, 2048, 8, 256, "fp8_pair", "random"),
    (2, 1024, 7168, 8, 256, "bf16", "random"),   # several chunks from each peer
    (4, 127, 2048, 8, 64, "bf16", "random"),
    (4, 127, 2048, 8, 64, "bf16", "empty_rank"),
    (4, 127, 2048, 8, 64, "fp8_pair", "random"),
    (4, 127, 256, 4, 12, "bf16", "all_invalid"),
    (8, 64, 512, 8, 64, "bf16", "random"),
    (8, 33, 256, 3, 16, "f32", "skewed"),
]


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("R,T,H,K,E,dtype,mode", CASES)
def test_dispatch_combine_at_several_ranks_bitwise_equal_oracle(R, T, H, K, E, dtype, mode, layout):
  rng = np.random.default_rng(stable_seed("loopback", R, T, H, K, E, dtype, mode, layout))
  fp8 = dtype == "fp8_pair"
  with Loopback(R, _normal_window(R, T, H, K, E, 1 if fp8 else DTYPES[dtype].itemsize, fp8)) as lb:
    _round(lb, rng, T, H, K, E, dtype, mode, layout)


@pytest.mark.parametrize("layout", ["rank", "expert"])
@pytest.mark.parametrize("R,T,H,K,E,dtype,mode", [
    (2, 127, 2048, 8, 64, "bf16", "random"),
    (2, 1024, 7168, 8, 256, "bf16", "random"),
    (2, 127, 2048, 8, 256, "fp8_pair", "random"),
    (4, 127, 2048, 8, 64, "bf16", "empty_rank"),
    (8, 64, 512, 8, 64, "bf16", "random"),
])
def test_emulated_gin_at_several_ranks_bitwise_equal_oracle(R, T, H, K, E, dtype, mode, layout):
  rng = np.random.default_rng(stable_seed("loopback-gin", R, T, H, K, E, dtype, mode, layout))
  fp8 = dtype == "fp8_pair"
  with Loopback(R, _normal_window(R, T, H, K, E, 1 if fp8 else DTYPES[dtype].itemsize, fp8),
                gin_emulated=True) as lb:
    _round(lb, rng, T, H, K, E, dtype, mode, layout)


@pytest.mark.parametrize("R,layout,align,cast", [(2, "expert", 4, False), (2, "rank", 1, True),
                                                 (4, "expert", 8, True)])
def test_alignment_and_in_kernel_fp8_cast(R, layout, align, cast):
  rng = np.random.default_rng(stable_seed("loopback-align", R, layout, align, cast))
  T, H, K, E = 127, 2048, 8, 64
  with Loopback(R, _normal_window(R, T, H, K, E, 2, cast)) as lb:
    _round(lb, rng, T, H, K, E, "bf16", "random", layout, align=align, cast_fp8=cast)


def test_unweighted_combine_and_many_rounds_no_drift():
  """60 rounds on one loopback, layouts alternating, fresh routing each:
  window areas and epochs reused across ops as a training loop does."""
  R, T, H, K, E = 2, 256, 1024, 8, 64
  rng = np.random.default_rng(stable_seed("loopback-rounds"))
  with Loopback(R, _normal_window(R, T, H, K, E, 2, False)) as lb:
    for i in range(60):
      _round(lb, rng, T, H, K, E, "bf16", "random", ("rank", "expert")[i % 2], weighted=i % 3 != 0)


def test_bad_expert_id_on_one_rank_is_reported_then_next_call_works():
  R, T, H, K, E = 2, 64, 256, 4, 16
  rng = np.random.default_rng(stable_seed("loopback-bad-id"))
  with Loopback(R, _normal_window(R, T, H, K, E, 2, False)) as lb:
    payload, idx, w = _inputs(rng, R, T, H, K, E, "bf16", "random")
    idx[1, 5, 0] = E + 3
    for layout in ("rank", "expert"):
      C = _capacity(R, T, K, E, layout)
      _, reports = lb.dispatch(payload, idx, w, E=E, C=C, layout=layout, check=False)
      assert "expert id" in reports[1], reports
      _round(lb, rng, T, H, K, E, "bf16", "random", layout)


def test_a_misspelt_argument_is_an_error():
  with Loopback(2, 1 << 20) as lb:
    with pytest.raises(ValueError, match="unknown name 'hiden'"):
      lb.run("dispatch", dict(hiden=128), [{}, {}], {})


LL_CASES = [
    # R, T, H, K, E, max_tokens, fp8
    (2, 128, 7168, 8, 256, 128, True),   # docs/design.md §6 low-latency shape
    (2, 128, 7168, 8, 256, 128, False),
    (2, 37, 2048, 6, 64, 64, True),
    (2, 1, 128, 1, 8, 4, False),
    (2, 0, 128, 2, 8, 4, False),
    (4, 37, 2048, 6, 64, 64, False),
    (8, 16, 1024, 8, 64, 16, True),
]


def _ll_round(lb, rng, T, H, K, E, mt, fp8, what):
  """One low-latency dispatch -> combine on fresh inputs against the oracle."""
  R = lb.R
  idx, w = oracle.make_topk(rng, R, T, K, E)
  x = oracle.make_x(rng, (R, T, H), BF16)
  outs, _ = lb.ll_dispatch(x, idx, E=E, max_tokens=mt, fp8=fp8)
  payload = oracle.quantize_fp8(x) if fp8 else (x,)
  disp = oracle.low_latency_dispatch(payload, idx, E, mt)
  entries = oracle.low_latency_src_entry(disp, T, K, mt)
  for r, (got, d) in enumerate(zip(outs, disp)):
    _eq(got["recv_count"], d.count, f"{what} rank {r} recv_count")
    _eq(got["src_entry"], entries[r], f"{what} rank {r} src_entry")
    valid = np.arange(R * mt)[None, :] < d.count[:, None]
    _eq(got["recv_x"][valid], d.payload[0][valid], f"{what} rank {r} recv_x (valid rows)")
    if fp8:
      _eq(got["recv_scales"][valid], d.payload[1][valid], f"{what} rank {r} recv_scales")
  y = oracle.make_x(rng, (R, E // R, R * mt, H), BF16)
  got, _ = lb.ll_combine(y, idx, w, outs, E=E, max_tokens=mt)
  oracle.assert_fixed_order_exact(
      got, lambda m: oracle.low_latency_combine(y, idx, w, disp, mode=m), f"ll combine R={R} {what}")


def _ll_rounds(seed, R, T, H, K, E, mt, fp8, gin=False):
  """Three rounds (both of the kernels' double buffers, and back to the
  first) on one harness, every peer over emulated GIN with `gin`."""
  rng = np.random.default_rng(stable_seed(seed, R, T, H, K, E, mt, fp8))
  nbytes = _window.low_latency_bytes(num_ranks=R, max_tokens=mt, hidden=H, topk=K,
                                     num_experts=E, gin=gin)
  with Loopback(R, nbytes, gin_emulated=gin) as lb:
    for rnd in range(3):
      _ll_round(lb, rng, T, H, K, E, mt, fp8, f"round {rnd}")


@pytest.mark.parametrize("R,T,H,K,E,mt,fp8", LL_CASES)
def test_low_latency_kernels_at_several_ranks_bitwise_equal_oracle(R, T, H, K, E, mt, fp8):
  _ll_rounds("loopback-ll", R, T, H, K, E, mt, fp8)


@pytest.mark.parametrize("R,T,H,K,E,mt,fp8", [
    (2, 128, 7168, 8, 256, 128, True),   # docs/design.md §6 low-latency shape
    (2, 37, 2048, 6, 64, 64, False),
    (2, 0, 128, 2, 8, 4, False),
    (4, 37, 2048, 6, 64, 64, True),
    (4, 16, 1024, 8, 64, 16, False),
    (8, 16, 1024, 8, 64, 16, True),
    (8, 33, 512, 4, 32, 40, False),
])
def test_low_latency_kernels_over_emulated_gin_at_several_ranks_bitwise_equal_oracle(
    R, T, H, K, E, mt, fp8):
  """low_latency_peers.cuh's GIN path: every peer a GIN peer, so rows, source
  entries and count / flag words go through the staging area and puts, and
  a receiver reads a peer's words only after its call's signal."""
  _ll_rounds("loopback-ll-gin", R, T, H, K, E, mt, fp8, gin=True)


def _engram_window(R, rpr, D, itemsize, rows, transport):
  """A window for one table and, over emulated GIN, the fetch's
  request/answer scratch below it (engram_layout.h EngramGinArea)."""
  gin = transport == "gin_emulated" and R > 1
  return (1 << 20) + _window.engram_bytes(rows_per_rank=rpr, dim=D * itemsize, dtype=np.uint8,
                                          gin_ranks=R if gin else 0, gin_rows=rows)


TRANSPORTS = ["lsa", "gin_emulated"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("R,rpr,D,dtype,T,e,mode", [
    (2, 524288, 128, "bf16", 512, 24, "random"),   # docs/design.md §6 Engram shape
    (2, 4096, 64, "f32", 64, 8, "one_owner"),
    (4, 4096, 128, "bf16", 33, 5, "repeated"),
    (8, 1024, 8, "bf16", 16, 3, "random"),
    (8, 1000, 64, "f32", 37, 7, "one_owner"),
])
def test_engram_fetch_from_every_shard_bitwise_equal_oracle(R, rpr, D, dtype, T, e, mode, transport):
  """Over emulated GIN every other rank is a GIN owner: its rows come by
  request and answer (engram_gin.cu), this rank's own by loads."""
  rng = np.random.default_rng(stable_seed("loopback-engram", R, rpr, D, dtype, T, e, mode))
  V = R * rpr
  table = oracle.make_x(rng, (V, D), DTYPES[dtype])
  idx = rng.integers(0, V, size=(R, T, e)).astype(np.int32)
  if mode == "one_owner":      # every lookup to the last rank's shard
    idx = rng.integers((R - 1) * rpr, V, size=(R, T, e)).astype(np.int32)
  elif mode == "repeated":
    idx[:, :, 1:] = idx[:, :, :1]
  idx[rng.random(idx.shape) < 0.1] = -1
  nbytes = _engram_window(R, rpr, D, table.dtype.itemsize, T * e, transport)
  with Loopback(R, nbytes, gin_emulated=transport == "gin_emulated") as lb:
    for rnd in range(2):  # the second reuses the exchange's scratch and counts
      rows, tokens, _ = lb.engram(table, idx)
      assert (tokens > 0).all(), tokens
      _eq(rows, oracle.engram_fetch(table, idx), f"engram rows, round {rnd}")


@pytest.mark.parametrize("R,transport", [(2, "lsa"), (2, "gin_emulated"), (4, "gin_emulated")])
def test_engram_republished_tables_never_read_stale_and_a_bad_index_is_reported(R, transport):
  rpr, D, T, e = 2048, 64, 32, 4
  rng = np.random.default_rng(stable_seed("loopback-engram-rounds", R, transport))
  V = R * rpr
  with Loopback(R, _engram_window(R, rpr, D, 2, T * e, transport),
                gin_emulated=transport == "gin_emulated") as lb:
    last = None
    for i in range(40):
      table = oracle.make_x(rng, (V, D), BF16)
      idx = rng.integers(-1, V, size=(R, T, e)).astype(np.int32)
      if i % 10 == 9:  # an index past the table on rank 1: reported, its row zero
        idx[1, 3, 2] = V + 7
        rows, tokens, reports = lb.engram(table, idx, check=False)
        assert "index" in reports[1], reports
        want = oracle.engram_fetch(table, np.where(idx >= V, -1, idx))
      else:
        rows, tokens, _ = lb.engram(table, idx)
        want = oracle.engram_fetch(table, idx)
      _eq(rows, want, f"round {i}")
      if last is not None:
        assert (tokens > last).all(), (tokens, last)  # each publish a new version
      last = tokens


# Last in the module: a wait that never ended would stop the run here (the
# watchdog), after every other test has reported.

@pytest.mark.parametrize("field,here,there", [("hidden", 256, 512), ("topk", 2, 4),
                                              ("num_experts", 16, 32), ("num_tokens", 32, 64)])
def test_a_configuration_mismatch_across_ranks_names_both_values_then_next_call_works(field, here, there):
  R, T, H, K, E = 2, 64, 512, 4, 32
  rng = np.random.default_rng(stable_seed("loopback-mismatch", field))
  with Loopback(R, _normal_window(R, T, H, K, E, 2, False)) as lb:
    payload, idx, w = _inputs(rng, R, T, H, K, 16, "bf16", "random")  # ids valid for E = 16 and 32
    scalar = {"num_tokens": T, "hidden": H, "topk": K, "num_experts": E}
    assert scalar[field] == there
    _, reports = lb.dispatch(payload, idx, w, E=E, C=R * T, layout="rank", check=False,
                             overrides={0: {field: here}})
    name = {"num_tokens": "tokens per rank"}.get(field, field)
    assert f"{name} {here} here, {there} on EP rank 1" in reports[0], reports
    assert f"{name} {there} here, {here} on EP rank 0" in reports[1], reports
    _round(lb, rng, T, H, K, E, "bf16", "random", "rank")


_FORMAT = "format (payload bytes | fp8 << 8 | expert layout << 16)"  # ffi/runtime/status.cc ConfigMismatchDetail
_CALL = dict(dtype="bf16", cast_fp8=False, layout="rank")


def _format_word(dtype, cast_fp8, layout):
  """The format field of ffi/kernels/config_check.cuh's record (dispatch.cu)."""
  fp8 = dtype == "fp8_pair" or cast_fp8
  return (1 if fp8 else DTYPES[dtype].itemsize) | (int(fp8) << 8) | (int(layout == "expert") << 16)


@pytest.mark.parametrize("rank0", [
    dict(dtype="f32"), dict(dtype="fp8_pair"), dict(cast_fp8=True), dict(layout="expert"),
    pytest.param(dict(dtype="f16"), marks=pytest.mark.xfail(
        strict=True, reason="the record holds the payload's bytes per element, not its dtype: "
                            "bf16 against f16 is not detected (config_check.cuh)")),
], ids=["f32", "fp8_pair", "cast_fp8", "expert_layout", "f16"])
def test_a_payload_format_mismatch_across_ranks_names_both_values_then_next_call_works(rank0):
  """docs/errors.md (its table), the payload's dtype / format: rank 0 calls dispatch
  with another dtype, FP8 (as a pair or cast in the kernel) or the expert
  layout, rank 1 with bf16 in the rank layout, each with inputs of its own
  (outputs sized for the larger). Both name the format words, then a
  dispatch + combine in rank 0's configuration on both ranks works."""
  import loopback as lbmod
  R, T, H, K, E = 2, 64, 512, 4, 32
  rng = np.random.default_rng(stable_seed("loopback-format-mismatch", *sorted(rank0.items())))
  calls = [dict(_CALL, **rank0), dict(_CALL)]
  words = [_format_word(**c) for c in calls]
  window = max(_normal_window(R, T, H, K, E, 4, False), _normal_window(R, T, H, K, E, 2, True))
  with Loopback(R, window) as lb:
    _, idx, w = _inputs(rng, R, T, H, K, E, "bf16", "random")
    inputs, overrides, caps = [], {}, []
    for r, c in enumerate(calls):
      payload = _inputs(rng, 1, T, H, K, E, c["dtype"], "random")[0]
      d = dict(x=payload[0][0], topk_idx=idx[r].astype(np.int32), topk_weights=w[r].astype(np.float32))
      if len(payload) > 1:
        d["x_scales"] = payload[1][0].astype(np.float32)
      inputs.append(d)
      caps.append(_capacity(R, T, K, E, c["layout"]))
      x_dtype = oracle.FP8 if c["dtype"] == "fp8_pair" else DTYPES[c["dtype"]]
      overrides[r] = dict(x_dtype=lbmod._DTYPE_CODE[np.dtype(x_dtype)], cast_fp8=int(c["cast_fp8"]),
                          layout=lbmod._LAYOUT_CODE[c["layout"]], capacity=caps[r])
    C = max(caps)
    outputs = dict(recv_x=((C, H), F32), recv_scales=((C, H // 128), F32),
                   recv_topk_idx=((C, K), np.int32), recv_topk_weights=((C, K), np.float32),
                   counts=((max(R, E // R),), np.int32), pos_in_rank=((T, R), np.int32),
                   recv_src_rank=((C,), np.int32), recv_src_token=((C,), np.int32),
                   recv_src_k=((C,), np.int32), recv_counts=((R,), np.int32))
    scalars = dict(overrides[1], ue8m0=0, num_tokens=T, hidden=H, topk=K, num_experts=E,
                   expert_alignment=1, num_sms=0)
    _, reports = lb.run("dispatch", scalars, inputs, outputs, check=False, overrides=overrides)
    for r in range(R):
      assert "another configuration" in reports[r], reports
    assert f"{_FORMAT} {words[0]} here, {words[1]} on EP rank 1" in reports[0], reports
    assert f"{_FORMAT} {words[1]} here, {words[0]} on EP rank 0" in reports[1], reports
    _round(lb, rng, T, H, K, E, calls[0]["dtype"], "random", calls[0]["layout"],
           cast_fp8=calls[0]["cast_fp8"])
    _round(lb, rng, T, H, K, E, "bf16", "random", "rank")


def _both_named(reports, name, here, there):
  """Rank 0 called with `here`, rank 1 with `there`: each names both."""
  assert f"{name} {here} here, {there} on EP rank 1" in reports[0], reports
  assert f"{name} {there} here, {here} on EP rank 0" in reports[1], reports


# Fields whose difference reaches combine's checks first (the handle's rows
# are checked before the ok word): the number of tokens and the expert
# layout are covered by dispatch's test above, where they differ first.
@pytest.mark.parametrize("field,here,there", [("hidden", 256, 512), ("topk", 2, 4), ("num_experts", 16, 32)])
def test_a_combine_configuration_mismatch_names_both_values_then_next_call_works(field, here, there):
  """The digest in combine's ok words (config_check.cuh): both ranks stop
  before any row moves, name the field, and rank 1 returns zeros."""
  R, T, H, K, E = 2, 64, 512, 4, 32
  rng = np.random.default_rng(stable_seed("loopback-combine-mismatch", field))
  with Loopback(R, _normal_window(R, T, H, K, E, 2, False), timeout_s=5.0) as lb:
    payload, idx, w = _inputs(rng, R, T, H, K, 16, "bf16", "random")  # ids valid for E = 16 and 32
    assert {"hidden": H, "topk": K, "num_experts": E}[field] == there
    C = R * T
    outs, _ = lb.dispatch(payload, idx, w, E=E, C=C, layout="rank")
    y = oracle.make_x(rng, (R, C, H), BF16)
    t0 = time.monotonic()
    got, reports = lb.combine(y, None, outs, idx, E=E, layout="rank", check=False,
                              overrides={0: {field: here}})
    assert time.monotonic() - t0 < 2.5, "a mismatch waited for the timeout"
    for r in range(R):
      assert "another configuration" in reports[r], reports
    _both_named(reports, field, here, there)
    assert not got[1].any(), "rank 1's combine output is not zeros"
    _round(lb, rng, T, H, K, E, "bf16", "random", "rank")


@pytest.mark.parametrize("field,here,name", [("rows_per_rank", 1024, "rows per rank"),
                                             ("row_bytes", 64, "row bytes")])
def test_an_engram_publish_of_another_table_shape_names_both_values_then_next_call_works(field, here, name):
  """The publish compares the ranks' records after its first barrier: the
  mismatch is named and no version is drawn, so the fetch reads zeros."""
  R, rpr, D, T, e = 2, 2048, 64, 32, 4
  V = R * rpr
  rng = np.random.default_rng(stable_seed("loopback-engram-mismatch", field))
  with Loopback(R, (1 << 20) + rpr * D * 2, timeout_s=5.0) as lb:
    table = oracle.make_x(rng, (V, D), BF16)
    idx = rng.integers(-1, V, size=(R, T, e)).astype(np.int32)
    there = {"rows_per_rank": rpr, "row_bytes": D * 2}[field]
    rows, tokens, reports = lb.engram(table, idx, check=False, overrides={0: {field: here}})
    _both_named(reports, name, here, there)
    assert (tokens == 0).all(), tokens
    assert not rows[1].any(), "rank 1 fetched rows from a failed publish"
    rows, _, _ = lb.engram(table, idx)
    _eq(rows, oracle.engram_fetch(table, idx), "engram rows after the mismatch")


_LL = dict(T=32, H=2048, K=4, E=32, mt=64)


def _ll_window(reserved=0, gin=False):
  c = _LL
  return reserved + _window.low_latency_bytes(num_ranks=2, max_tokens=c["mt"], hidden=c["H"],
                                              topk=c["K"], num_experts=c["E"], gin=gin)


@pytest.mark.parametrize("field,here,name,values", [
    ("hidden", 1024, "hidden", (1024, 2048)),           # another layout: the words land elsewhere
    ("max_tokens", 32, "max_tokens", (32, 64)),
    ("num_experts", 16, "num_experts", (16, 32)),
    ("reserved_bytes", 1 << 20, "low-latency area offset / 256 (from reserved_bytes)", (4096, 16)),
    ("num_tokens", 16, "tokens per rank", (16, 32)),   # the same layout: the digest differs
    ("fp8", 1, "fp8", (1, 0)),
])
def test_a_low_latency_dispatch_configuration_mismatch_names_both_values_then_next_calls_work(
    field, here, name, values):
  """config_check.cuh, the low-latency part: on a fresh communicator (both
  ranks set their layout up), one rank's other configuration is named by
  both within milliseconds, recv_count is 0, and every rank's next call
  resets the layout and works."""
  c = _LL
  R = 2
  rng = np.random.default_rng(stable_seed("loopback-ll-mismatch", field))
  with Loopback(R, _ll_window(1 << 20), timeout_s=5.0) as lb:
    idx, _ = oracle.make_topk(rng, R, c["T"], c["K"], 16)  # ids valid for E = 16 and 32
    x = oracle.make_x(rng, (R, c["T"], c["H"]), BF16)
    t0 = time.monotonic()
    outs, reports = lb.ll_dispatch(x, idx, E=c["E"], max_tokens=c["mt"], check=False,
                                   overrides={0: {field: here}})
    assert time.monotonic() - t0 < 2.5, "a mismatch waited for the timeout"
    _both_named(reports, name, *values)
    assert not outs[1]["recv_count"].any(), outs[1]["recv_count"]
    for rnd in range(3):
      _ll_round(lb, rng, c["T"], c["H"], c["K"], c["E"], c["mt"], False, f"after the mismatch, round {rnd}")


def test_a_low_latency_combine_configuration_mismatch_is_named_and_gives_zeros_then_next_calls_work():
  """A combine whose token count differs on rank 0 (the layout stays): rank
  1 names both values through the flag's digest and returns zeros; rank 0
  fails too (its handle's entries are past its tokens)."""
  c = _LL
  R = 2
  rng = np.random.default_rng(stable_seed("loopback-ll-combine-mismatch"))
  with Loopback(R, _ll_window(), timeout_s=5.0) as lb:
    idx, w = oracle.make_topk(rng, R, c["T"], c["K"], c["E"])
    x = oracle.make_x(rng, (R, c["T"], c["H"]), BF16)
    outs, _ = lb.ll_dispatch(x, idx, E=c["E"], max_tokens=c["mt"])
    y = oracle.make_x(rng, (R, c["E"] // R, R * c["mt"], c["H"]), BF16)
    t0 = time.monotonic()
    got, reports = lb.ll_combine(y, idx, w, outs, E=c["E"], max_tokens=c["mt"], check=False,
                                 overrides={0: {"num_tokens": 16}})
    assert time.monotonic() - t0 < 2.5, "a mismatch waited for the timeout"
    assert "tokens per rank 32 here, 16 on EP rank 0" in reports[1], reports
    assert reports[0], reports
    assert not got[1].any(), "rank 1's combine output is not zeros"
    for rnd in range(3):
      _ll_round(lb, rng, c["T"], c["H"], c["K"], c["E"], c["mt"], False, f"after the mismatch, round {rnd}")


def _refused_normal_call(lb, rng, op, R, T, H, K, E):
  """One rank-layout dispatch or combine on every rank but rank 1, whose
  handler refuses it; -> the per-rank reports. A combine first runs a
  dispatch for its handle (outside the refused call)."""
  payload, idx, w = _inputs(rng, R, T, H, K, E, "bf16", "random")
  C = R * T
  if op == "dispatch":
    return lb.dispatch(payload, idx, w, E=E, C=C, layout="rank", check=False, refuse=[1])[1]
  outs, _ = lb.dispatch(payload, idx, w, E=E, C=C, layout="rank")
  y = oracle.make_x(rng, (R, C, H), BF16)
  return lb.combine(y, None, outs, idx, E=E, layout="rank", check=False, refuse=[1])[1]


def _refused_ll_call(lb, rng, op):
  """A low-latency round to set the layout up (a refusal does not stand in
  for the layout reset's barriers, abort.h), then one call of `op` on
  every rank but rank 1, whose handler refuses it; -> (seconds the call
  took, the per-rank reports)."""
  c, R = _LL, lb.R
  _ll_round(lb, rng, c["T"], c["H"], c["K"], c["E"], c["mt"], False, "before the refusal")
  idx, w = oracle.make_topk(rng, R, c["T"], c["K"], c["E"])
  x = oracle.make_x(rng, (R, c["T"], c["H"]), BF16)
  if op == "ll_combine":
    outs, _ = lb.ll_dispatch(x, idx, E=c["E"], max_tokens=c["mt"])
    y = oracle.make_x(rng, (R, c["E"] // R, R * c["mt"], c["H"]), BF16)
  t0 = time.monotonic()
  if op == "ll_dispatch":
    _, reports = lb.ll_dispatch(x, idx, E=c["E"], max_tokens=c["mt"], check=False, refuse=[1])
  else:
    _, reports = lb.ll_combine(y, idx, w, outs, E=c["E"], max_tokens=c["mt"], check=False,
                               refuse=[1])
  return time.monotonic() - t0, reports


@pytest.mark.parametrize("op", ["dispatch", "combine", "ll_dispatch", "ll_combine"])
def test_a_rank_whose_handler_refuses_makes_its_peer_fail_at_once_then_next_calls_work(op):
  """kernels/abort.h on virtual ranks: rank 1 launches what its handler
  launches when it refuses the call (the barriers' stand-in; for the
  low-latency ops the call's stand-in and a refused record), rank 0 runs the
  call and names rank 1's refusal within milliseconds, not the timeout;
  then every rank's next calls work."""
  R = 2
  rng = np.random.default_rng(stable_seed("loopback-refuse", op))
  if op in ("dispatch", "combine"):
    T, H, K, E = 64, 256, 4, 16
    lb = Loopback(R, _normal_window(R, T, H, K, E, 2, False), timeout_s=5.0)
  else:
    c = _LL
    lb = Loopback(R, _ll_window(), timeout_s=5.0)
  with lb:
    if op in ("dispatch", "combine"):
      t0 = time.monotonic()
      reports = _refused_normal_call(lb, rng, op, R, T, H, K, E)
      took = time.monotonic() - t0
      again = lambda: _round(lb, rng, T, H, K, E, "bf16", "random", "rank")
    else:
      took, reports = _refused_ll_call(lb, rng, op)
      again = lambda: _ll_round(lb, rng, c["T"], c["H"], c["K"], c["E"], c["mt"], False, "after the refusal")
    assert "peer rank 1 refused this call" in reports[0], reports
    assert reports[1] == "", reports
    assert took < 2.5, f"{op}: the peer of a refusing rank returned after {took:.1f} s"
    for _ in range(3):
      again()


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_gin_peer_of_a_refusing_rank_fails_at_once_then_next_calls_work(op):
  """barrier.cuh refuse_barriers over emulated GIN: rank 1 puts its refused
  flag ahead of one control signal per barrier it stands in for, so rank 0,
  whose barrier counts signals, names the refusal at once instead of timing
  out, and the signal counts stay equal to the epochs for the next calls."""
  R = 2
  rng = np.random.default_rng(stable_seed("loopback-refuse-gin", op))
  T, H, K, E = 64, 256, 4, 16
  with Loopback(R, _normal_window(R, T, H, K, E, 2, False), timeout_s=5.0, gin_emulated=True) as lb:
    t0 = time.monotonic()
    reports = _refused_normal_call(lb, rng, op, R, T, H, K, E)
    took = time.monotonic() - t0
    assert "peer rank 1 refused this call" in reports[0], reports
    assert reports[1] == "", reports
    assert took < 2.5, f"{op}: the GIN peer of a refusing rank returned after {took:.1f} s"
    for _ in range(3):
      _round(lb, rng, T, H, K, E, "bf16", "random", "rank")


@pytest.mark.parametrize("op", ["ll_dispatch", "ll_combine"])
def test_a_low_latency_gin_peer_of_a_refusing_rank_fails_at_once_then_next_calls_work(op):
  """low_latency_peers.cuh over emulated GIN: rank 1's stand-in for the
  refused call puts a refusal word tagged with the call ahead of the call's
  one signal, so rank 0, which cannot read rank 1's record, names the
  refusal as soon as the signal comes instead of timing out; and the signal
  counts stay equal to the sequence numbers for the next calls."""
  c = _LL
  rng = np.random.default_rng(stable_seed("loopback-ll-refuse-gin", op))
  with Loopback(2, _ll_window(gin=True), timeout_s=5.0, gin_emulated=True) as lb:
    took, reports = _refused_ll_call(lb, rng, op)
    assert "peer rank 1 refused this call" in reports[0], reports
    assert reports[1] == "", reports
    assert took < 2.5, f"{op}: the GIN peer of a refusing rank returned after {took:.1f} s"
    for rnd in range(3):
      _ll_round(lb, rng, c["T"], c["H"], c["K"], c["E"], c["mt"], False, f"after the refusal, round {rnd}")


@pytest.mark.parametrize("R,transport", [(2, "lsa"), (2, "gin_emulated"), (4, "gin_emulated")])
def test_a_peer_of_a_rank_refusing_engram_fails_at_once_then_next_calls_work(R, transport):
  """The fused publish + fetch refused on rank 1 (handlers/engram.cc): it
  stands in for the publish's barriers and, where peers are on GIN, for the
  fetch's exchange (a refused request and a refused answer to each, with
  their signals, engram_gin.cu). Every other rank names the refusal at once
  instead of waiting out the timeout, its rows are zeros, and the
  sequence and signal counts stay in step for the next calls."""
  rpr, D, T, e = 1024, 64, 16, 4
  V = R * rpr
  rng = np.random.default_rng(stable_seed("loopback-refuse-engram", R, transport))
  with Loopback(R, _engram_window(R, rpr, D, 2, T * e, transport), timeout_s=5.0,
                gin_emulated=transport == "gin_emulated") as lb:
    table = oracle.make_x(rng, (V, D), BF16)
    idx = rng.integers(-1, V, size=(R, T, e)).astype(np.int32)
    lb.engram(table, idx)  # one call before: the refusal is not the first
    t0 = time.monotonic()
    rows, _, reports = lb.engram(table, idx, check=False, refuse=[1])
    took = time.monotonic() - t0
    for r in range(R):
      if r == 1:
        assert reports[1] == "" and rows[1] is None, reports
        continue
      assert "peer rank 1 refused this call" in reports[r], (r, reports)
      assert not rows[r].any(), f"rank {r} returned rows from a refused call"
    assert took < 2.5, f"the peers of a rank refusing engram returned after {took:.1f} s"
    for rnd in range(3):
      table = oracle.make_x(rng, (V, D), BF16)
      rows, _, _ = lb.engram(table, idx)
      _eq(rows, oracle.engram_fetch(table, idx), f"engram rows after the refusal, round {rnd}")


@pytest.mark.parametrize("R,skip,op", [(2, 1, "dispatch"), (4, 2, "dispatch"), (2, 0, "combine")])
def test_a_rank_that_skips_the_call_is_reported_by_its_peers_within_the_timeout(R, skip, op):
  import time
  T, H, K, E = 64, 256, 4, 16
  rng = np.random.default_rng(stable_seed("loopback-skip", R, skip, op))
  timeout = 1.0
  with Loopback(R, _normal_window(R, T, H, K, E, 2, False), timeout_s=timeout) as lb:
    payload, idx, w = _inputs(rng, R, T, H, K, E, "bf16", "random")
    C = R * T
    t0 = time.monotonic()
    if op == "dispatch":
      _, reports = lb.dispatch(payload, idx, w, E=E, C=C, layout="rank", check=False, skip=[skip])
    else:
      outs, _ = lb.dispatch(payload, idx, w, E=E, C=C, layout="rank")
      y = oracle.make_x(rng, (R, C, H), BF16)
      t0 = time.monotonic()
      _, reports = lb.combine(y, None, outs, idx, E=E, layout="rank", check=False, skip=[skip])
    took = time.monotonic() - t0
    assert reports[skip] == ""
    for r in range(R):
      if r != skip:
        assert "did not arrive" in reports[r] or "failed this call" in reports[r], (r, reports)
    assert f"peer rank {skip} did not arrive" in " ".join(reports), reports
    assert took < 6 * timeout, f"{op} with rank {skip} absent returned after {took:.1f} s"
