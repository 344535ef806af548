"""The compiler's one entry point to a checkpoint, whatever its format.

``read_model_spec`` is cheap (config.json, or a GGUF's header without tensor data) and is
what ``llmc build`` uses to plan before loading. ``load_checkpoint`` returns a ``Checkpoint``:
the spec, the HF-style config, every tensor under its HuggingFace name (already validated
against the spec: a missing, unexpected or mis-shaped tensor is a CheckpointError naming
it), and the tokenizer files the engine directory will carry.

Formats: an HF directory (``config.json`` + safetensors) is ``"hf"``; a ``.gguf`` file (or any
file starting with the GGUF magic) is ``"gguf"``, dequantized to float32. An HF directory
whose config.json has a ``quantization_config`` is a pre-quantized FP8 checkpoint (read by
``fp8_scheme`` and ``fp8_checkpoint``; any other quantization is an UnsupportedError): its
weights keep their e4m3 codes and ``Checkpoint.fp8`` holds the checked scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmc.base.errors import CheckpointError
from llmc.compiler import gguf_header, gguf_reader, hf_reader
from llmc.compiler.fp8_scheme import is_scale_name, read_scheme
from llmc.compiler.spec import ModelSpec

if TYPE_CHECKING:  # the tensor modules (torch) load with the tensors, not with the spec
    from llmc.compiler.fp8_checkpoint import PreQuantized


@dataclass(frozen=True)
class Checkpoint:
    spec: ModelSpec
    hf_config: dict[str, Any]
    tensors: dict[str, Any]  # HF names (no scale tensors); float, e4m3 codes or PackedWeight
    tokenizer_files: dict[str, bytes]  # tokenizer.json, tokenizer_config.json, ...
    source_format: str  # "hf" | "gguf"
    fp8: PreQuantized | None = None
    """A pre-quantized FP8 checkpoint's checked scales (llmc.compiler.fp8_checkpoint)."""


def checkpoint_format(path: str | Path) -> str:
    """'hf' for a directory, 'gguf' for a GGUF file; CheckpointError otherwise."""
    p = Path(path)
    if p.is_dir():
        return "hf"
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint does not exist")
    if p.suffix.lower() == ".gguf":
        return "gguf"
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read checkpoint ({e})") from None
    if magic == gguf_header.GGUF_MAGIC:
        return "gguf"
    raise CheckpointError(
        f"{p}: not a checkpoint (expected a HuggingFace directory with config.json, "
        "or a .gguf file)"
    )


def _hf_spec(path: Path, cfg: dict[str, Any]) -> ModelSpec:
    read_scheme(cfg, str(path / "config.json"))  # an unsupported quantization fails first
    spec = ModelSpec.from_hf_config(cfg, str(path / "config.json"))
    extra = hf_reader.read_generation_eos(path)
    eos = tuple(dict.fromkeys(spec.eos_token_ids + extra))
    return dataclasses.replace(spec, eos_token_ids=eos) if eos != spec.eos_token_ids else spec


def read_model_spec(path: str | Path) -> tuple[ModelSpec, dict[str, Any]]:
    """``(spec, hf_config)`` from config.json or the GGUF header; reads no tensor data.

    The spec's ``eos_token_ids`` also include generation_config.json's, where present.
    """
    p = Path(path)
    if checkpoint_format(p) == "hf":
        cfg = hf_reader.read_hf_config(p)
        return _hf_spec(p, cfg), cfg
    cfg = gguf_reader.gguf_hf_config(gguf_header.read_gguf_header(p))
    return ModelSpec.from_hf_config(cfg, str(p)), cfg


def load_checkpoint(path: str | Path, keep_gguf: frozenset[str] = frozenset()) -> Checkpoint:
    """Read a whole checkpoint (tensors validated against its spec). ``keep_gguf``: the
    GGUF tensors read as PackedWeights of their own blocks (``gguf_native.native_plan``)."""
    from llmc.compiler.fp8_checkpoint import split_scales
    from llmc.compiler.weight_passes import validate_hf_tensors

    p = Path(path)
    if checkpoint_format(p) == "hf":
        cfg = hf_reader.read_hf_config(p)
        spec = _hf_spec(p, cfg)
        scheme = read_scheme(cfg, str(p / "config.json"))
        # Headers first: a wrong checkpoint fails before gigabytes are read.
        shapes = hf_reader.hf_tensor_shapes(p)
        if scheme is not None:  # its scales are checked with their values, below
            shapes = {k: v for k, v in shapes.items() if not is_scale_name(k)}
        validate_hf_tensors(spec, shapes, source=str(p))
        tokenizer_files = hf_reader.read_tokenizer_files(p)
        tensors = hf_reader.load_hf_tensors(p)
        fp8 = None
        if scheme is not None:
            tensors, fp8 = split_scales(spec, scheme, tensors, str(p))
        return Checkpoint(spec, cfg, tensors, tokenizer_files, "hf", fp8)
    cfg, tensors, tokenizer_files = gguf_reader.load_gguf(p, keep_gguf)  # validated (header)
    spec = ModelSpec.from_hf_config(cfg, str(p))
    return Checkpoint(spec, cfg, tensors, tokenizer_files, "gguf")
