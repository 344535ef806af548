"""GGUF files (llama.cpp's format): the header — metadata and tensor table — read from a map.

What this module owns:
- ``read_gguf_header``: the metadata and tensor table, parsed straight from a memory map.
  Large string arrays (the vocabulary and merges) are skipped unless asked for, so reading a
  model's spec takes milliseconds. Every tensor's byte range is checked against the file
  size, so a truncated file fails here, before any data is read.
- ``GGUFHeader`` / ``GGUFTensorInfo``: what the reader (gguf_reader.py: config, tensors) and
  the tokenizer rebuild (gguf_tokenizer.py) both read; this module imports neither of them.
- ``open_map``: the read-only memory map of a GGUF file, shared with the tensor reader.

Invariants: any malformed header raises CheckpointError naming the file; an unknown format
version or ggml type raises UnsupportedError. Counts, array lengths and nesting, and string
lengths are checked against compiler/input_bounds.py's limits before they are looped over.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.input_bounds import (
    MAX_GGUF_ARRAY_DEPTH,
    MAX_GGUF_ARRAY_LEN,
    MAX_GGUF_METADATA_KEYS,
    MAX_GGUF_STRING_BYTES,
    MAX_TENSORS,
)

GGUF_MAGIC = b"GGUF"
# Metadata string arrays that are large; read only when a caller asks for them.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")

# GGUF metadata value types (gguf.GGUFValueType) with a fixed size: id → struct format.
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: torch-order shape, ggml type id, absolute byte range."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    def get(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped key: ``get('block_count')`` reads ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)  # struct.error past the end
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.pos + n > self.size:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF (string past the end)")
        if n > MAX_GGUF_STRING_BYTES:
            raise CheckpointError(
                f"{self.path}: corrupt GGUF (a string of {n} bytes; the limit is "
                f"{MAX_GGUF_STRING_BYTES})"
            )
        s = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int, keep_strings: bool, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise CheckpointError(f"{self.path}: corrupt GGUF (unknown metadata type {vtype})")
        etype, count = self.unpack("<IQ")
        if count > self.size - self.pos:  # every element takes at least one byte
            raise CheckpointError(f"{self.path}: corrupt GGUF (array of {count} elements)")
        if count > MAX_GGUF_ARRAY_LEN:
            raise CheckpointError(
                f"{self.path}: corrupt GGUF (array of {count} elements; the limit is "
                f"{MAX_GGUF_ARRAY_LEN})"
            )
        if etype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[etype]
            values = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)
            self.pos += count * struct.calcsize(fmt)
            return list(values)
        if etype == _ARRAY:
            if depth + 1 >= MAX_GGUF_ARRAY_DEPTH:
                raise CheckpointError(
                    f"{self.path}: corrupt GGUF (arrays nested more than "
                    f"{MAX_GGUF_ARRAY_DEPTH} deep)"
                )
            return [self.value(_ARRAY, keep_strings, depth + 1) for _ in range(count)]
        if etype != _STRING:
            raise CheckpointError(f"{self.path}: corrupt GGUF (unknown array type {etype})")
        if keep_strings:
            return [self.string() for _ in range(count)]
        buf, pos, unpack = self.buf, self.pos, struct.unpack_from
        for _ in range(count):  # skip without decoding; only the count is kept
            pos += 8 + unpack("<Q", buf, pos)[0]
        if pos > self.size:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF (array past the end)")
        self.pos = pos
        return count


def type_name(ggml_type: int) -> str:
    """The ggml type's name (``Q4_K``) from its id."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def open_map(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) < 24:
                raise CheckpointError(f"{path}: too small to be a GGUF file (truncated?)")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read GGUF file: {e}") from e


def read_gguf_header(path: str | Path, string_arrays: tuple[str, ...] = ()) -> GGUFHeader:
    """Parse metadata and tensor table; string arrays not in ``string_arrays`` become counts."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    buf = open_map(path)
    cur = _Cursor(buf, path)
    try:
        if buf[:4] != GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur.pos = 4
        version, n_tensors, n_kv = cur.unpack("<IQQ")
        if version not in (2, 3):
            raise UnsupportedError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        for what, n, limit in (
            ("metadata entries", n_kv, MAX_GGUF_METADATA_KEYS),
            ("tensors", n_tensors, MAX_TENSORS),
        ):
            if n > limit:
                raise CheckpointError(f"{path}: corrupt GGUF ({n} {what}; llmc's limit is {limit})")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("<I")
            metadata[key] = cur.value(vtype, key in string_arrays)
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            (ndim,) = cur.unpack("<I")
            if ndim > 8:
                raise CheckpointError(f"{path}: corrupt GGUF (tensor {name!r} has {ndim} dims)")
            dims = cur.unpack(f"<{ndim}Q")
            ggml_type, offset = cur.unpack("<IQ")
            raw.append((name, tuple(reversed(dims)), ggml_type, offset))
    except (struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({e})") from e
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise CheckpointError(f"{path}: corrupt GGUF (general.alignment = {alignment!r})")
    if len({name for name, *_ in raw}) != len(raw):
        raise CheckpointError(f"{path}: corrupt GGUF (a tensor name appears twice)")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise UnsupportedError(
                f"{path}: tensor {name!r} has unknown ggml type {ggml_type}"
            ) from None
        n = math.prod(shape)  # Python ints: a corrupt huge dim cannot wrap around
        if shape and shape[-1] % block:
            raise CheckpointError(f"{path}: tensor {name!r} row length {shape[-1]} % {block} != 0")
        info = GGUFTensorInfo(name, shape, ggml_type, data_start + offset, n // block * type_size)
        if info.offset + info.nbytes > cur.size:
            raise CheckpointError(
                f"{path}: truncated GGUF: tensor {name!r} needs bytes up to "
                f"{info.offset + info.nbytes}, file has {cur.size}"
            )
        tensors.append(info)
    return GGUFHeader(path, version, metadata, tuple(tensors))
