#!/usr/bin/env bash
# Download, HERE (PyPI reachable), the wheels the H200 image lacks for `llmc serve` and the
# GGUF tests: FastAPI + Starlette + pydantic(-core) + uvicorn (httptools, uvloop, h11) and
# their pure-Python dependencies, and gguf — built for the image's python3.12 / manylinux
# x86_64, into ./.whl (git-ignored; a device call carries it: carry [".whl"]). The image's
# own packages (numpy, pyyaml, requests and its dependencies, click) are not fetched: the
# image's versions stay in use. scripts/device_test.sh and the H200 scripts install .whl/
# into /tmp/site with --no-deps.
#
#   bash scripts/fetch_device_wheels.sh        # then: run(..., carry=[".whl"])
set -eu
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${DEST:-$REPO/.whl}
PY=${PY:-python3}
mkdir -p "$DEST"
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --dest "$DEST" \
    fastapi uvicorn httptools uvloop gguf
# the image has these (and a second copy would shadow its own): keep them out
rm -f "$DEST"/numpy-* "$DEST"/PyYAML-* "$DEST"/pyyaml-* "$DEST"/requests-* "$DEST"/urllib3-* \
    "$DEST"/certifi-* "$DEST"/charset_normalizer-* "$DEST"/idna-* "$DEST"/click-*
ls "$DEST" | sed 's/-py.*//; s/-cp.*//' | tr '\n' ' '
echo
du -sh "$DEST"
