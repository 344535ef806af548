"""GGUF blocks kept as PackedWeights: every kept type dequantizes to exactly
``gguf.quants.dequantize``'s bits (synthetic tensors and the real SmolLM2 file), fusion of
members of different layouts is exact, truncated blocks are refused, and a GGUF-native
build keeps what it can and says what it dequantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.gguf_quantized import random_blocks, write_tiny_gguf
from llmc.base.errors import CheckpointError
from llmc.compiler.gguf_blocks import CONVERTERS, blocks_to_packed
from llmc.compiler.gguf_header import read_gguf_header
from llmc.compiler.wo_layout import KEPT_TYPES, gguf_type_layout, unify_layouts
from llmc.compiler.wo_weights import fuse_packed


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def gguf_dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[qtype]), dtype=np.float32)


def packed(qtype: str, n: int = 6, k: int = 512, seed: int = 0):
    raw = random_blocks(qtype, n, k, np.random.default_rng(seed))
    return raw, blocks_to_packed(raw.reshape(-1), (n, k), qtype, f"t.{qtype}")


def test_every_kept_type_has_its_converter():
    assert tuple(CONVERTERS) == KEPT_TYPES


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_each_kept_type_dequantizes_bit_exact(qtype):
    raw, w = packed(qtype)
    want = gguf_dequantize(raw, qtype)
    np.testing.assert_array_equal(bits(w.dequantize()), bits(want))
    lay = gguf_type_layout(qtype)
    assert (w.bits, w.code_zero, w.group_size) == (lay.bits, lay.code_zero, lay.group_size)
    assert str(w.scales.dtype) == f"torch.{lay.scale_dtype}"
    assert (w.offsets is not None) == lay.offsets
    assert w.nbytes == lay.bytes_of(6, 512)
    rows = torch.tensor([5, 0, 3])  # the embedding's gather dequantizes rows alone
    np.testing.assert_array_equal(bits(w.dequantize(rows)), bits(want[[5, 0, 3]]))


def test_q4_1_keeps_the_file_size():
    """Q4_1 is 20 bytes per 32 weights in the file and in the engine (codes, f16 d and m)."""
    raw, w = packed("Q4_1")
    assert w.nbytes == raw.size


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_truncated_blocks_are_refused(qtype):
    raw = random_blocks(qtype, 2, 256, np.random.default_rng(1)).reshape(-1)
    with pytest.raises(CheckpointError, match="truncated blocks"):
        blocks_to_packed(raw[:-1], (2, 256), qtype, "blk.0.attn_q.weight")
    with pytest.raises(CheckpointError, match="blk.0.attn_q.weight.*not whole blocks"):
        blocks_to_packed(raw, (2, 250), qtype, "blk.0.attn_q.weight")


@pytest.mark.parametrize(
    ("types", "want"),
    [
        (("Q4_K", "Q4_K", "Q6_K"), (8, 32, 16, "float32", True)),  # a Q4_K_M qkv
        (("Q8_0", "Q4_1"), (8, 128, 32, "float16", True)),
        (("Q4_0", "Q5_K"), (8, 8, 32, "float32", True)),
        (("Q4_0", "Q4_1"), (8, 8, 32, "float16", True)),  # Q4_1's 15 + 8 needs bytes
        (("Q6_K", "Q8_0"), (8, 128, 16, "float32", False)),
    ],
)
def test_fusion_of_different_layouts_is_exact(types, want):
    parts = [packed(t, n=4 + i, seed=i) for i, t in enumerate(types)]
    fused, layout = fuse_packed(
        [(w, gguf_type_layout(t)) for (_, w), t in zip(parts, types, strict=True)]
    )
    got = (layout.bits, layout.code_zero, layout.group_size, layout.scale_dtype, layout.offsets)
    assert got == want
    assert layout == unify_layouts([gguf_type_layout(t) for t in types])
    expect = np.concatenate(
        [gguf_dequantize(raw, t) for (raw, _), t in zip(parts, types, strict=True)]
    )
    np.testing.assert_array_equal(bits(fused.dequantize()), bits(expect))


def test_fusion_keeps_negative_zeros():
    """Q6_K with a negative scale gives -0.0 for code 32; the offsets a Q4_K partner brings
    are -0.0 for it, which keeps that sign (a +0.0 offset would turn it into +0.0)."""
    (raw6, w6), (_, w4) = packed("Q6_K", seed=3), packed("Q4_K", seed=4)
    neg_zero = np.signbit(gguf_dequantize(raw6, "Q6_K")) & (gguf_dequantize(raw6, "Q6_K") == 0)
    assert neg_zero.any()
    fused, _ = fuse_packed([(w6, gguf_type_layout("Q6_K")), (w4, gguf_type_layout("Q4_K"))])
    out = fused.dequantize()[:6].numpy()
    assert (np.signbit(out) & (out == 0))[neg_zero].all()


# ---- a whole GGUF file: native build, exact to the dequantized build ---------------------
MIXED = {
    "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K",
    "attn_output.weight": "Q5_K", "ffn_gate.weight": "Q4_0", "ffn_up.weight": "Q4_1",
    "ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0", "output.weight": "Q6_K",
}  # fmt: skip


def _build(tmp_path, gguf_path, name, **kw):
    from helpers.engines import tiny_build_config
    from llmc.compiler.builder import build
    from llmc.compiler.engine_format import load_engine

    cfg = tiny_build_config(
        gguf_path, output_dir=str(tmp_path / name), max_seq_len=64, max_num_tokens=64, **kw
    )
    result = build(cfg)
    return result, load_engine(tmp_path / name)


def _dequantized(engine) -> dict[str, torch.Tensor]:
    from llmc.compiler.wo_weights import packed_from_tensors

    w = engine.load_weights()
    out = {n: t for n, t in w.items() if not n.endswith(("_scale", "_offset"))}
    for name, layout in engine.layouts.items():
        out[name] = packed_from_tensors(w, name, layout).dequantize()
    return out


def test_native_build_equals_the_dequantized_build(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", MIXED, layers=2)
    result, native = _build(tmp_path, path, "native")
    _, plain = _build(tmp_path, path, "plain", quantization="none")
    assert native.limits.quantization == "gguf" and plain.limits.quantization == "none"
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    layers = {f"layers.{i}.{p}" for i in range(2) for p in projections}
    assert set(native.layouts) == {"embed_tokens", "lm_head", *layers}
    assert native.layouts["layers.0.qkv_proj"].source == "Q4_K+Q6_K"
    assert native.layouts["layers.0.gate_up_proj"].source == "Q4_0+Q4_1"
    got, want = _dequantized(native), plain.load_weights()
    assert set(got) == set(want)
    for name, t in want.items():  # q/k rows un-permuted alike, fusion exact: the same bits
        np.testing.assert_array_equal(bits(got[name]), bits(t), err_msg=name)
    section = native.manifest["quantization"]
    assert section["dequantized"] == {}
    assert "Q4_K+Q6_K" in section["families"]["qkv_proj"]
    assert section["engine_weight_bytes"] == result.plan.weight_bytes_total
    assert section["file_tensor_bytes"] == sum(t.nbytes for t in read_gguf_header(path).tensors)
    assert result.plan.weight_bytes_total < plain.plan.weight_bytes_total / 3


def test_types_not_kept_are_dequantized_and_reported(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", {**MIXED, "attn_v.weight": "Q5_0"})
    result, engine = _build(tmp_path, path, "e")
    assert "layers.0.qkv_proj" not in engine.layouts
    assert "layers.0.o_proj" in engine.layouts
    why = engine.manifest["quantization"]["dequantized"]["layers.0.qkv_proj"]
    assert "blk.0.attn_v.weight is Q5_0" in why and "Q4_K" in why
    assert any("layers.0.qkv_proj dequantized" in n for n in result.notes)
    assert engine.load_weights()["layers.0.qkv_proj"].dtype == torch.float32


def test_dry_run_plans_the_bytes_the_build_writes(tmp_path):
    from helpers.engines import tiny_build_config
    from llmc.compiler.builder import build

    path = write_tiny_gguf(tmp_path / "m.gguf", MIXED)
    cfg = tiny_build_config(path, output_dir=str(tmp_path / "e"), max_seq_len=64, max_num_tokens=64)
    dry = build(cfg, dry_run=True)
    real = build(cfg)
    assert dry.plan.weight_bytes == real.plan.weight_bytes
    assert dry.quantization["layouts"] == real.manifest["quantization"]["layouts"]


# ---- the real SmolLM2 file -----------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_native(smollm2_gguf, tmp_path_factory):
    from helpers.engines import tiny_build_config
    from llmc.compiler.builder import build
    from llmc.compiler.engine_format import load_engine

    out = tmp_path_factory.mktemp("smollm2_native") / "e"
    build(tiny_build_config(smollm2_gguf, output_dir=str(out), max_seq_len=128, max_num_tokens=64))
    return load_engine(out)


def test_smollm2_native_weights_are_the_files_bits(smollm2_native, smollm2_gguf):
    from llmc.compiler.gguf_header import open_map
    from llmc.compiler.gguf_reader import _dequantize, unpermute_rotary
    from llmc.compiler.wo_weights import packed_from_tensors

    engine = smollm2_native
    assert engine.plan.weight_bytes_total <= 130_000_000
    header = read_gguf_header(smollm2_gguf)
    infos, buf = {t.name: t for t in header.tensors}, open_map(smollm2_gguf)
    w = engine.load_weights()

    def file(name: str, heads: int = 0) -> torch.Tensor:
        t = torch.from_numpy(_dequantize(buf, infos[name]))
        return unpermute_rotary(t, heads) if heads else t

    for i in (0, 29):
        b = f"blk.{i}."
        want = {
            f"layers.{i}.qkv_proj": torch.cat(
                [
                    file(b + "attn_q.weight", 9),
                    file(b + "attn_k.weight", 3),
                    file(b + "attn_v.weight"),
                ]
            ),
            f"layers.{i}.o_proj": file(b + "attn_output.weight"),
            f"layers.{i}.gate_up_proj": torch.cat(
                [file(b + "ffn_gate.weight"), file(b + "ffn_up.weight")]
            ),
            f"layers.{i}.down_proj": file(b + "ffn_down.weight"),
        }
        for name, t in want.items():
            got = packed_from_tensors(w, name, engine.layouts[name]).dequantize()
            np.testing.assert_array_equal(bits(got), bits(t), err_msg=name)
    embed = packed_from_tensors(w, "embed_tokens", engine.layouts["embed_tokens"])
    rows = torch.tensor([0, 1, 4000, 49151])
    np.testing.assert_array_equal(
        bits(embed.dequantize(rows)), bits(file("token_embd.weight")[rows])
    )
