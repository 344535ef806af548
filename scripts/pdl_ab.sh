#!/usr/bin/env bash
# Programmatic dependent launch, A/B on one GPU (one device call): the PDL GPU test
# (tests/cuda/test_cuda_pdl.py), the GEMV chain with PDL off / on (scripts/pdl_chain.py at
# M = 1 and 4), then the batch-1 rows of scripts/bench_h200.sh with LLMC_PDL=0 and with the
# default (on), alternating PAIRS times on the same engines. Results under $OUT
# (pytest_pdl.log, chain_m*.json, runs.tgz: off<i>/ on<i>/ with each run's summary.json, bench.log).
#   OUT=/tmp/o LLMC_COMMIT=<sha> [ROWS="b1 fp8b1"] [PAIRS=1] [MODES="off on"] [SKIP_CHAIN=1] \
#       [SKIP_TEST=1] [SKIP_BASE=1] [CHAIN_MS="1 2 4 8"] bash scripts/pdl_ab.sh
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
cd "$(mktemp -d)"  # not from the checkout: its cuda/ shadows NVIDIA's package
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/ab.log"; }
python3 -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/install.log" 2>&1 \
    || { log "install failed"; tail -5 "$OUT/install.log"; exit 1; }
if [ "${SKIP_TEST:-0}" != "1" ]; then
    log "pytest test_cuda_pdl.py"
    timeout 240 python3 -m pytest -m cuda -o addopts="" -q -p no:cacheprovider --rootdir "$REPO" \
        -c "$REPO/pyproject.toml" "$REPO/tests/cuda/test_cuda_pdl.py" > "$OUT/pytest_pdl.log" 2>&1
    tail -3 "$OUT/pytest_pdl.log" | tee -a "$OUT/ab.log"
fi
if [ "${SKIP_CHAIN:-0}" != "1" ]; then
    for m in ${CHAIN_MS:-1 4}; do
        log "chain M = $m"
        timeout 180 python3 "$REPO/scripts/pdl_chain.py" "$OUT/chain_m$m.json" "$m" \
            >> "$OUT/chain.log" 2>&1 || log "chain M = $m FAILED"
        grep -o "'kind': '[a-z0-9]*'.*'copy_frac_on': [0-9.]*" "$OUT/chain.log" | tail -4 \
            | tee -a "$OUT/ab.log"
    done
fi
skip_base=${SKIP_BASE:-0}  # 1: rows on engines they build themselves only (int4b1, fp8b1)
for i in $(seq 1 "${PAIRS:-1}"); do
    for mode in ${MODES:-off on}; do  # off: LLMC_PDL=0, gemv: LLMC_PDL=gemv, on: the default
        log "rows ${ROWS:-b1 fp8b1} PDL $mode ($i)"
        pdl=""; [ "$mode" = off ] && pdl=0; [ "$mode" = gemv ] && pdl=gemv
        LLMC_PDL=$pdl OUT="$OUT/$mode$i" SKIP_TESTS=1 SKIP_BASE=$skip_base \
            ROWS="${ROWS:-b1 fp8b1}" N_B1=${N_B1:-3} bash "$REPO/scripts/bench_h200.sh" \
            > "$OUT/$mode$i.log" 2>&1
        skip_base=1
        grep -E "output tok|TPOT" "$OUT/$mode$i/bench.log" | tee -a "$OUT/ab.log"
    done
done
# one archive for the runs' folders (the device tool returns a limited number of files)
runs=$(cd "$OUT" && ls -d off[0-9]* gemv[0-9]* on[0-9]* 2>/dev/null)
if [ -n "$runs" ]; then
    (cd "$OUT" && tar czf runs.tgz $runs && rm -rf $runs)
fi
log "done"
