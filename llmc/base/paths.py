"""Where llmc keeps files between runs: ``$LLMC_CACHE``, else ``~/.cache/llmc`` (the SmolLM2
file, engines built from GGUF files, measured ceilings, compiled cubins)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """llmc's cache folder (not created here)."""
    return Path(os.environ.get("LLMC_CACHE", Path.home() / ".cache" / "llmc"))
