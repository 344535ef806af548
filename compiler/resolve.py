"""Resolve a BuildConfig against a ModelSpec and the machine into concrete engine limits.

``BuildConfig`` leaves some settings to be derived (``None``/``'auto'``); ``resolve_build``
fills them in from the model config and the detected GPU, builds the engine's
``EngineLimits`` (which validates the combination), and returns a frozen ``ResolvedBuild``
plus human-readable notes saying where each derived value came from (the build prints them).
``ResolvedBuild`` is what the engine manifest stores under ``"build"`` and what the runtime
reads back.

GPU detection never initialises CUDA on a machine without an NVIDIA device node, and never
imports torch there, so planning (``llmc build --dry_run``) stays fast.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, EngineError, UnsupportedError
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.exclude_modules import resolve_exclude_modules
from llmc.compiler.limits import EXCLUDABLE_QUANTIZATIONS, EngineLimits
from llmc.compiler.quantization import check_fp8_target
from llmc.compiler.spec import ModelSpec
from llmc.compiler.tp_layout import check_tp, check_tp_size


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
    """The engine's limits and build settings after defaults are derived (manifest ``"build"``,
    stored flat: the limits' fields beside target, load_format and dummy_seed)."""

    limits: EngineLimits
    target: str
    load_format: str
    dummy_seed: int | None
    """The seed of the dummy weights (load_format 'dummy'), else None."""
    tp_size: int = 1
    """Tensor-parallel ranks the weights and plans are split over (compiler/tp_layout.py)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.limits.to_dict(),
            "target": self.target,
            "load_format": self.load_format,
            "dummy_seed": self.dummy_seed,
            "tp_size": self.tp_size,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResolvedBuild:
        limit_names = EngineLimits.field_names()
        names = {*limit_names, "target", "load_format", "dummy_seed", "tp_size"}
        # engines built before beams, TP, --exclude_modules
        d = {"max_beam_width": 1, "tp_size": 1, "float_projections": [], **d}
        missing = sorted(names - set(d))
        unknown = sorted(set(d) - names)
        if missing or unknown:
            raise EngineError(
                f"manifest 'build' section: missing keys {missing}, unknown keys {unknown}"
            )
        return cls(
            limits=EngineLimits(**{k: d[k] for k in limit_names}),
            target=d["target"],
            load_format=d["load_format"],
            dummy_seed=d["dummy_seed"],
            tp_size=check_tp_size(d["tp_size"]),
        )


def resolve_build(
    config: BuildConfig, spec: ModelSpec, gpu: GpuInfo | None, quantization: str | None = None
) -> tuple[ResolvedBuild, tuple[str, ...]]:
    """Derive unset limits from the model; returns (resolved settings, notes on defaults).
    The limits are validated by ``EngineLimits`` (ConfigError naming the values).
    ``quantization``: the engine's, resolved from ``config.quantization`` and the source
    (``gguf_native.resolve_gguf_quantization``); None: config's, 'auto' meaning none."""
    if quantization is None:
        quantization = "none" if config.quantization == "auto" else config.quantization
    notes: list[str] = []
    mpe = spec.max_position_embeddings
    if config.max_seq_len is not None and config.max_seq_len > mpe:
        raise ConfigError(
            f"max_seq_len ({config.max_seq_len}) exceeds the model's max_position_embeddings "
            f"({mpe}); use --max_seq_len {mpe} or less"
        )
    max_seq_len = config.max_seq_len or mpe
    max_input_len = config.max_input_len or max_seq_len
    if config.max_seq_len is None:
        notes.append(f"max_seq_len = {max_seq_len} (the model's max_position_embeddings)")
    if config.max_input_len is None:
        notes.append(f"max_input_len = {max_input_len} (max_seq_len)")
    excluded, exclude_notes = resolve_exclude_modules(spec, config.exclude_modules)
    notes.extend(exclude_notes)
    if excluded and quantization not in EXCLUDABLE_QUANTIZATIONS:  # e.g. auto -> gguf
        raise ConfigError(
            f"--exclude_modules needs --quantization {' / '.join(EXCLUDABLE_QUANTIZATIONS)}; "
            f"this engine's is {quantization!r}"
        )
    if excluded and config.tp_size > 1:
        raise UnsupportedError("--exclude_modules with --tp_size > 1 is not supported yet")
    limits = EngineLimits(
        max_batch_size=config.max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        max_num_tokens=config.max_num_tokens,
        tokens_per_block=config.tokens_per_block,
        enable_chunked_prefill=config.enable_chunked_prefill,
        dtype=config.dtype,
        quantization=quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        max_beam_width=config.max_beam_width,
        float_projections=excluded,
    )
    if config.target == "auto":
        target = gpu.arch if gpu is not None else "cpu"
        where = f"detected {gpu.name}" if gpu is not None else "no GPU detected"
        notes.append(f"target = {target} ({where})")
    else:
        target = config.target
    check_fp8_target(config.quantization, target)  # a detected GPU below sm_89
    check_tp(spec, config.tp_size, quantization, config.kv_cache_dtype)
    dummy = config.load_format == "dummy"
    resolved = ResolvedBuild(
        limits=limits,
        target=target,
        load_format=config.load_format,
        dummy_seed=config.dummy_seed if dummy else None,
        tp_size=config.tp_size,
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
