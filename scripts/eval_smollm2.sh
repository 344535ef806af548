#!/usr/bin/env bash
# The quality table of issue 12 on CPU: `llmc eval` perplexity of the real SmolLM2-135M
# (from its GGUF, fetched into the model cache by `python -m llmc.compiler.model_cache`)
# over a text (default: /usr/share/common-licenses/GPL-3), one engine per DTYPES entry
# (default: float32 bfloat16), every engine with the smollm2-135m profile's limits (windows
# of max_input_len = 1536 tokens), built for the CPU target into $ENG.
# Writes $OUT/eval-<dtype>.json and prints one line per engine; not a timed test.
#   scripts/eval_smollm2.sh                       # both dtypes over GPL-3
#   DTYPES=bfloat16 TEXT=other.txt scripts/eval_smollm2.sh
# EXTRA (e.g. "--max_windows 2") is passed to every `llmc eval`; BUILD_EXTRA to every build
# (e.g. "--quantization fp8"). The DTYPES rows dequantize the GGUF (--quantization none);
# the WEIGHT_ONLY rows (default: gguf int8_wo int4_wo, float32 activations) are the GGUF
# kept native (its own Q4_1 / Q8_0 blocks) and int8_wo / int4_wo (group 64: K = 576 takes
# no group of 128) built from the GGUF imported into a float32 HF checkpoint.
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
TEXT=${TEXT:-/usr/share/common-licenses/GPL-3}
DTYPES=${DTYPES:-float32 bfloat16}
WEIGHT_ONLY=${WEIGHT_ONLY-gguf int8_wo int4_wo}
ENG=${ENG:-/tmp/llmc-eval-engines}
OUT=${OUT:-$REPO/eval-out}
mkdir -p "$OUT" "$ENG"
OUT=$(cd "$OUT" && pwd)
# Python must not run with the checkout on sys.path: its cuda/ shadows NVIDIA's package.
cd "$(mktemp -d)"
export PYTHONSAFEPATH=1
GGUF=$("$PY" -m llmc.compiler.model_cache)
evaluate() {  # NAME ENGINE_DIR → $OUT/eval-NAME.json
    echo "+ llmc eval --engine_dir $2 --text_file $TEXT --device cpu ${EXTRA:-}"
    # shellcheck disable=SC2086
    "$PY" -m llmc.cli.main eval --engine_dir "$2" --text_file "$TEXT" --device cpu \
        --json "$OUT/eval-$1.json" ${EXTRA:-}
}
for dtype in $DTYPES; do
    engine="$ENG/smollm2-$dtype"
    if [ ! -f "$engine/manifest.json" ]; then
        # shellcheck disable=SC2086
        "$PY" -m llmc.cli.main build --profile smollm2-135m --checkpoint_dir "$GGUF" \
            --output_dir "$engine" --dtype "$dtype" --target cpu --force --quantization none \
            ${BUILD_EXTRA:-} >/dev/null
    fi
    evaluate "$dtype" "$engine"
done
for wo in $WEIGHT_ONLY; do
    engine="$ENG/smollm2-$wo"
    if [ ! -f "$engine/manifest.json" ]; then
        case $wo in
            gguf) src=$GGUF flags="" ;;
            int8_wo) src=$ENG/smollm2-hf flags="--quantization int8_wo" ;;
            int4_wo) src=$ENG/smollm2-hf flags="--quantization int4_wo --group_size 64" ;;
            *) echo "unknown WEIGHT_ONLY entry $wo (gguf, int8_wo, int4_wo)" >&2; exit 2 ;;
        esac
        if [ "$wo" != gguf ] && [ ! -f "$ENG/smollm2-hf/config.json" ]; then
            "$PY" -m llmc.cli.main import --gguf "$GGUF" --output_dir "$ENG/smollm2-hf" >/dev/null
        fi
        # shellcheck disable=SC2086
        "$PY" -m llmc.cli.main build --profile smollm2-135m --checkpoint_dir "$src" \
            --output_dir "$engine" --dtype float32 --target cpu --force $flags \
            ${BUILD_EXTRA:-} >/dev/null
    fi
    evaluate "$wo" "$engine"
done
"$PY" - "$OUT" $DTYPES $WEIGHT_ONLY <<'EOF'
import json, sys
out, dtypes = sys.argv[1], sys.argv[2:]
print(f"{'dtype':<10} {'perplexity':>11} {'mean NLL':>9} {'tokens':>7} {'windows':>7} {'s':>7}")
for d in dtypes:
    r = json.load(open(f"{out}/eval-{d}.json"))
    print(f"{d:<10} {r['perplexity']:>11.4f} {r['nll_mean']:>9.5f} {r['tokens_scored']:>7} "
          f"{r['windows']:>7} {r['seconds']:>7.1f}")
EOF
