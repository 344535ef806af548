#!/usr/bin/env bash
# Issue 15's H200 check in ONE device call (< 8 minutes): `llmc serve` + `llmc bench --url`
# against in-process `llmc bench` on the same engine and workload.
#
# 1. installs the carried wheels (.whl/: fastapi, starlette, pydantic + pydantic-core,
#    uvicorn, httptools, ... — the image has none of them) into /tmp/site, then llmc itself;
# 2. builds the Llama-3-8B-shape BF16 dummy engine (profiles/llama3-8b.yaml, sm_90);
# 3. in-process: 128/128, N requests at concurrency C (3,000 at 256), then concurrency 1;
# 4. starts `llmc serve` on 127.0.0.1, runs the same two workloads through
#    `llmc bench --url`, then stops the server with SIGTERM (it must drain and exit 0);
# 5. prints ONE summary (scripts/serve_summary.py: the two targets, and where the served
#    first token's time went: the server's admit/queue/compute/deliver stages of each HTTP
#    run, from /metrics scraped after each) and packs every result into $OUT.
# 6. with MNT2=T (e.g. 2048): the concurrency-256 pair once more with --max_num_tokens T on
#    both sides (shorter mixed steps: docs/SERVE.md "Where the served time goes"), ~80 s more.
# Env: N (3000), CONC (256), N_C1 (32 requests, 128/32), PORT (8000), LLMC_COMMIT (the commit
# to name: the device copy of the tree keeps a stale .git); for a CPU dry run of the script:
# ENGINE=DIR (skip the build), ISL/OSL, SKIP_WHEELS=1, EXTRA="--device cpu". EXTRA goes to
# the in-process runs and to the server alike (e.g. EXTRA="--max_num_tokens 2048").
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/serve-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RES=$(mktemp -d)/results
mkdir -p "$RES"
cd "$(mktemp -d)"  # never run Python from the checkout (its cuda/ shadows NVIDIA's package)
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
LLMC="$PY -m llmc.cli.main"
ENG=${ENG:-/tmp/llmc-engines}/llama3-8b
N=${N:-3000}
CONC=${CONC:-256}
N_C1=${N_C1:-32}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT/v1
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/serve_h200.log"; }
pack() { tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" results; }

if [ "${SKIP_WHEELS:-0}" != 1 ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$REPO"/.whl/*.whl || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c 'import fastapi, uvicorn, httptools, prometheus_client, aiohttp, pydantic_core' \
    || { echo "the server's packages are missing: carry .whl (scripts/serve_h200.sh header)"; exit 1; }
if ! $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" > "$OUT/install.log" 2>&1; then
    echo "install failed"; tail -20 "$OUT/install.log"; exit 1
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "commit ${LLMC_COMMIT:-unknown}"; } >> "$OUT/serve_h200.log" 2>&1

if [ -n "${ENGINE:-}" ]; then  # an engine already built (a CPU dry run of this script)
    ENG=$ENGINE
else
    log "build llama3-8b"
    timeout 300 $LLMC build --profile llama3-8b --output_dir "$ENG" --target sm_90 \
        --dtype bfloat16 --force >> "$OUT/serve_h200.log" 2>&1 || { log "build FAILED"; exit 1; }
fi

status=0
ISL=${ISL:-128}
OSL=${OSL:-128}
W256=(--num_requests "$N" --isl "$ISL" --osl "$OSL" --concurrency "$CONC" --warmup 8)
WC1=(--num_requests "$N_C1" --isl "$ISL" --osl 32 --concurrency 1 --warmup 2)
run() {  # name, timeout, bench flags...
    local name=$1 to=$2; shift 2
    log "bench $name: $*"
    timeout "$to" $LLMC bench --json "$RES/$name.json" "$@" > "$RES/$name.txt" 2>&1 \
        || { log "bench $name FAILED (rc $?)"; tail -5 "$RES/$name.txt"; status=1; }
    grep -E "Output tokens/s|TTFT|Completed" "$RES/$name.txt" | head -4 | tee -a "$OUT/serve_h200.log"
    pack
}
run inproc_256 150 --engine_dir "$ENG" "${W256[@]}" ${EXTRA:-}
run inproc_c1 90 --engine_dir "$ENG" "${WC1[@]}" ${EXTRA:-}

ready() {  # wait up to $1 s for /health to say 200 while the server lives (no curl needed)
    $PY - "$1" "$PORT" "$SERVER" <<'EOF'
import os, sys, time, urllib.request
limit, port, pid = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            sys.exit(0 if r.status == 200 else 1)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
EOF
}
scrape() {  # the server's /metrics into $RES/$1 (the summary subtracts one from the next)
    $PY -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
        > "$RES/$1" 2>&1
}
serve_start() {  # log file, extra serve flags...
    local logf=$1; shift
    log "llmc serve on 127.0.0.1:$PORT $*"
    $LLMC serve --engine "llama3-8b=$ENG" --host 127.0.0.1 --port "$PORT" "$@" \
        > "$RES/$logf" 2>&1 &
    SERVER=$!
    if ready 180; then
        log "server ready: $(grep -m1 'ready' "$RES/$logf")"
        return 0
    fi
    log "server did not get ready"; tail -20 "$RES/$logf"; status=1
    return 1
}
serve_stop() {
    kill -TERM $SERVER 2>/dev/null
    timeout 60 tail --pid=$SERVER -f /dev/null
    wait $SERVER; local rc=$?
    log "server exited with $rc after SIGTERM (0 expected)"
    [ "$rc" = 0 ] || status=1
}
if serve_start serve.log ${EXTRA:-}; then
    run http_256 150 --url "$URL" --model llama3-8b --engine_dir "$ENG" "${W256[@]}"
    scrape metrics_256.txt
    run http_c1 90 --url "$URL" --model llama3-8b --engine_dir "$ENG" "${WC1[@]}"
    scrape metrics.txt
fi
serve_stop
if [ -n "${MNT2:-}" ]; then  # the 256 pair again with a smaller step budget on both sides
    run inproc_256_mnt 150 --engine_dir "$ENG" "${W256[@]}" ${EXTRA:-} --max_num_tokens "$MNT2"
    if serve_start serve_mnt.log ${EXTRA:-} --max_num_tokens "$MNT2"; then
        run http_256_mnt 150 --url "$URL" --model llama3-8b --engine_dir "$ENG" "${W256[@]}"
    fi
    serve_stop
fi
cp "$RES/serve.log" "$OUT/serve.log"
pack
$PY "$REPO/scripts/serve_summary.py" "$RES" | tee "$OUT/serve_summary.md"
cp "$RES/serve_summary.json" "$OUT/" 2>/dev/null
log "done (status $status)"
exit $status
