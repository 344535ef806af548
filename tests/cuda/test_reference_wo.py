"""The weight-only layout of ``llmc.cuda.reference_wo``: packing, exact dequantization
against ``gguf.quants.dequantize``, and the reference linear / embedding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.cuda import reference as ref
from llmc.cuda.reference_wo import PackedWeight, pack_codes, unpack_codes

gguf = pytest.importorskip("gguf", reason="gguf (a CPU test dependency) is not installed")
dequantize, quantize = gguf.quants.dequantize, gguf.quants.quantize


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (5, 64), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits), codes.to(torch.int32))


def _q4_1(w: np.ndarray) -> PackedWeight:
    """A Q4_1 tensor rewritten in the layout by hand (d, m, 32 nibbles per block)."""
    n, k = w.shape
    blocks = quantize(w, gguf.GGMLQuantizationType.Q4_1).reshape(n, k // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k).astype(np.int32)
    return PackedWeight(
        pack_codes(torch.from_numpy(codes), 4), torch.from_numpy(d.copy()),
        torch.from_numpy(m.copy()), 4, 0, 32,
    )  # fmt: skip


def test_q4_1_dequantizes_to_gguf_bits() -> None:
    w = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    expected = dequantize(
        quantize(w, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1
    )
    got = _q4_1(w).dequantize().numpy()
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_linear_and_embedding_of_a_packed_weight() -> None:
    w = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    pw = _q4_1(w)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(3))
    dense = pw.dequantize()
    torch.testing.assert_close(ref.linear(x, pw, bias), x @ dense.T + bias)
    ids = torch.tensor([3, 0, 15])
    assert torch.equal(ref.embedding(ids, pw), dense[ids])


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"bits": 5}, "bits=5"),
        ({"code_zero": 16}, "code_zero=16"),
        ({"group_size": 48}, "group_size=48"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict, needle: str) -> None:
    args = {
        "codes": torch.zeros(4, 32, dtype=torch.uint8), "scales": torch.ones(4, 2),
        "offsets": None, "bits": 4, "code_zero": 8, "group_size": 32,
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        PackedWeight(**args)
