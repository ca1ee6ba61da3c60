"""Brute-force NumPy oracle for jax_ep (docs/design.md §2), written independently of
jax_ep.reference: plain Python loops over ranks and tokens, float32 numpy math.

Conventions: per-rank inputs are stacked on a leading rank axis, e.g.
``idx[R, T, K]`` (rank s, token t, slot k), ``x[R, T, H]``.  A "payload" is a
tuple of per-token arrays moved together (``(x,)`` or ``(x_q, scales)``);
outputs are lists indexed by destination rank, or arrays stacked [R, ...].
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Sequence

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)
E4M3_MAX = 448.0
FP8_BLOCK = 128


# --------------------------------------------------------------------------- inputs


def make_topk(
    rng: np.random.Generator,
    R: int,
    T: int,
    K: int,
    E: int,
    *,
    drop: float = 0.2,
    mode: str = "random",
) -> tuple[np.ndarray, np.ndarray]:
    """Routing ``idx[R,T,K] i32`` (distinct experts per token, ~``drop`` of the
    slots set to -1) and weights ``w[R,T,K] f32`` (nonzero everywhere, also in
    -1 slots, so tests see that those are zeroed).

    mode: "random"; "skewed" (every token: slot 0 -> expert 0, others -1);
    "empty_rank" (random, but the last rank's tokens are all -1);
    "all_invalid" (every id -1).
    """
    idx = np.argsort(rng.random((R, T, E)), axis=-1)[..., :K].astype(np.int32)
    if drop > 0:
        idx[rng.random((R, T, K)) < drop] = -1
    if mode == "skewed":
        idx[...] = -1
        idx[..., 0] = 0
    elif mode == "empty_rank":
        idx[R - 1] = -1
    elif mode == "all_invalid":
        idx[...] = -1
    elif mode != "random":
        raise ValueError(mode)
    w = rng.uniform(0.25, 1.5, size=(R, T, K)).astype(np.float32)
    return idx, w


def make_x(rng: np.random.Generator, shape: Sequence[int], dtype) -> np.ndarray:
    """Random normal data (never all zeros) in ``dtype`` (numpy/ml_dtypes)."""
    x = rng.standard_normal(shape).astype(np.float32) * 2.0 + 0.1
    return x.astype(dtype)


def make_fp8_tuple(rng: np.random.Generator, R: int, T: int, H: int):
    """An FP8 payload (x_q[R,T,H] e4m3, scales[R,T,H/128] f32) of random bits."""
    q = (rng.standard_normal((R, T, H)) * 40.0).astype(np.float32)
    q = np.clip(q, -E4M3_MAX, E4M3_MAX).astype(FP8)
    s = rng.uniform(0.01, 3.0, size=(R, T, H // FP8_BLOCK)).astype(np.float32)
    return q, s


def bits(a: np.ndarray) -> np.ndarray:
    """Bit pattern view of an array (for bitwise comparisons, NaN-safe)."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def ulp_distance(a: np.ndarray, b: np.ndarray) -> int:
    """Max distance in units in the last place (same float dtype, finite)."""
    ia = bits(a).astype(np.int64)
    ib = bits(b).astype(np.int64)
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)
    # map sign-magnitude onto a monotone integer line
    ia = np.where(ia & sign, sign - ia, ia)
    ib = np.where(ib & sign, sign - ib, ib)
    return int(np.abs(ia - ib).max()) if ia.size else 0


def assert_exact(got: np.ndarray, exp: np.ndarray, what: str = "combine"):
    """Bitwise equality; on failure say how many elements and how many ulp."""
    assert got.dtype == exp.dtype, (got.dtype, exp.dtype)
    assert got.shape == exp.shape, (got.shape, exp.shape)
    if np.array_equal(bits(got), bits(exp)):
        return
    d = ulp_distance(got, exp)
    n = int((bits(got) != bits(exp)).sum())
    raise AssertionError(
        f"{what}: not bitwise equal to the fixed-order f32 oracle: {n} of {got.size} elements "
        f"differ, max {d} ulp ({'within 1 ulp: summation order / FMA?' if d <= 1 else 'beyond 1 ulp'})"
    )


def assert_fixed_order_exact(got: np.ndarray, expected_for_mode, what: str = "combine") -> str:
    """``expected_for_mode(mode)`` -> oracle result for each COMBINE_STEP_MODES;
    passes when ``got`` equals one of them bitwise, returns that mode."""
    exps = {m: expected_for_mode(m) for m in COMBINE_STEP_MODES}
    same = [
        m for m, e in exps.items()
        if got.dtype == e.dtype and got.shape == e.shape and np.array_equal(bits(got), bits(e))
    ]
    if same:
        # which step form matched (both when they agree on this input): reported
        # in the pytest summary so a change of the f32 step is visible.
        EXACT_MATCH_TALLY["+".join(same)] += 1
        return same[0]
    for m, e in exps.items():
        assert got.dtype == e.dtype and got.shape == e.shape, (got.dtype, got.shape, e.dtype, e.shape)
    msgs = []
    for m, e in exps.items():
        n = int((bits(got) != bits(e)).sum())
        msgs.append(f"{m}: {n} of {got.size} differ, max {ulp_distance(got, e)} ulp")
    raise AssertionError(f"{what}: not bitwise equal to the fixed-order f32 oracle ({'; '.join(msgs)})")


# --------------------------------------------------------------------------- FP8


def quantize_fp8(x: np.ndarray, ue8m0: bool = False,
                 block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Per token, per 128-channel block: amax in f32, s = max(amax, 1e-4)*(1/448),
    optional power-of-two rounding up (UE8M0, from the f32 bits), q = e4m3(
    clip(x * (1/s), ±448)).  x[..., H] -> (q[..., H] e4m3, s[..., H/128] f32).
    `block`: the run of the last axis that shares one scale."""
    H = x.shape[-1]
    assert H % block == 0
    xb = x.astype(np.float32).reshape(*x.shape[:-1], H // block, block)
    amax = np.max(np.abs(xb), axis=-1)
    # s = max(amax, 1e-4) * float32(1/448): XLA turns the division into this product.
    s = (np.maximum(amax, np.float32(1e-4)) * (np.float32(1.0) / np.float32(E4M3_MAX))).astype(np.float32)
    if ue8m0:
        b = s.view(np.uint32).copy()
        has_mantissa = (b & np.uint32(0x007FFFFF)) != 0
        up = ((b >> np.uint32(23)) + np.uint32(1)) << np.uint32(23)
        b = np.where(has_mantissa, up, b).astype(np.uint32)
        s = b.view(np.float32)
    inv = (np.float32(1.0) / s).astype(np.float32)  # x * (1/s), as XLA and the kernels do
    scaled = (xb * inv[..., None]).astype(np.float32)
    q = np.clip(scaled, np.float32(-E4M3_MAX), np.float32(E4M3_MAX)).astype(FP8)
    return q.reshape(x.shape), s.astype(np.float32)


def fp8_round_trip(x: np.ndarray) -> np.ndarray:
    """x[..., H] cast per (row, 128 channels) and back, in float64."""
    q, s = quantize_fp8(x)
    H = x.shape[-1]
    v = q.astype(np.float64).reshape(*x.shape[:-1], H // FP8_BLOCK, FP8_BLOCK)
    return (v * s[..., None].astype(np.float64)).reshape(x.shape)


def fp8_block_round_trip(w: np.ndarray) -> np.ndarray:
    """w[G, H, F] cast per 128 x 128 block and back, in float64."""
    G, H, F = w.shape
    hb, fb, n = H // FP8_BLOCK, F // FP8_BLOCK, FP8_BLOCK * FP8_BLOCK
    # Each 128 x 128 block as one run of the last axis.
    b = w.reshape(G, hb, FP8_BLOCK, fb, FP8_BLOCK).transpose(0, 1, 3, 2, 4).reshape(G, hb, fb, n)
    q, s = quantize_fp8(b, block=n)
    v = q.astype(np.float64) * s.astype(np.float64)
    return v.reshape(G, hb, fb, FP8_BLOCK, FP8_BLOCK).transpose(0, 1, 3, 2, 4).reshape(G, H, F)


def fp8_token_round_trip(x: np.ndarray, sizes) -> np.ndarray:
    """x[M, C] cast per (channel, 128 tokens of one group) and back, in
    float64: the weight gradient's operand cast. Rows past the groups are 0."""
    out = np.zeros(x.shape, np.float64)
    start = 0
    for n in sizes:
        for c0 in range(start, start + n, FP8_BLOCK):
            c1 = min(c0 + FP8_BLOCK, start + n)
            # A chunk is a (tokens x channels) block: transpose so that the
            # 128 tokens are the quantiser's last axis (padded with zeros).
            blk = np.zeros((FP8_BLOCK, x.shape[1]), np.float32)
            blk[:c1 - c0] = x[c0:c1]
            out[c0:c1] = fp8_round_trip(blk.T).T[:c1 - c0]
        start += n
    return out


# --------------------------------------------------------------------------- layout


def local_experts(E: int, R: int) -> int:
    return E // R


def layout(idx_r: np.ndarray, E: int, R: int):
    """One rank's layout: (num_tokens_per_rank[R], num_tokens_per_expert[E],
    is_token_in_rank[T,R]).  -1 ignored; a token counts once per rank."""
    El = local_experts(E, R)
    T, K = idx_r.shape
    per_rank = np.zeros(R, np.int32)
    per_expert = np.zeros(E, np.int32)
    in_rank = np.zeros((T, R), bool)
    for t in range(T):
        seen_e = set()
        for k in range(K):
            e = int(idx_r[t, k])
            if e < 0:
                continue
            if e not in seen_e:
                per_expert[e] += 1
                seen_e.add(e)
            in_rank[t, e // El] = True
    for t in range(T):
        for d in range(R):
            if in_rank[t, d]:
                per_rank[d] += 1
    return per_rank, per_expert, in_rank


# --------------------------------------------------------------------------- dispatch


class RankDispatch(NamedTuple):
    """Expected rank-layout dispatch result on one destination rank."""

    payload: tuple  # each [C, ...]
    topk_idx: np.ndarray  # [C, K] i32 (local ids or -1)
    topk_weights: np.ndarray  # [C, K] f32
    counts: np.ndarray  # [R] i32 rows from each source rank
    rows: list  # per valid row: (src_rank, token, sort_key)
    num_rows: int


class ExpertDispatch(NamedTuple):
    """Expected expert-layout dispatch result on one destination rank."""

    payload: tuple  # each [C, ...]
    topk_idx: np.ndarray  # [C] i32 local expert (-1 padding)
    topk_weights: np.ndarray  # [C] f32
    group_sizes: np.ndarray  # [E_l] i32 (padded)
    rows: list  # per row: (src_rank, token, sort_key) or None for padding
    num_rows: int  # rows used incl. alignment padding


def default_capacity_rank(R: int, T: int) -> int:
    return R * T


def default_capacity_expert(R: int, T: int, K: int, El: int, align: int) -> int:
    return R * T * min(K, El) + El * (align - 1)


def dispatch_rank(payload, idx, w, E: int, capacity: int | None = None):
    """payload: tuple of arrays [R, T, ...]; idx/w: [R, T, K].
    Returns list (over destination ranks) of RankDispatch."""
    R, T, K = idx.shape
    El = local_experts(E, R)
    C = default_capacity_rank(R, T) if capacity is None else capacity
    out = []
    for r in range(R):
        pay = tuple(np.zeros((C,) + p.shape[2:], p.dtype) for p in payload)
        ridx = np.full((C, K), -1, np.int32)
        rw = np.zeros((C, K), np.float32)
        counts = np.zeros(R, np.int32)
        rows = []
        for s in range(R):
            for t in range(T):
                here = [
                    k for k in range(K) if idx[s, t, k] >= 0 and idx[s, t, k] // El == r
                ]
                if not here:
                    continue
                row = len(rows)
                assert row < C, "oracle: capacity too small for this input"
                for p_out, p_in in zip(pay, payload):
                    p_out[row] = p_in[s, t]
                for k in here:
                    ridx[row, k] = idx[s, t, k] - r * El
                    rw[row, k] = w[s, t, k]
                counts[s] += 1
                rows.append((s, t, (r,)))
        out.append(RankDispatch(pay, ridx, rw, counts, rows, len(rows)))
    return out


def dispatch_expert(payload, idx, w, E: int, align: int = 1, capacity: int | None = None):
    """Expert layout: one row per (s, t, k) whose expert lives on r, grouped by
    local expert, (s, t, k) order inside a group, each group padded to a
    multiple of ``align``.  Returns list over destination ranks."""
    R, T, K = idx.shape
    El = local_experts(E, R)
    C = default_capacity_expert(R, T, K, El, align) if capacity is None else capacity
    out = []
    for r in range(R):
        pay = tuple(np.zeros((C,) + p.shape[2:], p.dtype) for p in payload)
        ridx = np.full((C,), -1, np.int32)
        rw = np.zeros((C,), np.float32)
        sizes = np.zeros(El, np.int32)
        rows: list = []
        for l in range(El):
            e = r * El + l
            start = len(rows)
            for s in range(R):
                for t in range(T):
                    for k in range(K):
                        if idx[s, t, k] != e:
                            continue
                        row = len(rows)
                        assert row < C, "oracle: capacity too small for this input"
                        for p_out, p_in in zip(pay, payload):
                            p_out[row] = p_in[s, t]
                        ridx[row] = l
                        rw[row] = w[s, t, k]
                        rows.append((s, t, (r, l, k)))
            n = len(rows) - start
            padded = -(-n // align) * align
            rows.extend([None] * (padded - n))
            sizes[l] = padded
        assert len(rows) <= C, "oracle: capacity too small for this input"
        out.append(ExpertDispatch(pay, ridx, rw, sizes, rows, len(rows)))
    return out


def needed_capacity_rank(idx, E: int) -> int:
    return max(d.num_rows for d in dispatch_rank((), idx, np.zeros(idx.shape, np.float32), E, capacity=idx.shape[0] * idx.shape[1] + 1))


def needed_capacity_expert(idx, E: int, align: int = 1) -> int:
    R, T, K = idx.shape
    big = R * T * K + local_experts(E, R) * align + 1
    return max(
        d.num_rows
        for d in dispatch_expert((), idx, np.zeros(idx.shape, np.float32), E, align, capacity=big)
    )


# --------------------------------------------------------------------------- combine


def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 fused multiply-add ``a * b + c`` (elementwise).

    a*b is exact in float64 (24+24 bits); the sum is formed in float64 with
    round-to-odd (TwoSum error term decides the sticky bit), which makes the
    final float64 -> float32 rounding correct (53 >= 24 + 2)."""
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    c = np.asarray(c, np.float32).astype(np.float64)
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # TwoSum: s + err == p + c exactly
    even = (np.asarray(s).view(np.uint64) & np.uint64(1)) == 0
    fix = (err != 0) & even & np.isfinite(s)
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


# XLA (CPU, and GPU through LLVM) contracts ``acc + w * y`` into a fused
# multiply-add; a CUDA kernel does the same with fmaf. The contract fixes the
# order of the sum; whether each step is fused is the compiler's choice, so the
# exact checks accept the fixed-order sum with every step unfused OR with every
# step fused (both bitwise).  Reported to the lead (docs/design.md §2 wording).
COMBINE_STEP_MODES = ("plain", "fma")
EXACT_MATCH_TALLY: "collections.Counter[str]" = collections.Counter()


def _acc_step(acc, w, y, mode: str):
    if w is None:
        return (acc + y).astype(np.float32)
    if mode == "fma":
        return fma_f32(np.float32(w), y, acc)
    return (acc + np.float32(w) * y).astype(np.float32)


def combine(y, rows_per_rank, weights, T: int, out_dtype=None, mode: str = "plain"):
    """y[R, C, H] (rows held by each destination rank), rows_per_rank[r][row] =
    (src_rank, token, sort_key) or None, weights[R, C] or None.

    out[s, t] = f32 sum over the rows from (s, t), in ascending sort_key
    (destination rank, then local expert, then k), acc = acc + w * y;
    cast to ``out_dtype`` (default y's dtype).  Returns [R, T, H]."""
    R, C, H = y.shape
    out_dtype = y.dtype if out_dtype is None else out_dtype
    contrib: dict = {}
    for r in range(R):
        for row, info in enumerate(rows_per_rank[r]):
            if info is None:
                continue
            s, t, key = info
            contrib.setdefault((s, t), []).append((key, r, row))
    out = np.zeros((R, T, H), np.float32)   # tokens with no rows: +0.0
    for (s, t), lst in contrib.items():
        lst.sort(key=lambda z: z[0])
        acc = np.full(H, -0.0, np.float32)  # the additive identity (docs/design.md §2, reference.py)
        for _, r, row in lst:
            yr = y[r, row].astype(np.float32)
            acc = _acc_step(acc, None if weights is None else weights[r, row], yr, mode)
        out[s, t] = acc
    return out.astype(out_dtype)


# --------------------------------------------------------------------------- low latency


class LowLatencyDispatch(NamedTuple):
    payload: tuple  # each [E_l, R*max_tokens, ...]
    count: np.ndarray  # [E_l] i32
    rows: list  # rows[l] = [(s, t, k), ...]


def low_latency_dispatch(payload, idx, E: int, max_tokens: int):
    """For each destination rank r and local expert l: rows (s, t, k) with
    idx[s,t,k] == r*E_l + l, ordered by (s, t, k), packed from row 0."""
    R, T, K = idx.shape
    El = local_experts(E, R)
    M = R * max_tokens
    out = []
    for r in range(R):
        pay = tuple(np.zeros((El, M) + p.shape[2:], p.dtype) for p in payload)
        count = np.zeros(El, np.int32)
        rows = []
        for l in range(El):
            e = r * El + l
            lst = []
            for s in range(R):
                for t in range(T):
                    for k in range(K):
                        if idx[s, t, k] == e:
                            pos = len(lst)
                            assert pos < M
                            for p_out, p_in in zip(pay, payload):
                                p_out[l, pos] = p_in[s, t]
                            lst.append((s, t, k))
            count[l] = len(lst)
            rows.append(lst)
        out.append(LowLatencyDispatch(pay, count, rows))
    return out


def low_latency_src_entry(disp: list, T: int, K: int, max_tokens: int) -> np.ndarray:
    """The LowLatencyHandle's src_entry [R(dest), E_l, R*max_tokens] from the
    oracle's rows: flat (s * T + t) * K + k of the row at each place, -1 past
    the expert's count (its recv_count is ``disp[r].count``)."""
    R = len(disp)
    El = len(disp[0].rows) if R else 0
    entry = np.full((R, El, R * max_tokens), -1, np.int32)
    for r, d in enumerate(disp):
        for l, lst in enumerate(d.rows):
            for pos, (s, t, k) in enumerate(lst):
                entry[r, l, pos] = (s * T + t) * K + k
    return entry


def low_latency_combine(y, idx, w, disp, out_dtype=None, mode: str = "plain"):
    """y[R, E_l, M, H]; out[s, t] = sum over valid k in ascending (expert, k)
    of w[s,t,k] * y[row of (s,t,k)], f32 acc, cast to y's dtype."""
    R, El, M, H = y.shape
    _, T, K = idx.shape
    out_dtype = y.dtype if out_dtype is None else out_dtype
    where = {}
    for r in range(R):
        for l in range(El):
            for pos, (s, t, k) in enumerate(disp[r].rows[l]):
                where[(s, t, k)] = (r, l, pos)
    out = np.zeros((R, T, H), np.float32)
    for s in range(R):
        for t in range(T):
            ks = [k for k in range(K) if idx[s, t, k] >= 0]
            ks.sort(key=lambda k: (int(idx[s, t, k]), k))
            if not ks:
                continue                     # no rows: +0.0
            acc = np.full(H, -0.0, np.float32)
            for k in ks:
                r, l, pos = where[(s, t, k)]
                acc = _acc_step(acc, w[s, t, k], y[r, l, pos].astype(np.float32), mode)
            out[s, t] = acc
    return out.astype(out_dtype)


# --------------------------------------------------------------------------- engram


def engram_fetch(table: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """table[V, D] global, indices[R, T, e] -> rows [R, T, e, D] (-1 -> zeros)."""
    R, T, n = indices.shape
    D = table.shape[1]
    out = np.zeros((R, T, n, D), table.dtype)
    for s in range(R):
        for t in range(T):
            for j in range(n):
                i = int(indices[s, t, j])
                if i >= 0:
                    out[s, t, j] = table[i]
    return out


def engram_scales(scales: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """scales[V] -> [R, T, e] per-row scales, 0 for -1."""
    out = np.zeros(indices.shape, np.float32)
    valid = indices >= 0
    out[valid] = scales[indices[valid]]
    return out


def engram_table_grad(V: int, indices: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Gradient of sum(g * fetch(table)) w.r.t. the global table [V, D]."""
    D = g.shape[-1]
    acc = np.zeros((V, D), np.float64)
    valid = indices >= 0
    np.add.at(acc, indices[valid], g[valid].astype(np.float64))
    return acc.astype(np.float32)


def engram_table_grad_ordered(V: int, indices: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The same gradient [V, D] as jax_ep sums it: float32, from +0.0, each
    row's cotangents added in (source rank, token, slot) order (indices
    [R, T, e], g [R, T, e, D])."""
    D = g.shape[-1]
    acc = np.zeros((V, D), np.float32)
    flat_i, flat_g = indices.reshape(-1), g.reshape(-1, D).astype(np.float32)
    for q in range(flat_i.shape[0]):
        if flat_i[q] >= 0:
            acc[flat_i[q]] = acc[flat_i[q]] + flat_g[q]
    return acc


def engram_grad_terms(V: int, indices: np.ndarray, g: np.ndarray):
    """Per table row: number of summed cotangents n[V, 1] and sum|g| [V, D]."""
    D = g.shape[-1]
    n = np.zeros((V, 1), np.int64)
    abs_sum = np.zeros((V, D), np.float64)
    valid = indices >= 0
    np.add.at(n, indices[valid], 1)
    np.add.at(abs_sum, indices[valid], np.abs(g[valid]).astype(np.float64))
    return n, abs_sum


def stable_seed(*parts) -> int:
  """A seed from test parameters that is the same in every process (Python
  salts str hashes per process, so hash() would make failures unrepeatable)."""
  import zlib
  return zlib.crc32(repr(parts).encode())


def grouped_matmul_grads(x, w, sizes, dy) -> tuple[np.ndarray, np.ndarray]:
  """float64 (dx, dw) of grouped_matmul for the output cotangent dy: dx rows
  of group g are dy_g @ w[g]^T (rows past the groups zero), dw[g] = x_g^T dy_g."""
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  dx, dw = np.zeros_like(x64), np.zeros_like(w64)
  start = 0
  for g, n in enumerate(sizes):
    dx[start:start + n] = dy64[start:start + n] @ w64[g].T
    dw[g] = x64[start:start + n].T @ dy64[start:start + n]
    start += n
  return dx, dw


def grouped_matmul(x, w, sizes) -> np.ndarray:
  """float64 products of group g's rows (contiguous, in order) with w[g];
  rows past the last group are zero."""
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, n in enumerate(sizes):
    out[start:start + n] = x64[start:start + n] @ w64[g]
    start += n
  return out


def dispatch_handle(disp: list, idx: np.ndarray, E: int, layout: str, C: int) -> dict:
    """The DispatchHandle fields a dispatch must return, from the oracle's own
    rows: recv_src_rank / recv_src_token / recv_src_k [R, C] (-1 on padding;
    recv_src_k is -1 in the rank layout), recv_counts [R(dest), R(src)] (rows,
    or (token, k) entries, per source) and pos_in_rank [R(src), T, R(dest)]
    (index of token t among rank s's tokens bound for rank j, ascending t)."""
    R, T, K = idx.shape
    El = local_experts(E, R)
    src_rank = np.full((R, C), -1, np.int32)
    src_token = np.full((R, C), -1, np.int32)
    src_k = np.full((R, C), -1, np.int32)
    counts = np.zeros((R, R), np.int32)
    for r, d in enumerate(disp):
        for row, info in enumerate(d.rows):
            if info is None:
                continue
            s, t, key = info
            src_rank[r, row], src_token[r, row] = s, t
            if layout == "expert":
                src_k[r, row] = key[2]
            counts[r, s] += 1
    pos = np.full((R, T, R), -1, np.int32)
    for s in range(R):
        for j in range(R):
            n = 0
            for t in range(T):
                if any(idx[s, t, k] >= 0 and idx[s, t, k] // El == j for k in range(K)):
                    pos[s, t, j] = n
                    n += 1
    return dict(recv_src_rank=src_rank, recv_src_token=src_token, recv_src_k=src_k,
                recv_counts=counts, pos_in_rank=pos)
