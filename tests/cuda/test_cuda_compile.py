"""CPU check: every kernel family compiles for sm_90 with nvcc (skipped without nvcc)."""

from __future__ import annotations

import shutil

import pytest

from llmc.cuda import compile_check
from llmc.cuda.build import families_for
from llmc.cuda.kernels import FAMILIES, KernelConfig, cubin_name, source


def test_sources_are_self_contained():
    cfg = KernelConfig("bfloat16", 64, 9, 3)
    for fam in FAMILIES:
        text = source(fam, cfg)
        assert "#include" not in text
        assert 'extern "C" __global__' in text
    assert "#define HEAD_DIM 64" in source("decode_attention", cfg)
    assert "HEAD_DIM" not in "".join(source("rmsnorm", cfg).split("\n")[:3])
    assert cubin_name("rmsnorm", cfg, "sm_90") == cubin_name(
        "rmsnorm", KernelConfig("bfloat16", 128, 32, 8), "sm_90"
    )
    assert "prefill_attention" not in families_for(KernelConfig("float32", 64, 9, 3))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_every_kernel_compiles_for_sm90(tmp_path):
    """Each .cu once (bf16, hd 128, GQA 32/8); `make kernels` runs the full config matrix."""
    from concurrent.futures import ThreadPoolExecutor

    from llmc.cuda.build import nvcc_compile

    cfg = compile_check.CHECK_CONFIGS[0]
    fams = families_for(cfg)
    assert set(fams) == set(FAMILIES)

    def one(fam: str) -> None:
        nvcc_compile(source(fam, cfg), "sm_90", tmp_path / f"{fam}.cubin")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, fams))
    assert all((tmp_path / f"{f}.cubin").stat().st_size > 0 for f in fams)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_compile_error_is_reported(tmp_path):
    from llmc.base.errors import UnsupportedError
    from llmc.cuda.build import nvcc_compile

    with pytest.raises(UnsupportedError, match="nvcc failed"):
        nvcc_compile(
            'extern "C" __global__ void k() { undefined_thing(); }', "sm_90", tmp_path / "bad.cubin"
        )
