"""Hostile GGUF files: sizes past the limits, malformed metadata (huge or nested arrays, wrong
value types, zero heads) and values that would make an engine that never runs.

Each file is written by hand (``gguf_file``: the GGUF v3 layout, so a case can declare any
count or type the ``gguf`` package's writer would refuse) and fed to ``llmc build --dry_run``
(the header only) or ``llmc import`` (tensors and tokenizer too).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers.hostile import Case, run_case
from llmc.compiler import input_bounds as B

_U8, _I32, _U32, _F32, _BOOL, _STR, _ARR, _U64, _F64 = 0, 5, 4, 6, 7, 8, 9, 10, 12


@dataclass(frozen=True)
class Raw:
    """A metadata value given as its type id and payload bytes (anything a case needs)."""

    vtype: int
    payload: bytes


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> tuple[int, bytes]:
    if isinstance(v, Raw):
        return v.vtype, v.payload
    if isinstance(v, bool):
        return _BOOL, struct.pack("<?", v)
    if isinstance(v, int):
        return (_U32, struct.pack("<I", v)) if 0 <= v < 2**32 else (_U64, struct.pack("<Q", v))
    if isinstance(v, float):
        return _F32, struct.pack("<f", v)
    if isinstance(v, str):
        return _STR, _str(v)
    if isinstance(v, list):
        etype = _value(v[0])[0] if v else _U32
        return _ARR, struct.pack("<IQ", etype, len(v)) + b"".join(_value(x)[1] for x in v)
    raise TypeError(v)


TINY = {
    "general.architecture": "llama",
    "llama.context_length": 512,
    "llama.embedding_length": 16,
    "llama.block_count": 1,
    "llama.feed_forward_length": 32,
    "llama.attention.head_count": 2,
    "llama.attention.head_count_kv": 1,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 10000.0,
    "llama.vocab_size": 16,
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "default",
    "tokenizer.ggml.tokens": ["<s>", "</s>", *"abcdefghijklm", "ab"],
    "tokenizer.ggml.token_type": [3, 3, *[1] * 14],
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 1,
}
"""A complete one-layer llama (hidden 16, 2 heads of 8) with its byte-level BPE tokenizer."""


def tiny_tensors() -> dict[str, tuple[int, ...]]:
    h, f, kv, v = 16, 32, 8, 16
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    for name, shape in {
        "attn_norm.weight": (h,),
        "attn_q.weight": (h, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, h),
        "ffn_norm.weight": (h,),
        "ffn_gate.weight": (f, h),
        "ffn_up.weight": (f, h),
        "ffn_down.weight": (h, f),
    }.items():
        shapes[f"blk.0.{name}"] = shape
    return shapes


def gguf_file(
    path: Path,
    metadata: dict[str | bytes, Any],
    tensors: dict[str, tuple[int, ...]] | None = None,
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> Path:
    """A GGUF v3 file: ``metadata`` in order, F32 ``tensors`` of small values (torch-order
    shapes); ``n_kv`` / ``n_tensors`` override the counts the header declares."""
    tensors = tensors or {}
    kv = b"".join(
        _str(k) + struct.pack("<I", _value(v)[0]) + _value(v)[1] for k, v in metadata.items()
    )
    infos, offset = b"", 0
    for name, shape in tensors.items():
        dims = struct.pack(f"<{len(shape)}Q", *reversed(shape))
        infos += _str(name) + struct.pack("<I", len(shape)) + dims + struct.pack("<IQ", 0, offset)
        offset += -(-4 * math.prod(shape) // 32) * 32
    head = b"GGUF" + struct.pack(
        "<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
        len(metadata) if n_kv is None else n_kv,
    )  # fmt: skip
    body = head + kv + infos
    body += b"\0" * (-len(body) % 32)
    data = b"".join(
        struct.pack(f"<{math.prod(s)}f", *[0.01] * math.prod(s)).ljust(
            -(-4 * math.prod(s) // 32) * 32, b"\0"
        )
        for s in tensors.values()
    )
    path.write_bytes(body + data)
    return path


def nested_array(depth: int) -> Raw:
    """Arrays of one array each, ``depth`` deep, around one u32."""
    payload = struct.pack("<IQI", _U32, 1, 7)
    for _ in range(depth - 1):
        payload = struct.pack("<IQ", _ARR, 1) + payload
    return Raw(_ARR, payload)


def with_(**changes: Any) -> dict[str, Any]:
    """TINY with ``llama.X`` keys changed (``__`` spells a dot); a value None drops the key."""
    md = dict(TINY)
    for key, value in changes.items():
        full = key.replace("__", ".")
        full = full if full.startswith(("general.", "tokenizer.")) else f"llama.{full}"
        if value is None:
            md.pop(full, None)
        else:
            md[full] = value
    return md


Setup = Callable[[Path], Path]


def header(metadata: dict[str, Any], **counts: int) -> Setup:
    return lambda tmp: gguf_file(tmp / "m.gguf", metadata, **counts)


def full(metadata: dict[str, Any]) -> Setup:
    return lambda tmp: gguf_file(tmp / "m.gguf", metadata, tiny_tensors())


def big_array(tmp: Path) -> Path:
    n = B.MAX_GGUF_ARRAY_LEN + 1  # a real array past the limit (17 MB of u8)
    payload = struct.pack("<IQ", _U8, n) + bytes(n)
    return gguf_file(tmp / "m.gguf", {**TINY, "general.blob": Raw(_ARR, payload)})


DRY = ["build", "--checkpoint_dir", "{ckpt}", "--dry_run", "--target", "cpu"]
IMPORT = ["import", "--gguf", "{ckpt}", "--output_dir", "{tmp}/out"]
LIM = str  # the limit, as the message prints it

CASES: list[tuple[Case, Setup]] = [
    # ---- sizes past the limits: refused before any loop over them (issue item 5) ----------
    (
        Case("block_count 1e12", DRY, 4, ["llama.block_count", LIM(B.MAX_LAYERS)], timeout_s=30),
        header(with_(block_count=10**12)),
    ),
    (
        Case("embedding_length 2**40", DRY, 4, ["embedding_length", LIM(B.MAX_HIDDEN_SIZE)]),
        header(with_(embedding_length=2**40)),
    ),
    (
        Case("feed_forward_length 1e13", DRY, 4, ["feed_forward_length"]),
        header(with_(feed_forward_length=10**13)),
    ),
    (
        Case("vocab_size 1e10", DRY, 4, ["vocab_size", LIM(B.MAX_VOCAB_SIZE)]),
        header(with_(vocab_size=10**10)),
    ),
    (Case("context_length 1e15", DRY, 4, ["context_length"]), header(with_(context_length=10**15))),
    (
        Case("head_count 1e7", DRY, 4, ["head_count", LIM(B.MAX_HEADS)]),
        header(with_(attention__head_count=10**7, attention__head_count_kv=10**7)),
    ),
    (
        Case("key_length 4096 (unsupported head_dim)", DRY, 5, ["key_length", "256"]),
        header(with_(attention__key_length=4096)),
    ),
    (
        Case("1e15 metadata entries declared", DRY, 4, ["metadata entries"]),
        header(TINY, n_kv=10**15),
    ),
    (
        Case("1e15 tensors declared", DRY, 4, ["tensors", LIM(B.MAX_TENSORS)]),
        header(TINY, n_tensors=10**15),
    ),
    # ---- malformed metadata: arrays, types, strings (issue item 6) -------------------------
    (
        Case("array of 2**40 elements declared", DRY, 4, ["array"]),
        header({**TINY, "general.x": Raw(_ARR, struct.pack("<IQ", _U32, 2**40))}),
    ),
    (Case("array past the length limit", DRY, 4, ["array", LIM(B.MAX_GGUF_ARRAY_LEN)]), big_array),
    (
        Case("arrays nested 100000 deep", DRY, 4, ["nested"]),
        header({**TINY, "general.x": nested_array(100_000)}),
    ),
    (
        Case("arrays nested 5 deep", DRY, 4, ["nested", LIM(B.MAX_GGUF_ARRAY_DEPTH)]),
        header({**TINY, "general.x": nested_array(5)}),
    ),
    (
        Case("string of 2**40 bytes declared", DRY, 4, ["string"]),
        header({**TINY, "general.x": Raw(_STR, struct.pack("<Q", 2**40))}),
    ),
    (
        Case("unknown metadata type", DRY, 4, ["type 99"]),
        header({**TINY, "general.x": Raw(99, b"")}),
    ),
    (Case("metadata key not UTF-8", DRY, 4, ["corrupt GGUF"]), header({b"\xff\xfe": 1, **TINY})),
    (
        Case("block_count a string", DRY, 4, ["llama.block_count", "integer"]),
        header(with_(block_count="2")),
    ),
    (
        Case("embedding_length an array", DRY, 4, ["llama.embedding_length"]),
        header(with_(embedding_length=[16, 16])),
    ),
    (
        Case("block_count a float", DRY, 4, ["llama.block_count"]),
        header(with_(block_count=Raw(_F64, struct.pack("<d", 1.5)))),
    ),
    (
        Case("head_count 0", DRY, 4, ["llama.attention.head_count", "positive"]),
        header(with_(attention__head_count=0)),
    ),
    (
        Case("head_count_kv 0", DRY, 4, ["head_count_kv", "positive"]),
        header(with_(attention__head_count_kv=0)),
    ),
    (
        Case("head_count missing", DRY, 4, ["attention.head_count"]),
        header(with_(attention__head_count=None)),
    ),
    (
        Case("rms epsilon a string", DRY, 4, ["layer_norm_rms_epsilon"]),
        header(with_(attention__layer_norm_rms_epsilon="tiny")),
    ),
    (
        Case("rope.scaling.type an array", DRY, 4, ["rope.scaling.type"]),
        header(with_(rope__scaling__type=["linear"])),
    ),
    (
        Case("eos_token_id a string", DRY, 4, ["eos_token_id"]),
        header(with_(tokenizer__ggml__eos_token_id="</s>")),
    ),
    (
        Case("general.alignment 0", DRY, 4, ["general.alignment"]),
        header(with_(general__alignment=0)),
    ),
    # ---- engines that could never run: refused at build time (issue item 7) ---------------
    (Case("odd head_dim", DRY, 5, ["head_dim", "odd"]), header(with_(embedding_length=30))),
    (Case("rope freq_base 0", DRY, 4, ["rope_theta"]), header(with_(rope__freq_base=0.0))),
    (
        Case("rope freq_base NaN", DRY, 4, ["rope.freq_base", "finite"]),
        header(with_(rope__freq_base=math.nan)),
    ),
    (
        Case("rms epsilon inf", DRY, 4, ["layer_norm_rms_epsilon", "finite"]),
        header(with_(attention__layer_norm_rms_epsilon=math.inf)),
    ),
    (
        Case("rms epsilon negative", DRY, 4, ["rms_norm_eps"]),
        header(with_(attention__layer_norm_rms_epsilon=-1e-5)),
    ),
    (
        Case("eos id outside the vocabulary", DRY, 4, ["eos_token_id", "vocabulary"]),
        header(with_(tokenizer__ggml__eos_token_id=10**6)),
    ),
    # ---- llmc import: the same rules, and the tokenizer metadata ---------------------------
    (
        Case("import: block_count 1e12", IMPORT, 4, ["llama.block_count"], timeout_s=30),
        header(with_(block_count=10**12)),
    ),
    (
        Case("import: tokens not strings", IMPORT, 4, ["tokenizer.ggml.tokens"]),
        full(with_(tokenizer__ggml__tokens=list(range(16)))),
    ),
    (
        Case("import: merges not strings", IMPORT, 4, ["tokenizer.ggml.merges"]),
        full(with_(tokenizer__ggml__merges=[1, 2])),
    ),
    (
        Case("import: token types not integers", IMPORT, 4, ["tokenizer.ggml.token_type"]),
        full(with_(tokenizer__ggml__token_type=["x"] * 16)),
    ),
    (
        Case("import: bos id a string", IMPORT, 4, ["bos_token_id"]),
        full(with_(tokenizer__ggml__bos_token_id="<s>")),
    ),
]


@pytest.mark.parametrize("case,setup", [pytest.param(c, s, id=c.name) for c, s in CASES])
def test_hostile_gguf(case: Case, setup: Setup, tmp_path: Path) -> None:
    run_case(case, tmp=tmp_path, ckpt=setup(tmp_path))


def test_the_tiny_file_is_a_valid_model(tmp_path: Path) -> None:
    """The base of every case above imports cleanly (so each case fails for its own edit)."""
    from helpers.hostile import run_llmc

    path = gguf_file(tmp_path / "m.gguf", TINY, tiny_tensors())
    out = run_llmc(["import", "--gguf", str(path), "--output_dir", str(tmp_path / "out")])
    assert out.exit_code == 0, out.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
