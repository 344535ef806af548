#!/usr/bin/env bash
# What `make device-test` runs ON THE H200 IMAGE (python3.12, torch, cupy; no registry):
# install llmc from this checkout (no deps), run the GPU tests (pytest -m cuda), then the
# kernel benchmark. Logs and a summary land under $OUT (default ./device-out).
# Exit status: non-zero when the install or any GPU test failed.
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

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
  which nvcc && nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1

if ! $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/install.log" 2>&1; then
    echo "install failed; see install.log"; tail -20 "$OUT/install.log"; exit 1
fi

# Failing node ids are appended to failed.txt as they happen (tests/helpers/failure_log.py):
# a run cut by the device call's time limit still names them.
: > "$OUT/failed.txt"
LLMC_FAILED_LOG="$OUT/failed.txt" \
$PY -m pytest -m cuda -o addopts="" -q -p no:cacheprovider --continue-on-collection-errors \
    --rootdir "$REPO" -c "$REPO/pyproject.toml" --junitxml "$OUT/pytest.xml" \
    ${PYTEST_ARGS:-$REPO/tests} > "$OUT/pytest.log" 2>&1 || status=1

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
