"""Bounds on what llmc reads from files it did not write: one home for every size limit.

What this module owns:
- the named limits (``MAX_*``) on model sizes (config.json, GGUF metadata, ModelSpec) and on
  the structure of GGUF headers and YAML profiles, each with the reason for its value. A value
  past its limit is refused *before* anything proportional to it is allocated or looped over,
  and the message names the value and the limit;
- typed reads of checkpoint values (``config_int``, ``config_float``): a wrong type, NaN/inf
  or a fractional size is a CheckpointError naming the key, never a bare ValueError;
- ``check_model_sizes``: the size limits of a model, used by the HF reader (config.json key
  names), the GGUF reader (GGUF key names) and ModelSpec's own validation (field names);
- ``load_yaml``: a YAML file (profile or model config) read as UTF-8 with its size, its
  nesting and the expansion of its aliases bounded (a "billion laughs" file fails at once);
- ``check_field_types``: the values of a frozen config dataclass against its annotations.

Every limit is far above any real model (the largest open models have ~126 layers, hidden
16384, vocabularies of ~256k): a value past one is a corrupt or hostile file, not a model.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmc.base.errors import CheckpointError, ConfigError, LlmcError, UsageError

# ---- model sizes ---------------------------------------------------------------------------
MAX_LAYERS = 1024
"""Decoder layers. Llama 3.1 405B has 126; per-layer work (tensor tables, KV planning) is a
Python loop, so 1e9 layers would run for minutes into a MemoryError."""
MAX_HIDDEN_SIZE = 1 << 17
"""Hidden size (131072). The largest open models use 16384; 8x headroom."""
MAX_INTERMEDIATE_SIZE = 1 << 20
"""MLP width (1048576). Llama 3.1 405B uses 53248."""
MAX_VOCAB_SIZE = 1 << 22
"""Vocabulary (4194304 tokens). The largest tokenizers have ~256k entries; embedding and
lm_head rows and the sampling kernels' rows scale with it."""
MAX_HEADS = 1024
"""Attention (and KV) heads. Real models have at most 128."""
MAX_HEAD_DIM = 256
"""Head dimension. The decode-attention kernel keeps a G x head_dim float accumulator per warp
in shared memory and the RoPE tables are head_dim / 2 wide; 256 is the largest any supported
model family uses (and FlashAttention's limit). Larger is real but unsupported."""
MAX_POSITION_EMBEDDINGS = 1 << 24
"""Context length (16M tokens). The longest open models claim 10M; RoPE tables and the default
max_seq_len follow it."""
MAX_PARAMETERS = 4 * 10**12
"""Total parameters of the engine tensors: above the largest open models (~1T) but small enough
that a corrupt product of bounded sizes cannot ask the planner for exabytes."""

MODEL_SIZE_LIMITS: dict[str, int] = {
    "vocab_size": MAX_VOCAB_SIZE,
    "hidden_size": MAX_HIDDEN_SIZE,
    "intermediate_size": MAX_INTERMEDIATE_SIZE,
    "num_layers": MAX_LAYERS,
    "num_heads": MAX_HEADS,
    "num_kv_heads": MAX_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
}
"""ModelSpec field → its limit (head_dim's is an UnsupportedError, the others CheckpointErrors)."""

HF_CONFIG_KEYS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
}
"""config.json key → the ModelSpec field (and so the limit) it sets."""

# ---- file structure ------------------------------------------------------------------------
MAX_GGUF_METADATA_KEYS = 1 << 16
"""Metadata entries of a GGUF header. Real files have ~40."""
MAX_TENSORS = 1 << 16
"""Tensors of one checkpoint (GGUF table or safetensors index). MAX_LAYERS layers of ~12
tensors each stay well below it."""
MAX_GGUF_ARRAY_LEN = 1 << 24
"""Elements of one GGUF metadata array (16M). The longest real arrays, vocabularies and BPE
merges, have a few hundred thousand."""
MAX_GGUF_ARRAY_DEPTH = 4
"""Nesting of GGUF arrays of arrays. No llama.cpp key nests at all; each level is a recursion
of the parser, so a deep one would end in a RecursionError."""
MAX_GGUF_STRING_BYTES = 1 << 24
"""One GGUF metadata string (16 MiB). Chat templates, the longest real strings, are ~10 KiB."""
MAX_YAML_BYTES = 1 << 20
"""A YAML profile or model config file (1 MiB). The built-in profiles are ~1 KiB."""
MAX_YAML_VALUES = 100_000
"""Values in a YAML file after alias expansion. A profile has ~50; a "billion laughs" file of
a few hundred bytes expands to 10**9 through nested aliases."""


# ---- typed reads of checkpoint values ------------------------------------------------------
def config_int(value: Any, key: str, where: str) -> int:
    """``value`` as an int: an int (not a bool) or an integral finite float (JSON 1e9);
    CheckpointError naming ``where``/``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{where}: {key} must be an integer, got {_short(value)}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise CheckpointError(f"{where}: {key} must be an integer, got {value!r}")
    return int(value)


def config_float(value: Any, key: str, where: str) -> float:
    """``value`` as a finite float (an int or a float, not a bool); CheckpointError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{where}: {key} must be a number, got {_short(value)}")
    if not math.isfinite(value):
        raise CheckpointError(f"{where}: {key} must be a finite number, got {value!r}")
    return float(value)


def check_size(value: int, key: str, limit: int, where: str) -> None:
    """CheckpointError when ``value`` (already an int) is above ``limit``, naming both."""
    if value > limit:
        raise CheckpointError(
            f"{where}: {key} = {value} exceeds llmc's limit of {limit} "
            "(a corrupt or hostile file; no real model is this large)"
        )


def check_model_sizes(sizes: Mapping[str, int], where: str, names: Mapping[str, str]) -> None:
    """Each of ``sizes`` (keyed by the file's own key names) against its limit; ``names`` maps
    a file key to the ModelSpec field whose limit applies. Non-ints are left to the caller."""
    from llmc.base.errors import UnsupportedError

    for key, value in sizes.items():
        field = names.get(key, key)
        limit = MODEL_SIZE_LIMITS.get(field)
        if limit is None or not isinstance(value, int) or value <= limit:
            continue
        if field == "head_dim":
            raise UnsupportedError(
                f"{where}: {key} = {value} is not supported (the kernels support head_dim up "
                f"to {MAX_HEAD_DIM})"
            )
        check_size(value, key, limit, where)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- YAML ------------------------------------------------------------------------------------
def load_yaml(path: Path, what: str) -> Any:
    """A YAML file as Python data, bounded: at most MAX_YAML_BYTES of UTF-8 and MAX_YAML_VALUES
    values after alias expansion. UsageError naming ``what`` (e.g. "profile x.yaml") else."""
    import yaml

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"{what}: cannot read ({e.strerror or e})") from None
    if len(raw) > MAX_YAML_BYTES:
        raise UsageError(f"{what}: {len(raw)} bytes is over the limit of {MAX_YAML_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what}: not UTF-8 text (byte {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(f"{what}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise UsageError(f"{what}: YAML nested too deeply") from None
    _check_expansion(data, what)
    return data


def _check_expansion(data: Any, what: str) -> None:
    """Count values as a reader would see them (aliases expanded); stop at the limit. An
    explicit stack, so a self-referencing alias or deep nesting cannot recurse."""
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise UsageError(
                f"{what}: expands to more than {MAX_YAML_VALUES} values (YAML aliases?); "
                "llmc refuses files past that limit"
            )
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple | set):
            stack.extend(node)


# ---- typed config dataclasses ----------------------------------------------------------------
def check_field_types(
    cls: type, values: Mapping[str, Any], where: str, error: type[LlmcError] = ConfigError
) -> None:
    """Each of ``values`` against the annotation of ``cls``'s field of that name: int (not a
    bool), finite float (an int passes), str, bool, each optionally ``| None``. Unknown names
    and other annotations are left to the class. Raises ``error`` naming the key."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None:
            continue
        allowed = typing.get_args(hint) if typing.get_origin(hint) is not None else (hint,)
        if value is None and type(None) in allowed:
            continue
        if not any(_is_a(value, t) for t in allowed if t is not type(None)):
            names = " or ".join(_KINDS.get(t, getattr(t, "__name__", str(t))) for t in allowed)
            raise error(f"{where}: {name} must be {names}, got {_short(value)}")


_KINDS = {int: "an integer", float: "a finite number", str: "a string", bool: "true/false"}
_KINDS[type(None)] = "null"


def _is_a(value: Any, t: Any) -> bool:
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if t is str:
        return isinstance(value, str)
    return True  # an annotation this check does not know: the class validates it
