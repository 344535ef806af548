"""Resolve a BuildConfig against a ModelSpec and the machine into concrete engine limits.

``BuildConfig`` leaves some settings to be derived (``None``/``'auto'``); ``resolve_build``
fills them in from the model config and the detected GPU, validates the combination, and
returns a frozen ``ResolvedBuild`` plus human-readable notes saying where each derived
value came from (the build prints them). ``ResolvedBuild`` is what the engine manifest
stores under ``"build"`` and what the runtime reads back.

GPU detection never initialises CUDA on a machine without an NVIDIA device node, and never
imports torch there, so planning (``llmc build --dry_run``) stays fast.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, EngineError
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.spec import ModelSpec


@dataclass(frozen=True)
class GpuInfo:
    """The first visible CUDA device."""

    name: str
    arch: str
    """e.g. 'sm_90'."""
    free_bytes: int
    total_bytes: int


def detect_gpu() -> GpuInfo | None:
    """The CUDA device torch would use, or None (without importing torch when no device)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return None
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/nvidiactl"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    free, total = torch.cuda.mem_get_info(0)
    return GpuInfo(torch.cuda.get_device_name(0), f"sm_{major}{minor}", int(free), int(total))


@dataclass(frozen=True)
class ResolvedBuild:
    """The engine's limits and settings after defaults are derived (manifest ``"build"``)."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    dtype: str
    target: str
    load_format: str
    dummy_seed: int | None
    """The seed of the dummy weights (load_format 'dummy'), else None."""
    enable_chunked_prefill: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResolvedBuild:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(d))
        unknown = sorted(set(d) - names)
        if missing or unknown:
            raise EngineError(
                f"manifest 'build' section: missing keys {missing}, unknown keys {unknown}"
            )
        return cls(**d)


def resolve_build(
    config: BuildConfig, spec: ModelSpec, gpu: GpuInfo | None
) -> tuple[ResolvedBuild, tuple[str, ...]]:
    """Derive unset limits from the model; returns (resolved settings, notes on defaults)."""
    notes: list[str] = []
    mpe = spec.max_position_embeddings
    if config.max_seq_len is None:
        max_seq_len = mpe
        notes.append(f"max_seq_len = {max_seq_len} (the model's max_position_embeddings)")
    else:
        max_seq_len = config.max_seq_len
        if max_seq_len > mpe:
            raise ConfigError(
                f"max_seq_len ({max_seq_len}) exceeds the model's max_position_embeddings "
                f"({mpe}); use --max_seq_len {mpe} or less"
            )
    if config.max_input_len is None:
        max_input_len = max_seq_len
        notes.append(f"max_input_len = {max_input_len} (max_seq_len)")
    else:
        max_input_len = config.max_input_len
    if max_input_len > max_seq_len:
        raise ConfigError(
            f"max_input_len ({max_input_len}) must not exceed max_seq_len ({max_seq_len})"
        )
    if not config.enable_chunked_prefill and config.max_num_tokens < max_input_len:
        raise ConfigError(
            f"max_num_tokens ({config.max_num_tokens}) is smaller than max_input_len "
            f"({max_input_len}) with chunked prefill off: one prompt could never be scheduled; "
            f"raise max_num_tokens to {max_input_len} or enable chunked prefill"
        )
    if config.target == "auto":
        target = gpu.arch if gpu is not None else "cpu"
        where = f"detected {gpu.name}" if gpu is not None else "no GPU detected"
        notes.append(f"target = {target} ({where})")
    else:
        target = config.target
    dummy = config.load_format == "dummy"
    resolved = ResolvedBuild(
        max_batch_size=config.max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        max_num_tokens=config.max_num_tokens,
        tokens_per_block=config.tokens_per_block,
        dtype=config.dtype,
        target=target,
        load_format=config.load_format,
        dummy_seed=config.dummy_seed if dummy else None,
        enable_chunked_prefill=config.enable_chunked_prefill,
    )
    return resolved, tuple(notes)


def device_memory(
    config: BuildConfig, gpu: GpuInfo | None
) -> tuple[int | None, str]:  # (bytes, where it came from)
    """Memory the capacity report plans for: the detected GPU's free memory, else
    ``gpu_memory_gb``, else none (the report then says so)."""
    if gpu is not None:
        return gpu.free_bytes, f"free memory of {gpu.name} (detected)"
    if config.gpu_memory_gb is not None:
        return int(config.gpu_memory_gb * (1 << 30)), f"--gpu_memory_gb {config.gpu_memory_gb}"
    return None, "no GPU detected and no --gpu_memory_gb given"
