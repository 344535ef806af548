"""Shared by the bench/profile tests: a tiny engine and small, cached ceilings."""

from __future__ import annotations

from pathlib import Path

import pytest


def build_tiny_engine(checkpoint: Path, out: Path) -> Path:
    from llmc.compiler.build_config import BuildConfig
    from llmc.compiler.builder import build

    build(
        BuildConfig(
            checkpoint_dir=str(checkpoint),
            output_dir=str(out),
            dtype="float32",
            target="cpu",
            max_seq_len=128,
            max_input_len=64,
            max_num_tokens=64,
            max_batch_size=8,
            tokens_per_block=16,
            force=True,
        )
    )
    return out


@pytest.fixture(autouse=True)
def small_ceilings(tmp_path_factory, monkeypatch):
    """Ceilings measured with small buffers into a private cache (fast, still measured)."""
    import llmc.runtime.bench.ceilings as ceilings

    cache = tmp_path_factory.getbasetemp() / "llmc_cache"
    monkeypatch.setenv("LLMC_CACHE", str(cache))
    real = ceilings.measure
    monkeypatch.setattr(ceilings, "measure", lambda device, *a, **k: real(device, 16 << 20, 256))
