#!/usr/bin/env bash
# `make bench-h200`: issue 6's rows on the lent H200, in ONE device call (< 10 minutes).
#
# 1. installs llmc from this checkout (no deps; typer/rich wheels from .whl/ when missing);
# 2. runs the CUDA end-to-end tests (tests/cuda/test_cuda_e2e.py, pytest -m cuda) first;
# 3. builds dummy-weight bf16 sm_90 engines from profiles/llama3-8b.yaml and
#    profiles/smollm2-135m-dummy.yaml;
# 4. runs the rows through `llmc bench` (and one decode-heavy `llmc profile --trace`),
#    each under its own timeout, writing each JSON result;
# 5. prints ONE summary table (scripts/device_e2e.py) and packs every JSON into
#    $OUT/results.tgz (the device tool returns at most 8 files).
# Sizes are env-overridable (N_128=3000 N_PEER=512 ...); the defaults fit the 10 minutes
# and say where a row runs fewer requests than issue 6 asks.
# ROWS picks rows (default: b1 128 sampled peer smol profile 2048 long nographs fp8*; sampled =
# the 128/128 row at temperature 0.7, top_p 0.9, issue 17); also available:
# b1sync (--no_async_scheduling), b1mb256 (--max_batch_size 256), b1prof (batch-1
# per-kernel profile), 128mb1024 (a second 8B engine built with max_batch_size 1024),
# prof2048, profsmol and proffp8 (kernel-family profiles; proffp8: the FP8 + FP8 KV engine at
# 128/128, N_PROF_FP8 requests, default 1500), int4b1 / int4128 / int8b1 / int8128 (issue
# 14: weight-only int4_wo / int8_wo engines of the 8B profile, dummy weights quantized at
# build, batch 1 128/512 and 128/128 offline; beside the bf16 rows b1 / 128), beam4 (issue 16:
# an 8B engine built with --max_beam_width 4, 128/128 at --beam_width 4, N_BEAM requests,
# default N_128; beside the greedy row 128), smolb1 (SmolLM2 shape batch 1 128/512), b1nopg
# (batch 1 with --prefill_graph_max_tokens 0: eager prefill, beside b1), fp8128mbN (the FP8 +
# FP8 KV 128/128 row on an engine built with --max_batch_size N, e.g. fp8128mb1024), smolkK /
# 128kK / b1kK (issue 17: the smol, 128 and b1 rows with --decode_steps_per_iteration K, e.g.
# smolk4, 128k8, b1k4: multi-step decoding), smolpw / 128pw / 2048pw (the smol, 128 and 2048
# rows with --piecewise_graph_max_tokens 8192: piecewise CUDA graphs of prefill and mixed
# steps), smolnopw / 128nopw / 2048nopw (the same rows with --piecewise_graph_max_tokens 0).
# int4128pw / int8128pw: the weight-only 128/128 rows with piecewise graphs (their prefill
# and mixed steps run dequantize-then-cuBLAS eagerly otherwise: host-bound?).
# b1nopdl / fp8b1nopdl / int4b1nopdl / int8b1nopdl: the batch-1 rows with LLMC_PDL=0 (no
# programmatic dependent launch), beside b1 / fp8b1 / int4b1 / int8b1.
# ROWS may name row groups: issue12 (the FP8 rows, their BF16 twins, the FP8 profile),
# issue14 (the weight-only rows and the BF16 ones), issue17 (the 135M rows, batch 1, sampled,
# the 135M profile, piecewise graphs), e.g. ROWS=issue14 or ROWS="issue17 2048".
# SKIP_TESTS=1
# skips step 2; SKIP_BASE=1 skips the two bf16 builds of step 3 (for rows that build their own
# engines: fp8*, int4*, int8*); PYTEST_ARGS
# (absolute paths: Python runs outside the checkout) replaces its test files. LLMC_COMMIT names
# the commit in env.txt and every result (the device tool's copy of the tree keeps a stale .git:
# pass LLMC_COMMIT=$(git rev-parse --short=12 HEAD) from the calling machine).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/bench-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RES=$(mktemp -d)/results
mkdir -p "$RES"
# Python must not run from the checkout: its cuda/ folder shadows NVIDIA's `cuda` package.
cd "$(mktemp -d)"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
LLMC="$PY -m llmc.cli.main"
ENG=${ENG:-/tmp/llmc-engines}
N_128=${N_128:-3000}          # issue: 3000
N_PEER=${N_PEER:-512}         # the 8B peer runs on this subset (HF at ~4.7k tok/s)
N_B1=${N_B1:-4}               # batch-1 128/512 requests
N_2048=${N_2048:-1000}        # issue: 1000
N_LONG=${N_LONG:-256}         # 128/2048; issue: 1000
N_SMOL=${N_SMOL:-4096}        # issue: 4096
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/bench.log"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, cupy; print("torch", torch.__version__, "cupy", cupy.__version__)'
  echo "commit ${LLMC_COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null)}"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ! $PY -c 'import typer, rich' 2>/dev/null && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$REPO"/.whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/install.log" 2>&1; then
    echo "install failed"; tail -20 "$OUT/install.log"; exit 1
fi

status=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    log "pytest -m cuda tests/cuda/test_cuda_e2e.py"
    LLMC_FAILED_LOG="$RES/failed.txt" \
    timeout ${TEST_TIMEOUT:-180} $PY -m pytest -m cuda -o addopts="" -q -s -p no:cacheprovider \
        --rootdir "$REPO" -c "$REPO/pyproject.toml" ${PYTEST_ARGS:-$REPO/tests/cuda/test_cuda_e2e.py} \
        > "$OUT/pytest.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR)|passed|failed|agreement" "$OUT/pytest.log" | tail -15
    [ -s "$RES/failed.txt" ] && { echo "failed (as they happened):"; head -20 "$RES/failed.txt"; }
fi

build() {  # profile, dir, extra build flags...
    local prof=$1 dir=$2; shift 2
    log "build $prof $*"
    timeout 300 $LLMC build --profile "$prof" --output_dir "$dir" --target sm_90 --dtype bfloat16 \
        --force "$@" >> "$OUT/bench.log" 2>&1 || { log "build $prof FAILED"; status=1; }
}
pack() {  # summary table + every result so far into $OUT (a killed call still returns them)
    $PY "$REPO/scripts/device_e2e.py" "$RES" > "$OUT/summary.md" 2>&1
    cp "$RES/summary.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/results.tgz" --exclude=trace_decode.json -C "$(dirname "$RES")" results
}
bench() {  # name, engine, timeout, flags...
    local name=$1 eng=$2 to=$3; shift 3
    log "bench $name: $*"
    timeout "$to" $LLMC bench --engine_dir "$eng" --json "$RES/$name.json" "$@" \
        > "$RES/$name.txt" 2>&1 || { log "bench $name FAILED (rc $?)"; tail -5 "$RES/$name.txt"; status=1; }
    grep -E "output tok|Output|TTFT|TPOT" "$RES/$name.txt" | head -6 >> "$OUT/bench.log"
    pack
}

L8=$ENG/llama3-8b
SM=$ENG/smollm2
if [ "${SKIP_BASE:-0}" != "1" ]; then  # SKIP_BASE=1: only rows on engines they build themselves
    build llama3-8b "$L8"
    build smollm2-135m-dummy "$SM"
fi

profile_run() {
    log "profile (decode-heavy, --trace)"
    timeout 200 $LLMC profile --engine_dir "$L8" --num_requests "${N_PROF:-128}" --isl 128 \
        --osl 256 --warmup 2 --json "$RES/profile_decode.json" --trace "$RES/trace_decode.json" \
        > "$RES/profile_decode.txt" 2>&1 || { log "profile FAILED"; tail -5 "$RES/profile_decode.txt"; status=1; }
    cp "$RES/profile_decode.txt" "$OUT/profile_decode.txt"
    pack
}
F8=$ENG/llama3-8b-fp8
fp8_engine() {  # built on first use: fp8 weights (W8A8) + fp8 KV cache
    [ -f "$F8/manifest.json" ] || build llama3-8b "$F8" --quantization fp8 --kv_cache_dtype fp8
}
W4=$ENG/llama3-8b-int4wo
W8=$ENG/llama3-8b-int8wo
wo_engine() {  # dir, quantization: built on first use (dummy weights quantized at build)
    [ -f "$1/manifest.json" ] || build llama3-8b "$1" --quantization "$2"
}
ROWS=${ROWS:-b1 128 sampled peer smol profile 2048 long nographs fp8b1 fp8128 fp82048 fp8long}
# Row groups, each an issue's rows beside the BF16 rows they are compared with, sized to fit
# one 10-minute call (an H100 ran issue14 + issue17's rows with the FP8 ones in ~400 s):
expand_rows() {
    local r
    for r in $1; do
        case $r in
        issue12) echo "fp8128 fp82048 fp8b1 128 2048 b1 fp8long proffp8" ;;
        issue14) echo "int4b1 int8b1 b1 128 int4128 int8128 int4128pw int8128pw" ;;
        issue17) echo "smol smolb1 b1 128 sampled profsmol smolpw 128pw" ;;
        *) echo "$r" ;;
        esac
    done
}
ROWS=$(expand_rows "$ROWS" | tr '\n' ' ')
for r in $ROWS; do
    case $r in
    b1) bench llama8b_b1_128_512 "$L8" 120 --num_requests "$N_B1" --isl 128 --osl 512 \
            --concurrency 1 --warmup 1 ;;
    smolpw) bench smollm2_128_128_pw "$SM" 200 --num_requests "$N_SMOL" --isl 128 --osl 128 \
            --piecewise_graph_max_tokens 8192 ;;
    128pw) bench llama8b_128_128_pw "$L8" 200 --num_requests "$N_128" --isl 128 --osl 128 \
            --piecewise_graph_max_tokens 8192 ;;
    smolnopw) bench smollm2_128_128_nopw "$SM" 200 --num_requests "$N_SMOL" --isl 128 \
            --osl 128 --piecewise_graph_max_tokens 0 ;;
    128nopw) bench llama8b_128_128_nopw "$L8" 200 --num_requests "$N_128" --isl 128 \
            --osl 128 --piecewise_graph_max_tokens 0 ;;
    2048nopw) bench llama8b_2048_128_nopw "$L8" 200 --num_requests "$N_2048" --isl 2048 \
            --osl 128 --piecewise_graph_max_tokens 0 ;;
    2048pw) bench llama8b_2048_128_pw "$L8" 200 --num_requests "$N_2048" --isl 2048 \
            --osl 128 --piecewise_graph_max_tokens 8192 ;;
    smolb1) bench smollm2_b1_128_512 "$SM" 90 --num_requests "$N_B1" --isl 128 --osl 512 \
            --concurrency 1 --warmup 1 ;;
    b1nopg) bench llama8b_b1_noprefillgraphs "$L8" 90 --num_requests "$N_B1" --isl 128 \
            --osl 512 --concurrency 1 --warmup 1 --prefill_graph_max_tokens 0 ;;
    128) bench llama8b_128_128 "$L8" 200 --num_requests "$N_128" --isl 128 --osl 128 ;;
    sampled) bench llama8b_128_128_sampled "$L8" 200 --num_requests "$N_128" --isl 128 \
            --osl 128 --temperature 0.7 --top_p 0.9 ;;
    peer) bench llama8b_128_128_peer "$L8" 300 --num_requests "$N_PEER" --isl 128 --osl 128 \
            --peer hf ;;
    smol) bench smollm2_128_128_peer "$SM" 200 --num_requests "$N_SMOL" --isl 128 --osl 128 \
            --peer hf ;;
    profile) profile_run ;;
    2048) bench llama8b_2048_128 "$L8" 200 --num_requests "$N_2048" --isl 2048 --osl 128 ;;
    long) bench llama8b_128_2048 "$L8" 200 --num_requests "$N_LONG" --isl 128 --osl 2048 ;;
    b1mb256) bench llama8b_b1_mb256 "$L8" 90 --num_requests "$N_B1" --isl 128 --osl 512 \
            --concurrency 1 --warmup 1 --max_batch_size 256 ;;
    b1prof) log "profile batch 1 (per-kernel table in profile_b1.json)"
        timeout 120 $LLMC profile --engine_dir "$L8" --num_requests 2 --isl 128 --osl 256 \
            --concurrency 1 --warmup 1 --json "$RES/profile_b1.json" \
            > "$RES/profile_b1.txt" 2>&1 || { log "profile b1 FAILED"; status=1; }
        pack ;;
    128mb1024) build llama3-8b "$ENG/llama3-8b-mb1024" --max_batch_size 1024
        bench llama8b_128_128_mb1024 "$ENG/llama3-8b-mb1024" 200 --num_requests "$N_128" \
            --isl 128 --osl 128 ;;
    prof2048) log "profile 2048/128 (kernel families in profile_2048.json)"
        timeout 150 $LLMC profile --engine_dir "$L8" --num_requests 300 --isl 2048 --osl 128 \
            --warmup 2 --json "$RES/profile_2048.json" > "$RES/profile_2048.txt" 2>&1 \
            || { log "profile 2048 FAILED"; status=1; }
        pack ;;
    profsmol) log "profile SmolLM2 shape 128/128 (profile_smol.json)"
        timeout 150 $LLMC profile --engine_dir "$SM" --num_requests 2048 --isl 128 --osl 128 \
            --warmup 2 --json "$RES/profile_smol.json" > "$RES/profile_smol.txt" 2>&1 \
            || { log "profile smol FAILED"; status=1; }
        pack ;;
    proffp8) fp8_engine; log "profile FP8 + FP8 KV 128/128 (kernel families in profile_fp8.json)"
        timeout 200 $LLMC profile --engine_dir "$F8" --num_requests "${N_PROF_FP8:-1500}" --isl 128 \
            --osl 128 --warmup 2 --json "$RES/profile_fp8.json" > "$RES/profile_fp8.txt" 2>&1 \
            || { log "profile fp8 FAILED"; status=1; }
        cp "$RES/profile_fp8.txt" "$OUT/profile_fp8.txt"
        pack ;;
    fp8b1) fp8_engine; bench llama8b_fp8_b1_128_512 "$F8" 120 --num_requests "$N_B1" \
            --isl 128 --osl 512 --concurrency 1 --warmup 1 ;;
    fp8128) fp8_engine; bench llama8b_fp8_128_128 "$F8" 200 --num_requests "$N_128" \
            --isl 128 --osl 128 ;;
    fp82048) fp8_engine; bench llama8b_fp8_2048_128 "$F8" 200 --num_requests "$N_2048" \
            --isl 2048 --osl 128 ;;
    fp8long) fp8_engine; bench llama8b_fp8_128_2048 "$F8" 200 --num_requests "${N_LONG_FP8:-$N_LONG}" \
            --isl 128 --osl 2048 ;;
    int4b1) wo_engine "$W4" int4_wo; bench llama8b_int4wo_b1_128_512 "$W4" 120 \
            --num_requests "$N_B1" --isl 128 --osl 512 --concurrency 1 --warmup 1 ;;
    b1nopdl) LLMC_PDL=0 bench llama8b_b1_nopdl "$L8" 120 --num_requests "$N_B1" --isl 128 \
            --osl 512 --concurrency 1 --warmup 1 ;;
    fp8b1nopdl) fp8_engine; LLMC_PDL=0 bench llama8b_fp8_b1_nopdl "$F8" 120 \
            --num_requests "$N_B1" --isl 128 --osl 512 --concurrency 1 --warmup 1 ;;
    int4b1nopdl) wo_engine "$W4" int4_wo; LLMC_PDL=0 bench llama8b_int4wo_b1_nopdl "$W4" 120 \
            --num_requests "$N_B1" --isl 128 --osl 512 --concurrency 1 --warmup 1 ;;
    int8b1nopdl) wo_engine "$W8" int8_wo; LLMC_PDL=0 bench llama8b_int8wo_b1_nopdl "$W8" 120 \
            --num_requests "$N_B1" --isl 128 --osl 512 --concurrency 1 --warmup 1 ;;
    int4128) wo_engine "$W4" int4_wo; bench llama8b_int4wo_128_128 "$W4" 200 \
            --num_requests "$N_128" --isl 128 --osl 128 ;;
    int8b1) wo_engine "$W8" int8_wo; bench llama8b_int8wo_b1_128_512 "$W8" 120 \
            --num_requests "$N_B1" --isl 128 --osl 512 --concurrency 1 --warmup 1 ;;
    int8128) wo_engine "$W8" int8_wo; bench llama8b_int8wo_128_128 "$W8" 200 \
            --num_requests "$N_128" --isl 128 --osl 128 ;;
    int4128pw) wo_engine "$W4" int4_wo; bench llama8b_int4wo_128_128_pw "$W4" 200 \
            --num_requests "$N_128" --isl 128 --osl 128 --piecewise_graph_max_tokens 8192 ;;
    int8128pw) wo_engine "$W8" int8_wo; bench llama8b_int8wo_128_128_pw "$W8" 200 \
            --num_requests "$N_128" --isl 128 --osl 128 --piecewise_graph_max_tokens 8192 ;;
    beam4) [ -f "$ENG/llama3-8b-beam4/manifest.json" ] \
            || build llama3-8b "$ENG/llama3-8b-beam4" --max_beam_width 4
        bench llama8b_128_128_beam4 "$ENG/llama3-8b-beam4" 300 --num_requests "${N_BEAM:-$N_128}" \
            --isl 128 --osl 128 --beam_width 4 ;;
    b1sync) bench llama8b_b1_sync "$L8" 90 --num_requests "$N_B1" --isl 128 --osl 512 \
            --concurrency 1 --warmup 1 --no_async_scheduling ;;
    nographs) bench llama8b_b1_nographs "$L8" 60 --num_requests 2 --isl 128 --osl 512 \
            --concurrency 1 --warmup 1 --no_cuda_graphs ;;
    fp8128mb*) k=${r#fp8128mb}; e="$ENG/llama3-8b-fp8-mb$k"
        [ -f "$e/manifest.json" ] || build llama3-8b "$e" --quantization fp8 --kv_cache_dtype fp8 \
            --max_batch_size "$k"
        bench "llama8b_fp8_128_128_mb$k" "$e" 200 --num_requests "$N_128" --isl 128 --osl 128 ;;
    smolk*) k=${r#smolk}; bench "smollm2_128_128_k$k" "$SM" 200 --num_requests "$N_SMOL" \
            --isl 128 --osl 128 --decode_steps_per_iteration "$k" ;;
    128k*) k=${r#128k}; bench "llama8b_128_128_k$k" "$L8" 200 --num_requests "$N_128" \
            --isl 128 --osl 128 --decode_steps_per_iteration "$k" ;;
    b1k*) k=${r#b1k}; bench "llama8b_b1_k$k" "$L8" 90 --num_requests "$N_B1" --isl 128 \
            --osl 512 --concurrency 1 --warmup 1 --decode_steps_per_iteration "$k" ;;
    esac
done
pack
cat "$OUT/summary.md"
log "done (status $status)"
exit $status
