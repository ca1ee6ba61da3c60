"""The Python size hint must equal the kernels' own window need.

`jax_ep.get_buffer_size_hint` (and the benchmarks) size the window with
`jax_ep._window.normal_bytes`, a Python mirror of window_layout.h; a
mirror that under-counts makes every dispatch fail with "window too small".
This compares the two over shapes that exercise each term (ranks, tokens,
hidden, top-k, experts, dtype bytes, FP8), and likewise the low-latency
(low_latency.cuh), Engram (engram_layout.h EngramWindow::need) and fused
MoE (mega_layout.h MegaWindow) mirrors."""
from __future__ import annotations

import itertools

import pytest

from jax_ep import _native, _window

pytestmark = pytest.mark.skipif(not _native.cuda_built(), reason="needs jax_ep's CUDA build")


@pytest.mark.parametrize("R,T,H,K,E", [
    (1, 0, 128, 1, 8), (2, 1, 128, 1, 8), (2, 4096, 7168, 8, 256), (4, 127, 2048, 6, 64),
    (8, 128, 7168, 8, 256), (8, 16384, 2048, 32, 1024), (2, 8192, 4096, 1, 2),
])
def test_python_window_hint_equals_kernel_layout(R, T, H, K, E):
  m = _native.module()
  for x_bytes, fp8, y_bytes in itertools.product((2, 4), (False, True), (2, 4)):
    want = m.window_bytes_needed(R, T, H, K, E, x_bytes, fp8, y_bytes)
    got = _window.normal_bytes(num_ranks=R, tokens_per_rank=T, hidden=H, topk=K,
                               num_experts=E, x_bytes=x_bytes, fp8=fp8, y_bytes=y_bytes)
    assert got == want, (R, T, H, K, E, x_bytes, fp8, y_bytes, got, want)


@pytest.mark.parametrize("R,M,H,K,E,reserved", [
    (1, 1, 128, 1, 8, 0), (2, 128, 7168, 8, 256, 0), (2, 37, 2048, 6, 64, 12345),
    (8, 128, 7168, 8, 256, 1 << 20), (4, 256, 4096, 32, 1024, 0),
])
@pytest.mark.parametrize("gin", [False, True])
def test_low_latency_window_formula_equals_kernel_layout(R, M, H, K, E, reserved, gin):
  """With `gin` (a peer reached by GIN) the kernels' staging area too."""
  want = _native.module().ll_window_bytes(R, M, H, K, E, reserved, gin)
  got = _window.low_latency_bytes(num_ranks=R, max_tokens=M, hidden=H, topk=K,
                                  num_experts=E, reserved_bytes=reserved, gin=gin)
  assert got == want, (R, M, H, K, E, reserved, gin, got, want)


def test_the_low_latency_staging_area_comes_only_with_gin_peers_and_in_the_hint():
  """An NVLink-only communicator pays nothing for GIN; the hint with gin=True
  covers the staging area."""
  c = dict(num_ranks=8, max_tokens=128, hidden=7168, topk=8, num_experts=256)
  lsa, gin = _window.low_latency_bytes(**c), _window.low_latency_bytes(**c, gin=True)
  assert gin > lsa
  hint = dict(num_ranks=8, tokens_per_rank=128, hidden=7168, topk=8, num_experts=256,
              low_latency=True)
  assert _window.get_buffer_size_hint(**hint) >= lsa
  assert _window.get_buffer_size_hint(**hint, gin=True) >= gin > _window.get_buffer_size_hint(**hint)


@pytest.mark.parametrize("rows,dim", [(0, 8), (1, 8), (1000, 256), (4097, 7168), (7, 24)])
def test_engram_window_formula_equals_kernel_layout(rows, dim):
  import jax.numpy as jnp
  m = _native.module()
  for dtype, reserved, end in itertools.product(
      (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn),
      (0, 1, 4095, 4096, 4097, 12345, (1 << 28) + 3), (0, 256, 1 << 20, 777)):
    row_bytes = dim * jnp.dtype(dtype).itemsize
    want = m.engram_window_bytes(rows, row_bytes, reserved, end)
    got = _window.engram_bytes(rows_per_rank=rows, dim=dim, dtype=dtype,
                               reserved_bytes=reserved, table_end_offset=end)
    assert got == want, (rows, dim, dtype, reserved, end, got, want)


@pytest.mark.parametrize("R,n,dim", [(2, 1, 8), (2, 512 * 24, 128), (4, 33 * 5, 64), (8, 16 * 3, 8),
                                     (8, 4097, 7168)])
def test_engram_gin_window_formula_equals_kernel_layout(R, n, dim):
  """With GIN peers a fetch's request/answer scratch (engram_layout.h
  EngramGinArea) goes above reserved_bytes, below the table."""
  import jax.numpy as jnp
  m = _native.module()
  for dtype, reserved, end in itertools.product(
      (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn), (0, 4097, 12345), (0, 777)):
    row_bytes = dim * jnp.dtype(dtype).itemsize
    want = m.engram_window_bytes(1000, row_bytes, reserved, end, R, n)
    got = _window.engram_bytes(rows_per_rank=1000, dim=dim, dtype=dtype, reserved_bytes=reserved,
                               table_end_offset=end, gin_ranks=R, gin_rows=n)
    assert got == want, (R, n, dim, dtype, reserved, end, got, want)
    assert got > _window.engram_bytes(rows_per_rank=1000, dim=dim, dtype=dtype,
                                      reserved_bytes=reserved, table_end_offset=end)


def test_the_window_header_size_is_the_native_one():
  """The header size is written once per language (docs/design.md §3, the
  window layout)."""
  assert _native.WINDOW_HEADER_BYTES == _native.module().window_header_bytes


def test_the_window_layout_constants_are_the_native_ones():
  """The chunk-counter region (4 * MAX_RANKS * CHUNKS_PER_SOURCE bytes after
  the header) and the rank limit are written once per language."""
  m = _native.module()
  assert _native.CHUNKS_PER_SOURCE == m.chunks_per_source
  assert _native.MAX_RANKS == m.max_ranks


def test_the_low_latency_max_tokens_is_the_native_one():
  """The count words' 16 bits of rows (low_latency.cuh kLlMaxTokens)."""
  from jax_ep._ffi import low_latency as ffi_ll
  assert ffi_ll.MAX_TOKENS == _native.module().ll_max_tokens


def test_the_module_registers_exactly_the_listed_targets():
  """_native.TARGETS (and TESTING_TARGETS, in a build with the test harness)
  name every FFI target the module registers, and only those."""
  m = _native.module()
  want = set(_native.TARGETS) | (set(_native.TESTING_TARGETS) if _native.testing_built() else set())
  assert set(m.registrations()) == want
  assert not set(_native.TARGETS) & set(_native.TESTING_TARGETS)
  assert _native.COMMAND_BUFFER_TARGETS <= set(_native.TARGETS)


def test_the_test_harness_is_in_the_module_only_when_built_with_it():
  """JAX_EP_TESTING=ON (CMakeLists.txt) adds the virtual ranks and the device
  timers; without it the module has none of them."""
  m = _native.module()
  names = ("loopback_create", "loopback_run", "loopback_peek", "loopback_destroy",
           "time_d2d_memcpy", "mem_get_info")
  have = {n for n in names if hasattr(m, n)}
  assert have == (set(names) if _native.testing_built() else set()), have
  assert m.build_info["testing_built"] == _native.testing_built()


@pytest.mark.parametrize("R,T,H,K,E", [
    (1, 0, 128, 1, 8), (1, 4096, 7168, 8, 256), (2, 37, 2048, 6, 64), (4, 1, 128, 32, 1024),
    (8, 4096, 7168, 8, 256), (8, 16384, 2048, 32, 1024),
])
@pytest.mark.parametrize("reserved", [0, 1, 4097, 12345, (1 << 28) + 3])
def test_mega_moe_window_formula_equals_kernel_layout(R, T, H, K, E, reserved):
  want = _native.module().mega_window_bytes(R, T, H, K, E, reserved)
  got = _window.mega_moe_bytes(num_ranks=R, tokens_per_rank=T, hidden=H, topk=K,
                               num_experts=E, reserved_bytes=reserved)
  assert got == want, (R, T, H, K, E, reserved, got, want)


def test_the_hint_with_mega_moe_covers_the_normal_ops_and_the_fused_area_above_them():
  c = dict(num_ranks=8, tokens_per_rank=4096, hidden=7168, topk=8, num_experts=256)
  normal = _window.normal_bytes(**c)
  hint = _window.get_buffer_size_hint(**c, mega_moe=True)
  assert hint % _window.GRANULE == 0
  assert hint >= _window.mega_moe_bytes(**c, reserved_bytes=normal) > normal
  # The combine slots [T, K, H] bf16 dominate the fused area.
  assert _window.mega_moe_bytes(**c) >= 2 * 4096 * 8 * 7168
