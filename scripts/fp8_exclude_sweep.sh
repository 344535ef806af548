#!/usr/bin/env bash
# Issue 12's FP8 quality table over --exclude_modules: the real SmolLM2-135M (its GGUF from
# the model cache) built with fp8 weights + an fp8 KV cache (smooth K) and the smollm2-135m
# profile's limits for the CPU, one engine per EXCLUDES entry, each calibrated under every
# CALS setting in turn (`llmc calibrate` rewrites only the KV scales and k_mean) and scored
# by `llmc eval` over GPL-3 (the scored text; never a calibration text). One line per run
# (name, calibration, perplexity) on stdout and in $OUT/results.tsv; JSON per run in $OUT.
#   scripts/fp8_exclude_sweep.sh
#   EXCLUDES="mlp29=model.layers.29.mlp" CALS="default w1536" scripts/fp8_exclude_sweep.sh
# EXCLUDES: space-separated NAME=PATTERN[,PATTERN...] (NAME=: nothing excluded).
# CALS: default (Apache-2.0, 512-token windows), w1536 (Apache-2.0, --window 1536), mpl
# (MPL-2.0, 512-token windows). Not a timed test: ~3 min per run on 2 CPU cores.
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
LLMC=${LLMC:-$REPO/.venv/bin/llmc}
PY=${PY:-$REPO/.venv/bin/python}
LIC=/usr/share/common-licenses
EXCLUDES=${EXCLUDES:-none= mlp29=model.layers.29.mlp layer29=model.layers.29 layer0_29=model.layers.0,model.layers.29 layer2829=model.layers.28,model.layers.29}
CALS=${CALS:-default w1536 mpl}
ENG=${ENG:-/tmp/llmc-fp8-exclude}
OUT=${OUT:-/tmp/llmc-fp8-exclude-out}
mkdir -p "$OUT" "$ENG"
cd "$(mktemp -d)"
export PYTHONSAFEPATH=1  # the checkout's cuda/ must not shadow NVIDIA's package
GGUF=$("$PY" -m llmc.compiler.model_cache)
for entry in $EXCLUDES; do
    name=${entry%%=*}
    pats=${entry#*=}
    E=$ENG/$name
    flags=()
    [ -n "$pats" ] && flags=(--exclude_modules "$pats")
    "$LLMC" build --profile smollm2-135m --checkpoint_dir "$GGUF" --output_dir "$E" \
        --dtype bfloat16 --target cpu --force --quantization fp8 --kv_cache_dtype fp8 \
        "${flags[@]}" > "$OUT/build-$name.log"
    for cal in $CALS; do
        case $cal in
            default) args=(--text_file "$LIC/Apache-2.0") ;;
            w1536) args=(--text_file "$LIC/Apache-2.0" --window 1536) ;;
            mpl) args=(--text_file "$LIC/MPL-2.0") ;;
            *) echo "unknown calibration $cal" >&2; exit 2 ;;
        esac
        "$LLMC" calibrate --engine_dir "$E" "${args[@]}" --device cpu > "$OUT/cal-$name-$cal.log"
        "$LLMC" eval --engine_dir "$E" --text_file "$LIC/GPL-3" --device cpu \
            --json "$OUT/eval-$name-$cal.json" > "$OUT/eval-$name-$cal.log"
        ppl=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['perplexity'])" \
            "$OUT/eval-$name-$cal.json")
        printf '%s\t%s\t%s\n' "$name" "$cal" "$ppl" | tee -a "$OUT/results.tsv"
    done
done
