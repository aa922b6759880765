#!/usr/bin/env bash
# One GPU call: install the carried wheels, run the GPU-marked and kernel tests, time the
# kernels (kernel_compare) and the hierarchy; everything lands in $OUT.
# Use through the device tool: carry [".whl"], command "bash benchmarks/gpu_session.sh".
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
export LSPARSE_RUNS=$OUT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import jax, triton; print('jax', jax.__version__, 'triton', triton.__version__, jax.devices())"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -x -m gpu tests 2>&1 \
  | tee $OUT/gpu_tests.log | tail -25
timeout ${BENCH_TIMEOUT:-300} python3 -m experiments.cli run configs/experiments/kernel_compare.gin \
  ${BENCH_ARGS:-} 2>&1 | grep -v "it/s\]" | tee $OUT/kernel_compare.log | tail -60
