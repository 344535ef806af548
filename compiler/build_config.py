"""BuildConfig: every setting of ``llmc build``, frozen, validated once at construction.

Semantics follow TensorRT-LLM: ``max_num_tokens`` is the per-step token budget (it sizes
the activation workspace and bounds a prefill chunk); the KV-cache pool is *not* a build
setting, it is sized when the engine is loaded (``kv_cache_free_gpu_mem_fraction`` of free
memory, or an absolute ``max_kv_tokens``). The build only checks that one request of
``max_seq_len`` tokens can fit on the planned device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, UnsupportedError, did_you_mean
from llmc.compiler.input_bounds import check_field_types
from llmc.compiler.limits import (
    BUILD_QUANTIZATIONS,
    DTYPES,
    EXCLUDABLE_QUANTIZATIONS,
    KV_CACHE_DTYPES,
    check_chunked_prefill,
    check_input_len,
    check_positive_int,
)
from llmc.compiler.quantization import check_choice, check_fp8_target
from llmc.compiler.tp_layout import check_tp_size
from llmc.compiler.wo_layout import DEFAULT_GROUP_SIZE, check_group_size
from llmc.cuda.build import check_min_arch

LOAD_FORMATS = ("auto", "dummy")


def check_exclude_patterns(config: BuildConfig) -> tuple[str, ...]:
    """``exclude_modules`` as a tuple of non-empty strings (a YAML profile gives a list, a
    single string is one pattern), only with a quantization that quantizes projections."""
    pats = config.exclude_modules
    if isinstance(pats, str):
        pats = (pats,)
    if not isinstance(pats, list | tuple) or not all(isinstance(p, str) and p for p in pats):
        raise ConfigError(
            f"exclude_modules must be a list of module-name patterns, got {pats!r:.80}"
        )
    if pats and config.quantization not in EXCLUDABLE_QUANTIZATIONS:
        raise ConfigError(
            f"--exclude_modules keeps projections of a quantized engine in --dtype; it needs "
            f"--quantization {' / '.join(EXCLUDABLE_QUANTIZATIONS)} (got "
            f"{config.quantization!r})"
        )
    return tuple(dict.fromkeys(pats))


@dataclass(frozen=True)
class BuildConfig:
    """Settings of one engine build. ``None`` means "derive from the model config"."""

    checkpoint_dir: str | None = None
    """HF checkpoint directory, a .gguf file, or None with load_format='dummy' + model config."""
    output_dir: str = "engine"
    """Engine directory to write (refused if it exists, unless force)."""
    max_batch_size: int = 256
    """Most requests in one step (running batch)."""
    max_input_len: int | None = None
    """Longest prompt in tokens; default: max_seq_len."""
    max_seq_len: int | None = None
    """Longest prompt + generated tokens; default: the model max_position_embeddings."""
    max_num_tokens: int = 8192
    """Per-step token budget (prefill chunk + decode tokens); sizes the activation workspace."""
    tokens_per_block: int = 32
    """KV-cache page size in tokens."""
    dtype: str = "bfloat16"
    """Activation dtype (and the weights' where not quantized): float32, float16 or bfloat16."""
    quantization: str = "auto"
    """Weights: 'auto' (a GGUF's quantized blocks kept as they are, else 'none'), 'none' (in
    dtype; a GGUF dequantized), 'fp8' (W8A8: e4m3 projections with per-channel scales,
    computed at build; a pre-quantized FP8 checkpoint keeps its codes), 'int8_wo' / 'int4_wo'
    (weight-only, round-to-nearest at build from a float checkpoint)."""
    exclude_modules: tuple[str, ...] = ()
    """Module-name patterns (fnmatch wildcards, HF or llmc names: TensorRT-LLM's
    ``exclude_modules``) whose layer projections stay in ``dtype`` in a quantized engine
    (fp8, int8_wo, int4_wo); ``llmc.compiler.exclude_modules`` resolves them."""
    group_size: int = DEFAULT_GROUP_SIZE
    """int4_wo: elements along K sharing one scale and offset (a power of two dividing K)."""
    kv_cache_dtype: str = "auto"
    """KV cache elements: 'auto' (dtype) or 'fp8' (e4m3, one k/v scale pair per layer)."""
    target: str = "auto"
    """'auto' (detected GPU, else cpu), 'cpu', or a CUDA arch like 'sm_90'."""
    load_format: str = "auto"
    """'auto' reads the checkpoint; 'dummy' stores a seed for random weights."""
    dummy_seed: int = 0
    """Seed of dummy weights."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining step budget over several steps."""
    gpu_memory_gb: float | None = None
    """Device memory for the capacity report when no GPU is present (GiB)."""
    kv_cache_free_gpu_mem_fraction: float = 0.9
    """Fraction of memory left after weights and workspace given to the KV pool (report)."""
    force: bool = False
    """Overwrite an existing output_dir."""
    max_beam_width: int = 1
    """Widest beam search a request may ask for; each beam is a row of a step (at most
    max_batch_size and max_num_tokens), and the capacity check holds that many sequences."""
    tp_size: int = 1
    """Tensor-parallel ranks (TensorRT-LLM's ``--tp_size``): a power of two; the engine holds
    one weight file and one memory plan per rank (``compiler/tp_layout.py``)."""

    def __post_init__(self) -> None:
        # types first (a list where a number belongs, NaN), so the rules below compare numbers
        check_field_types(BuildConfig, self.to_dict(), "build setting")
        # the limit rules are EngineLimits' (compiler/limits.py); a flag given here is
        # refused now, a derived one when resolve_build builds the engine's EngineLimits
        for name in ("max_batch_size", "max_num_tokens", "tokens_per_block", "max_beam_width"):
            check_positive_int(name, getattr(self, name))
        for name in ("max_batch_size", "max_num_tokens"):
            if getattr(self, name) < self.max_beam_width:
                raise ConfigError(
                    f"--{name} {getattr(self, name)} is smaller than --max_beam_width "
                    f"{self.max_beam_width}: the beams of one request run as rows of one step"
                )
        for name in ("max_input_len", "max_seq_len"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_tp_size(self.tp_size)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, BUILD_QUANTIZATIONS)
        check_group_size(self.group_size)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        object.__setattr__(self, "exclude_modules", check_exclude_patterns(self))
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format {self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
            )
        t = self.target
        if not (t in ("auto", "cpu") or (t.startswith("sm_") and t[3:].isdigit())):
            raise UnsupportedError(
                f"target {t!r} is not supported; use auto, cpu or a CUDA arch such as sm_90"
            )
        if t.startswith("sm_"):
            check_min_arch(t)  # (before fp8's rule: its advice assumes a buildable arch)
        check_fp8_target(self.quantization, t)
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            raise ConfigError(
                "kv_cache_free_gpu_mem_fraction must be in (0, 1], got "
                f"{self.kv_cache_free_gpu_mem_fraction}"
            )
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ConfigError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb}")
        if self.max_input_len and self.max_seq_len:
            check_input_len(self.max_input_len, self.max_seq_len)
        if self.max_num_tokens < self.tokens_per_block:
            raise ConfigError(
                f"max_num_tokens ({self.max_num_tokens}) must be at least tokens_per_block "
                f"({self.tokens_per_block})"
            )
        if self.max_input_len:
            check_chunked_prefill(
                self.max_num_tokens, self.max_input_len, self.enable_chunked_prefill
            )

    def replace(self, **changes: Any) -> BuildConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> BuildConfig:
        """Build from a mapping; an unknown key is an error with a suggestion."""
        names = cls.field_names()
        for key in d:
            if key.replace("-", "_") not in names:
                from llmc.base.errors import UsageError

                raise UsageError(
                    f"{source}: unknown build setting {key!r}" + did_you_mean(key, names)
                )
        return cls(**{k.replace("-", "_"): v for k, v in d.items()})
