"""Replacing tensors of a built engine in place: calibrated fp8 KV scales (``llmc
calibrate``) written into ``weights.safetensors`` with the manifest's checksums renewed.

Only tensors the engine already holds may be replaced, each with one of the same shape and
dtype (the engine's tensor table, ``quantization.engine_tensors``, stays what it was). The
engine is loaded with every check first, so a corrupt or foreign directory is refused
before anything is written. New files are written beside the old ones and renamed over
them, weights first and manifest last: a crash before the weights' rename leaves the old
engine; between the two renames the manifest's checksum names the old weights and
``load_engine`` refuses the directory as corrupt (rerun the command: it rewrites both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from llmc.base import version
from llmc.base.errors import ConfigError, EngineError
from llmc.base.text import printable
from llmc.compiler.engine_files import sha256_file
from llmc.compiler.engine_format import MANIFEST, WEIGHTS, LoadedEngine, load_engine


def _replace(path: Path, write: Any) -> None:
    """``write(tmp)`` a sibling file, fsync it, rename it over ``path``."""
    tmp = path.with_name(path.name + ".llmc-new")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot rewrite {printable(path)}: {e.strerror or e}") from e


def replace_tensors(
    engine_dir: str | Path, tensors: Mapping[str, torch.Tensor], record: Mapping[str, Any]
) -> LoadedEngine:
    """Write ``tensors`` over the engine's tensors of the same names; store ``record``
    under the manifest's ``calibration`` key; return the engine loaded again (every check)."""
    from safetensors.torch import load_file, save_file

    engine = load_engine(engine_dir)
    if engine.build.load_format == "dummy":
        raise ConfigError(
            f"{printable(engine.dir)} is a dummy-weights engine (no weights file): "
            "build it from a checkpoint to store calibrated tensors"
        )
    current = load_file(engine.dir / WEIGHTS)
    for name, t in tensors.items():
        old = current.get(name)
        if old is None or old.shape != t.shape or old.dtype != t.dtype:
            have = "absent" if old is None else f"{old.dtype} {tuple(old.shape)}"
            raise EngineError(
                f"{printable(engine.dir)}: tensor {name!r} cannot be replaced by "
                f"{t.dtype} {tuple(t.shape)} (the engine's is {have})"
            )
        current[name] = t.detach().to("cpu").contiguous()
    meta = {"format": "pt", "llmc_version": version.__version__}
    _replace(engine.dir / WEIGHTS, lambda p: save_file(current, p, meta))
    manifest = dict(engine.manifest)
    manifest["files"] = {**manifest["files"], WEIGHTS: sha256_file(engine.dir / WEIGHTS)}
    manifest["calibration"] = dict(record)
    _replace(engine.dir / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1)))
    return load_engine(engine.dir)
