"""CPU check: every kernel family compiles for sm_90 with nvcc (skipped without nvcc)."""

from __future__ import annotations

import shutil

import pytest

from llmc.cuda import compile_check
from llmc.cuda.build import families_for
from llmc.cuda.kernels import FAMILIES, KernelConfig, cubin_name, family_arch, source


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
        nvcc_compile(source(fam, cfg), family_arch(fam, "sm_90"), tmp_path / f"{fam}.cubin")

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


def test_sm90_prefill_family_selection():
    """prefill_attention_sm90.cu: 16-bit head_dim 64 / 128 only, built for sm_90a on sm_90
    and for no other arch (wgmma / setmaxnreg exist only there)."""
    for cfg, ok in (
        (KernelConfig("bfloat16", 128, 32, 8), True),
        (KernelConfig("float16", 64, 9, 3), True),
        (KernelConfig("bfloat16", 96, 8, 8), False),
        (KernelConfig("float32", 128, 32, 8), False),
    ):
        assert ("prefill_sm90" in families_for(cfg, "sm_90")) == ok
        assert "prefill_sm90" not in families_for(cfg, "sm_80")
        assert "prefill_sm90" not in families_for(cfg, "sm_100")
    assert family_arch("prefill_sm90", "sm_90") == "sm_90a"
    assert family_arch("rmsnorm", "sm_90") == "sm_90"
    cfg = KernelConfig("bfloat16", 128, 32, 8)
    assert ".sm_90a." in cubin_name("prefill_sm90", cfg, family_arch("prefill_sm90", "sm_90"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize(
    "cfg",
    [
        KernelConfig("bfloat16", 128, 32, 8),
        KernelConfig("float16", 128, 32, 8),
        KernelConfig("bfloat16", 64, 9, 3),
    ],
    ids=str,
)
@pytest.mark.parametrize("producer", [1, 0], ids=["producer-v2", "producer-88a49e6"])
def test_sm90_prefill_compiles_without_spills(tmp_path, cfg, producer):
    """The sm_90a build through the project's nvcc path, warnings as errors; ptxas reports no
    spills and honours setmaxnreg (else it warns), and both kernels hold wgmma.mma_async.
    Also with the fallback producer (SM90_PRODUCER_V2 0, the one-line switch)."""
    from llmc.cuda.build import nvcc_compile

    out = tmp_path / "prefill_sm90.cubin"
    src = source("prefill_sm90", cfg)
    assert "#define SM90_PRODUCER_V2 1\n" in src
    src = src.replace("#define SM90_PRODUCER_V2 1\n", f"#define SM90_PRODUCER_V2 {producer}\n")
    assert src.count("wgmma.mma_async") == 3 and 'extern "C" __global__' in src
    nvcc_compile(src, "sm_90a", out, extra=("-Werror", "all-warnings", "-Xptxas", "-v"))
    assert out.stat().st_size > 0
    import subprocess

    res = subprocess.run(
        [shutil.which("nvcc"), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
         "-O3", "-Xptxas", "-v", "-x", "cu", "-o", str(tmp_path / "v.cubin"), "-"],
        input=src, capture_output=True, text=True, check=True,
    )  # fmt: skip
    log = res.stderr
    assert log.count("0 bytes spill stores, 0 bytes spill loads") == 2, log
    assert "prefill_sm90_kernel" in log and "prefill_sm90_fp8_kernel" in log
    assert "setmaxnreg" not in log and "Potential Performance Loss" not in log, log


def test_sm90_prefill_compiles_with_nvrtc(tmp_path):
    """The NVRTC fallback (CuPy's bindings) targets sm_90a as the runtime does."""
    pytest.importorskip("cupy")
    from llmc.cuda.build import nvrtc_compile

    out = tmp_path / "p.cubin"
    nvrtc_compile(source("prefill_sm90", KernelConfig("bfloat16", 128, 32, 8)), "sm_90a", out)
    assert out.stat().st_size > 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize(
    "cfg, warps",
    [
        (KernelConfig("bfloat16", 128, 32, 8), 8),
        (KernelConfig("bfloat16", 128, 32, 2), 4),
        (KernelConfig("float16", 256, 16, 2), 4),
    ],
    ids=str,
)
def test_cluster_decode_fits_static_shared_memory(tmp_path, cfg, warps):
    """G = nq / nkv = 16 at head_dim 128 needed 74,880 bytes of static shared memory with 8
    warps (ptxas refused the module on the H200): the config's warp count keeps every
    G * HD within 48 KiB, and decode_attention.cu compiles with it."""
    from llmc.cuda.build import nvcc_compile
    from llmc.cuda.kernels import macros

    assert cfg.cluster_warps == warps
    assert macros("decode_attention", cfg)["CLUSTER_WARPS"] == warps
    nvcc_compile(source("decode_attention", cfg), "sm_90", tmp_path / "decode.cubin")
