#!/usr/bin/env bash
# Same-machine A/B of `llmc bench` (or VERB=profile) between two trees, in one device call:
# the checkout (new) against OLD (a commit of this repository's history), alternating runs
# on one engine of PROFILE, each tree reinstalled before its runs. Results (JSON, logs):
# $OUT/ab.tgz; one line per run on stdout (output tok/s, and the GPU idle share of a profile).
#   OLD=a5abe1f PROFILE=smollm2-135m-dummy PAIRS=2 BENCH="--num_requests 4096 --isl 128 \
#     --osl 128" bash scripts/ab_async.sh
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/ab-out}/ab
mkdir -p "$OUT"
PY=${PY:-python3}
OLD=${OLD:?OLD=<commit> is the baseline tree}
PROFILE=${PROFILE:-smollm2-135m-dummy}
PAIRS=${PAIRS:-2}
BENCH=${BENCH:---num_requests 4096 --isl 128 --osl 128}
VERB=${VERB:-bench}  # or profile (GPU idle share, kernel families)
rm -rf /tmp/ab-old && git -C "$REPO" worktree prune  # (a machine kept warm has the last one)
git -C "$REPO" worktree add -f /tmp/ab-old "$OLD" > "$OUT/worktree.log" 2>&1 || {
    echo "no worktree of $OLD"; cat "$OUT/worktree.log"; exit 1; }
cd "$(mktemp -d)"  # (Python must not run from a checkout: its cuda/ shadows NVIDIA's)
install() { $PY -m pip install -q --no-deps --no-build-isolation -e "$1" > "$OUT/install.log" 2>&1; }
install "$REPO"
ENG=/tmp/ab-engine
$PY -m llmc.cli.main build --profile "$PROFILE" --output_dir "$ENG" --target sm_90 \
    --dtype bfloat16 --force > "$OUT/build.log" 2>&1 \
    || { tail -5 "$OUT/build.log"; exit 1; }
for i in $(seq 1 "$PAIRS"); do
    for side in old new; do
        if [ $side = old ]; then install /tmp/ab-old; else install "$REPO"; fi
        # shellcheck disable=SC2086
        timeout 200 $PY -m llmc.cli.main "$VERB" --engine_dir "$ENG" $BENCH \
            --json "$OUT/$side-$i.json" > "$OUT/$side-$i.txt" 2>&1
        echo "$side $i: $(grep -m1 -iE "output tok" "$OUT/$side-$i.txt")" \
            "$(grep -o '"idle_share": [0-9.]*' "$OUT/$side-$i.json" | head -1)"
    done
done
install "$REPO"
tar czf "$OUT/../ab.tgz" -C "$OUT" . && rm -rf "$OUT"  # (the device tool returns <= 8 files)
