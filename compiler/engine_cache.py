"""The engine cache of ``LLM(checkpoint_dir=...)``: a checkpoint built on the fly into
``$LLMC_CACHE/engines/<key>`` and reused while neither the checkpoint nor the build config
changes (the key hashes both, and the llmc and engine format versions).

Invariant: an entry is complete when its manifest.json exists (the builder writes the
directory atomically), so a concurrent build of the same key is harmless."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from llmc.base import version
from llmc.base.errors import CheckpointError, ConfigError
from llmc.base.paths import cache_dir
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.output_dir import is_llmc_output


def _fingerprint(checkpoint: Path) -> list[tuple[str, int, int]]:
    files = [checkpoint] if checkpoint.is_file() else sorted(checkpoint.rglob("*"))
    out = []
    for f in files:
        if f.is_file():
            st = f.stat()
            name = f.name if f == checkpoint else f.relative_to(checkpoint).as_posix()
            out.append((name, st.st_size, st.st_mtime_ns))
    return out


def engine_cache_dir(checkpoint_dir: str | Path, build_config: BuildConfig) -> Path:
    """Where ``LLM(checkpoint_dir=...)`` keeps the engine built from this checkpoint and
    config: ``$LLMC_CACHE/engines/<key>`` (default ``~/.cache/llmc``). The key hashes the
    checkpoint's absolute path, every file's size and mtime, the build config (output_dir and
    force aside) and the llmc and engine format versions, so any change builds anew."""
    ckpt = Path(checkpoint_dir).expanduser().resolve()
    if not ckpt.exists():
        raise CheckpointError(f"checkpoint_dir {str(checkpoint_dir)!r} does not exist")
    settings = {
        k: v
        for k, v in build_config.to_dict().items()
        if k not in ("checkpoint_dir", "output_dir", "force")
    }
    key = {
        "checkpoint": str(ckpt),
        "files": _fingerprint(ckpt),
        "build_config": settings,
        "llmc_version": version.__version__,
        "format_version": version.ENGINE_FORMAT_VERSION,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "engines" / f"{ckpt.name}-{digest}"


def cached_build(checkpoint_dir: str | Path, build_config: BuildConfig | None) -> Path:
    """Build the checkpoint into its cache directory unless a complete engine is there."""
    cfg = build_config or BuildConfig()
    dest = engine_cache_dir(checkpoint_dir, cfg)
    if (dest / "manifest.json").is_file():
        return dest
    cfg = cfg.replace(checkpoint_dir=str(checkpoint_dir), output_dir=str(dest), force=False)
    try:
        builder.build(cfg)
    except ConfigError:
        if not (dest / "manifest.json").is_file():  # not a concurrent build of the same key
            raise
    return dest


def rebuild(checkpoint_dir: str | Path, build_config: BuildConfig | None) -> Path:
    """Build the checkpoint into its cache directory again (a stale or damaged entry)."""
    cfg = build_config or BuildConfig()
    dest = engine_cache_dir(checkpoint_dir, cfg)
    if dest.is_dir() and not dest.is_symlink() and not is_llmc_output(dest, "engine"):
        # a damaged entry (no readable manifest) that --force would refuse: the cache's
        # own directory, named by its key, so it is removed here
        shutil.rmtree(dest)
    builder.build(cfg.replace(checkpoint_dir=str(checkpoint_dir), output_dir=str(dest), force=True))
    return dest
