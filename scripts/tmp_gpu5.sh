export CMAKE_BUILD_PARALLEL_LEVEL=16 PYTHONUNBUFFERED=1 JAX_EP_BENCH_RANKS=1
pip install -q --no-deps --no-index .whl/*.whl 2>/dev/null
GPU_CHECK_PYTEST_ARGS="-q" GPU_CHECK_DEMO=none GPU_CHECK_TESTS="tests/test_gpu_dispatch.py tests/test_gpu_low_latency.py tests/test_gpu_overlap.py tests/test_gpu_errors.py tests/test_gpu_layout.py tests/test_gpu_determinism.py tests/test_gpu_properties.py tests/test_gpu_comm.py" GPU_CHECK_BENCH=bench_normal GPU_CHECK_ARGS_bench_normal="--impls jax_ep,jax_ep_expert,jax_all_to_all --no-ragged-modes" JAX_EP_COMMIT=9281e53 timeout 470 bash scripts/gpu_check.sh 2>&1 | grep -v "^PASSED" | grep -E "passed|failed|FAIL|Error|normal_|^bench|^build|^gpu tests|elapsed" | head -60
timeout 40 python3 benchmarks/setup_stamps.py --out $OUT 2>&1 | tail -3
