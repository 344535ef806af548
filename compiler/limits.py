"""EngineLimits: the limits one engine runs under, declared, validated and lowered here only.

Owns:
- ``EngineLimits`` (frozen): max_batch_size, max_input_len, max_seq_len, max_num_tokens,
  tokens_per_block, enable_chunked_prefill, dtype, quantization, kv_cache_dtype and
  max_beam_width, validated
  on construction (what the last two mean: ``llmc.compiler.quantization``);
- the rules on them, each a named function with one wording (``check_positive_int``,
  ``check_input_len``, ``check_chunked_prefill``), which ``BuildConfig`` also calls to refuse
  bad flags early;
- ``EngineLimits.lowered``: a run's optional lowerings (``RuntimeConfig``), refusing a raise.

Its life: ``resolve_build`` derives it from the build flags and the model; the manifest's
``"build"`` section and plan.json store it; ``load_engine`` parses it once
(``LoadedEngine.build.limits``); ``EngineRuntime.load`` lowers it once; the Scheduler and its
admission checks, the KV pool sizing, the ModelRunner, its StepInputBuilder, the workspace
plan and the tuning recommendations read that one object. ``max_num_tokens`` follows
TensorRT-LLM: the per-step token budget (it sizes the workspace and bounds a prefill chunk),
not the KV pool.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "fp8", "int8_wo", "int4_wo", "gguf")
"""Weight quantization: none, fp8 (W8A8, llmc.compiler.quantization), int8_wo / int4_wo
(weight-only, quantized at build) or gguf (a GGUF file's blocks kept; llmc.compiler.wo_layout)."""
BUILD_QUANTIZATIONS = ("auto", "none", "fp8", "int8_wo", "int4_wo")
"""``llmc build --quantization``: auto keeps a quantized GGUF's blocks (gguf), else none."""
KV_CACHE_DTYPES = ("auto", "fp8")
"""KV pool element type: auto (the activation dtype) or fp8 (float8_e4m3fn)."""


def check_positive_int(name: str, value: Any) -> None:
    """ConfigError unless ``value`` is an int (not a bool) above zero."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def check_input_len(max_input_len: int, max_seq_len: int) -> None:
    """A prompt is part of a sequence: max_input_len <= max_seq_len (ConfigError)."""
    if max_input_len > max_seq_len:
        raise ConfigError(
            f"max_input_len ({max_input_len}) must not exceed max_seq_len ({max_seq_len})"
        )


def check_chunked_prefill(
    max_num_tokens: int, max_input_len: int, enable_chunked_prefill: bool
) -> None:
    """With chunked prefill off a prompt is scheduled whole in one step, so the per-step
    budget must hold the longest prompt: max_num_tokens >= max_input_len (ConfigError)."""
    if not enable_chunked_prefill and max_num_tokens < max_input_len:
        raise ConfigError(
            f"max_num_tokens ({max_num_tokens}) is smaller than max_input_len "
            f"({max_input_len}) with chunked prefill off: a prompt of max_input_len tokens "
            f"could never be scheduled; raise max_num_tokens to {max_input_len} or enable "
            "chunked prefill"
        )


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EXCLUDABLE_QUANTIZATIONS = ("fp8", "int8_wo", "int4_wo")
"""The quantizations whose engines may keep some projections in the activation dtype."""


def check_float_projections(limits: EngineLimits) -> tuple[str, ...]:
    """``limits.float_projections`` as a tuple (a manifest gives a list), each
    ``layers.{i}.<projection>`` once, only with a quantization that has them (ConfigError)."""
    names = limits.float_projections
    if not isinstance(names, list | tuple):
        raise ConfigError(f"float_projections must be a list of names, got {names!r:.60}")
    for n in names:
        parts = n.split(".") if isinstance(n, str) else []
        if not (len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit()) or (
            parts[2] not in PROJECTIONS
        ):
            raise ConfigError(
                f"float_projections: {n!r:.60} is not a layer projection (layers.<i>.<one of "
                f"{', '.join(PROJECTIONS)}>)"
            )
    if len(set(names)) != len(names):
        raise ConfigError("float_projections names a projection twice")
    if names and limits.quantization not in EXCLUDABLE_QUANTIZATIONS:
        raise ConfigError(
            f"float_projections apply to quantized engines ({', '.join(EXCLUDABLE_QUANTIZATIONS)}),"
            f" not to quantization {limits.quantization!r}"
        )
    return tuple(names)


@dataclass(frozen=True)
class EngineLimits:
    """The limits of one engine (its build's), or of one run of it (possibly lowered)."""

    max_batch_size: int
    """Most running sequences in one step."""
    max_input_len: int
    """Longest prompt, in tokens."""
    max_seq_len: int
    """Longest prompt + generated tokens."""
    max_num_tokens: int
    """Per-step token budget (decode tokens + prefill chunks); sizes the workspace."""
    tokens_per_block: int
    """KV-cache page size, in tokens."""
    enable_chunked_prefill: bool
    """Split a prompt longer than the step's remaining budget over several steps."""
    dtype: str
    """Activation dtype (and the weights' where they are not quantized)."""
    quantization: str = "none"
    """Weights: none (in dtype), fp8 (e4m3 projections, per-channel scales, W8A8), int8_wo /
    int4_wo (packed projections) or gguf (a GGUF's blocks kept); the per-tensor layouts of
    the packed ones are the manifest's (``llmc.compiler.wo_layout``)."""
    kv_cache_dtype: str = "auto"
    """KV pool elements: auto (dtype) or fp8 (e4m3, a k/v scale pair per layer)."""
    max_beam_width: int = 1
    """Widest beam search a request may ask for (TensorRT-LLM's ``max_beam_width``). Every
    beam is a row of a step, so one request of W beams takes W of ``max_batch_size``'s rows
    and W tokens of a decode step's ``max_num_tokens`` (both must hold W), and the build's
    capacity check holds W sequences of max_seq_len."""
    float_projections: tuple[str, ...] = ()
    """Layer projections (``layers.{i}.qkv_proj`` / ``o_proj`` / ``gate_up_proj`` /
    ``down_proj``) a quantized engine keeps in ``dtype``: what ``--exclude_modules`` named
    (``llmc.compiler.exclude_modules``) or a pre-quantized checkpoint left unquantized.
    Sorted by layer; empty for an engine quantized whole (and for none / gguf)."""

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_input_len",
            "max_seq_len",
            "max_num_tokens",
            "tokens_per_block",
            "max_beam_width",
        ):
            check_positive_int(name, getattr(self, name))
        for name in ("max_batch_size", "max_num_tokens"):
            if getattr(self, name) < self.max_beam_width:
                raise ConfigError(
                    f"{name} ({getattr(self, name)}) is smaller than max_beam_width "
                    f"({self.max_beam_width}): the beams of one request run as rows of one step"
                )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ConfigError(
                f"enable_chunked_prefill must be true or false, got {self.enable_chunked_prefill!r}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name, allowed in (("quantization", QUANTIZATIONS), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        check_input_len(self.max_input_len, self.max_seq_len)
        check_chunked_prefill(self.max_num_tokens, self.max_input_len, self.enable_chunked_prefill)
        object.__setattr__(self, "float_projections", check_float_projections(self))

    @property
    def max_blocks_per_seq(self) -> int:
        """KV blocks one sequence of max_seq_len tokens needs (the block-table width)."""
        return -(-self.max_seq_len // self.tokens_per_block)

    def lowered(
        self,
        *,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        enable_chunked_prefill: bool | None = None,
    ) -> EngineLimits:
        """These limits with a run's settings applied (None: keep). ``max_batch_size`` and
        ``max_num_tokens`` may only go down (the workspace was planned for the build's);
        raising one is a ConfigError naming both values and the rebuild flag. Lowered below
        ``max_beam_width``, the run's beam width is lowered with them."""
        for name, asked in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)):
            built = getattr(self, name)
            if asked is not None and asked > built:
                raise ConfigError(
                    f"{name}={asked} exceeds the engine's {name}={built} (the workspace was "
                    f"planned for it); use {built} or less, or rebuild the engine with "
                    f"--{name} {asked}"
                )
        batch = self.max_batch_size if max_batch_size is None else max_batch_size
        tokens = self.max_num_tokens if max_num_tokens is None else max_num_tokens
        return dataclasses.replace(
            self,
            max_batch_size=batch,
            max_num_tokens=tokens,
            max_beam_width=min(self.max_beam_width, batch, tokens),
            enable_chunked_prefill=self.enable_chunked_prefill
            if enable_chunked_prefill is None
            else enable_chunked_prefill,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))
