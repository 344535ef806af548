#!/usr/bin/env bash
# What `make device-test` runs ON THE H200 IMAGE (python3.12, torch, cupy; no registry):
# install llmc from this checkout (no deps), run the GPU tests (pytest -m cuda), then the
# kernel benchmark. Logs and a summary land under $OUT (default ./device-out).
# Exit status: non-zero when the install or any GPU test failed.
#
# The whole suite takes ~200 s with PYTEST_ARGS="-n 14" (H100, 2026-12-08: 3,068 tests in
# 192 s): since the run-time kernels are compiled once a machine into the kernel cache
# (llmc.cuda.kernel_cache.runtime_cubin), the xdist workers wait for one NVRTC compile of a
# family instead of each running it (~13 minutes before, in two calls). With
# LLMC_KERNEL_CACHE pointing at a folder carried from an earlier run (its nvcc-* / nvrtc-*
# entries) nothing is compiled at all. It still runs in two parts where asked
# (DEVICE_TEST_PART): 1 = the heavy kernel files (HEAVY below, 119 s), 2 = every other GPU
# test; unset = all of tests/, or what PYTEST_ARGS names (options and test paths). The 40
# slowest tests are listed at the end of pytest.log. With WHEELS=DIR
# (default ./.whl when present: scripts/fetch_device_wheels.sh) the ASGI wheels the image
# lacks are installed into /tmp/site first, so the `llmc serve` GPU tests run too.
#
#   bash scripts/device_test.sh           # PYTEST_ARGS unset: "-n <cores - 2> --timeout 300"
#   DEVICE_TEST_PART=1 PYTEST_ARGS="-n 14 --timeout 300" SKIP_BENCH=1 bash scripts/device_test.sh
#
# PYTEST_ARGS is split on spaces (so `-k 'a and b'` in it selects nothing: pytest sees
# `'a`, `and`, `b'`); a -k expression goes in PYTEST_K instead, passed as one argument:
#   PYTEST_K="dequantize or embedding" PYTEST_ARGS="-n 14 $PWD/tests/cuda/test_cuda_wo.py" ...
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Run Python outside the checkout: its top-level cuda/ folder would shadow NVIDIA's `cuda`
# package (cuda.pathfinder, which cupy imports) when the working directory is on sys.path.
cd "$(mktemp -d)"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
status=0
HEAVY="tests/cuda/test_cuda_wo.py tests/cuda/test_cuda_wo_gemm.py tests/cuda/test_cuda_wo_ring.py
  tests/cuda/test_cuda_kernels.py tests/cuda/test_cuda_fp8.py tests/cuda/test_cuda_prefill_sm90.py
  tests/runtime/test_weight_only_cuda.py"
case "${DEVICE_TEST_PART:-}" in
    "") case "${PYTEST_ARGS:-}" in  # test paths in PYTEST_ARGS name the tests, as before
            *tests/*|*tests\ *|*tests) TARGETS="" ;;
            *) TARGETS="$REPO/tests" ;;
        esac ;;
    1) TARGETS=$(for f in $HEAVY; do printf '%s ' "$REPO/$f"; done) ;;
    2) TARGETS="$REPO/tests $(for f in $HEAVY; do printf -- '--ignore=%s ' "$REPO/$f"; done)" ;;
    *) echo "DEVICE_TEST_PART must be 1, 2 or unset, got '$DEVICE_TEST_PART'"; exit 2 ;;
esac
WHEELS=${WHEELS:-$REPO/.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl \
        > "$OUT/wheels.log" 2>&1 || { echo "wheel install failed; see wheels.log"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
  which nvcc && nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1

if ! $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/install.log" 2>&1; then
    echo "install failed; see install.log"; tail -20 "$OUT/install.log"; exit 1
fi

# Unset PYTEST_ARGS: as many xdist workers as the machine has cores less two, a 300-s
# timeout a test, where the image has pytest-xdist and pytest-timeout (the lent GPU's has).
if [ -z "${PYTEST_ARGS+set}" ]; then
    PYTEST_ARGS=""
    $PY -c 'import xdist' 2>/dev/null && PYTEST_ARGS="-n $(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))"
    $PY -c 'import pytest_timeout' 2>/dev/null && PYTEST_ARGS="$PYTEST_ARGS --timeout 300"
fi
echo "pytest options: ${PYTEST_ARGS:-none}" >> "$OUT/env.txt"

# Failing node ids are appended to failed.txt as they happen (tests/helpers/failure_log.py):
# a run cut by the device call's time limit still names them.
: > "$OUT/failed.txt"
LLMC_FAILED_LOG="$OUT/failed.txt" \
$PY -m pytest -m cuda -o addopts="" -q -p no:cacheprovider --continue-on-collection-errors \
    --rootdir "$REPO" -c "$REPO/pyproject.toml" --junitxml "$OUT/pytest.xml" --durations=40 \
    ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} $TARGETS > "$OUT/pytest.log" 2>&1 || status=1

if [ "${SKIP_BENCH:-0}" != "1" ]; then
    $PY -m llmc.cuda.bench --json "$OUT/kernel_bench.json" > "$OUT/bench.txt" 2>&1 || status=1
fi

{ echo "== env"; cat "$OUT/env.txt"
  echo "== pytest -m cuda (failures first)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -40
  echo "== failed as they happened ($(wc -l < "$OUT/failed.txt") reports)"; head -40 "$OUT/failed.txt"
  tail -3 "$OUT/pytest.log"
  echo "== kernel benchmark"; cat "$OUT/bench.txt" 2>/dev/null | tail -30; } > "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
