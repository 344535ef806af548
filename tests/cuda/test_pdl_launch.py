"""Programmatic dependent launch on the CPU: the driver structs' layout (cuda.h's
``CUlaunchConfig`` / ``CUlaunchAttribute``), the argument packing handed to
``cuLaunchKernelEx`` (read back through the pointers), the default and ``LLMC_PDL=0``,
which launches ask for PDL, and the kernels' side (cuda/pdl.cuh): every PDL-launched GEMV
waits before its prologue and after its weight loads."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.gemv_launch import aligned, recording_backend
from helpers.packed_weights import random_packed
from llmc.base.errors import ConfigError, UnsupportedError
from llmc.cuda import cuda_backend as cb
from llmc.cuda import gemv_wo_ops as wo
from llmc.cuda import pdl_launch as pl

CUDA = Path(cb.__file__).parent


def test_struct_layouts_match_cuda_h():
    assert ctypes.sizeof(pl.LaunchAttribute) == 72  # 4-byte id, pad to 8, 64-byte union
    assert pl.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pl.LaunchConfig) == 56
    assert pl.LaunchConfig.sharedMemBytes.offset == 24
    assert pl.LaunchConfig.hStream.offset == 32
    assert pl.LaunchConfig.attrs.offset == 40 and pl.LaunchConfig.numAttrs.offset == 48


def test_launch_config_sets_the_attribute():
    cfg = pl.launch_config((5,), (512,), 4096, 0xABC0)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (5, 1, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (512, 1, 1)
    assert cfg.sharedMemBytes == 4096 and cfg.hStream == 0xABC0 and cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == pl.PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert attr.value.programmaticStreamSerializationAllowed == 1
    assert int.from_bytes(bytes(attr.value.pad)[:4], "little") == 1
    cfg3 = pl.launch_config((2, 3, 4), (32, 2), 0, 0)
    assert (cfg3.gridDimZ, cfg3.blockDimY, cfg3.blockDimZ) == (4, 2, 1)


def test_arguments_reach_the_driver_by_pointer():
    seen = {}

    def fake(cfg_ref, func, params, extra):
        cfg = ctypes.cast(cfg_ref, ctypes.POINTER(pl.LaunchConfig)).contents
        seen.update(func=func, grid=cfg.gridDimX, smem=cfg.sharedMemBytes, extra=extra)
        kinds = (ctypes.c_uint64, ctypes.c_float, ctypes.c_int32, ctypes.c_int64)
        seen["vals"] = [ctypes.cast(params[i], ctypes.POINTER(k)).contents.value
                        for i, k in enumerate(kinds)]  # fmt: skip
        return 0

    launcher = object.__new__(pl.PdlLauncher)
    launcher._init_buffers()
    launcher._fn = fake
    kern = SimpleNamespace(kernel=SimpleNamespace(ptr=0x1234))
    args = (np.uint64(2**40 + 3), np.float32(1e-5), np.int32(-7), np.int64(2**33))
    launcher(kern, (132,), (512,), args, 1000, 0x99)
    assert seen["func"] == 0x1234 and seen["grid"] == 132 and seen["smem"] == 1000
    assert seen["extra"] is None
    v = seen["vals"]
    assert v[0] == 2**40 + 3 and v[1] == pytest.approx(1e-5) and v[2:] == [-7, 2**33]
    launcher._fn = lambda *a: 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(UnsupportedError, match="CUresult 1"):
        launcher(kern, (1,), (32,), (), 0, 0)


def test_arguments_must_be_numpy_scalars():
    with pytest.raises(UnsupportedError, match="argument 1 is int"):
        pl.pack_args((np.uint64(1), 3))
    with pytest.raises(UnsupportedError, match="argument 0 is float64"):
        pl.pack_args((np.float64(1.0),))
    with pytest.raises(UnsupportedError, match="65 arguments"):
        pl.pack_args((np.int32(0),) * 65)
    packed = pl.pack_args((np.int32(-2), np.uint64(2**63), np.float32(0.5)))
    assert len(packed) == 24 and packed[:8] == np.int32(-2).tobytes() + bytes(4)
    assert (
        packed[8:16] == (2**63).to_bytes(8, "little") and packed[16:20] == np.float32(0.5).tobytes()
    )


def test_default_and_switch(monkeypatch):
    monkeypatch.delenv(pl.ENV_SWITCH, raising=False)
    assert pl.pdl_modes((9, 0)) == pl.pdl_modes((10, 0)) == (True, True)
    assert pl.pdl_modes((8, 9)) == (False, False)
    monkeypatch.setenv(pl.ENV_SWITCH, "0")
    assert pl.pdl_modes((9, 0)) == (False, False)
    monkeypatch.setenv(pl.ENV_SWITCH, "gemv")
    assert pl.pdl_modes((9, 0)) == (True, False)
    monkeypatch.setenv(pl.ENV_SWITCH, "1")
    assert pl.pdl_modes((9, 0)) == (True, True)
    monkeypatch.setenv(pl.ENV_SWITCH, "yes")
    with pytest.raises(ConfigError, match="LLMC_PDL='yes': expected one of 0"):
        pl.pdl_modes((9, 0))


def test_backend_routes_pdl_launches(monkeypatch):
    b = object.__new__(cb.CudaBackend)
    b.device, b._streams = torch.device("cpu"), {}
    calls = []

    class Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    b._cp_device = Ctx()
    b._cp = SimpleNamespace(cuda=SimpleNamespace(ExternalStream=lambda ptr, dev: Ctx()))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev: SimpleNamespace(cuda_stream=77))
    b._pdl_launcher = lambda *a: calls.append(("pdl", a[-1]))

    def kern(grid, block, args, shared_mem=0):
        calls.append(("plain", shared_mem))

    b.pdl = True
    b._launch(kern, (1,), (32,), (), 16, pdl=True)
    b._launch(kern, (1,), (32,), (), 16)
    b.pdl = False  # LLMC_PDL=0 or below sm_90: every launch plain
    b._launch(kern, (1,), (32,), (), 16, pdl=True)
    assert calls == [("pdl", 77), ("plain", 16), ("plain", 16)]


def test_a_driver_without_cuLaunchKernelEx_launches_plainly(monkeypatch):
    b = object.__new__(cb.CudaBackend)
    b.pdl = b.pdl_attention = True
    b._pdl_launcher = None

    def missing():
        raise UnsupportedError("pdl_launch: cuLaunchKernelEx is not available (old driver)")

    monkeypatch.setattr(pl, "PdlLauncher", missing)
    assert b._pdl_ready() is None and not b.pdl and not b.pdl_attention


def test_the_gemvs_ask_for_pdl_and_the_rest_do_not(monkeypatch):
    monkeypatch.setattr(wo, "_need", lambda t, name, dtype=None: None)
    b = recording_backend(monkeypatch)
    b.wo_stages, b.wo_prefetch, b.wo_gemm, b.wo_gemv_passes = 0, True, "dequant", (1, 1)
    x, nw, res = aligned(2, 256), aligned(256), aligned(2, 256)
    b.norm_linear(x, nw, 1e-5, aligned(64, 256))  # gemv.cu
    fp8 = torch.float8_e4m3fn
    b.linear_residual_add_fp8(
        x, aligned(256, 256, dtype=fp8), aligned(256, dtype=torch.float32), res
    )
    w4 = random_packed(64, 256, 4, 128, offsets=True)
    b.norm_linear(x, nw, 1e-5, w4)  # gemv_wo.cu at M = 2: plain (slower with PDL at M = 4)
    b.norm_linear(x[:1], nw, 1e-5, w4)  # and at M = 1: PDL
    assert [k.family for k, *_ in b.launches] == ["gemv", "gemv_fp8", "gemv_wo", "gemv_wo"]
    assert b.pdl_launches == [True, True, False, True]
    b.pdl_wo_max_tokens = 2
    b.norm_linear(x, nw, 1e-5, w4)
    assert b.pdl_launches[-1] is True
    n = len(b.launches)
    b.linear(aligned(40, 256), random_packed(64, 256, 4, 128, offsets=True))  # dequant + mm
    assert b.launches[n:] and not any(b.pdl_launches[n:])


def _body(path: str, start: str) -> str:
    text = (CUDA / path).read_text()
    return text[text.index(start) :]


@pytest.mark.parametrize(
    "path, start, loads, prologue",
    [
        ("gemv.cu", "gemv_body(const GemvArgs& a)", "prefetch_start<MODE", "MODE != 2) {  // rms"),
        ("gemv_fp8.cu", "gemv8_body(const G8Args& a)", "load_batch<VECTOR>(A", "g8_prologue<"),
        ("gemv_wo.cu", "void gemv_wo_body", "wo_load_batch<BITS, SMODE, VECTOR>(A", "wo_prologue<"),
    ],
)  # fmt: skip
def test_pdl_gemvs_wait_after_the_weights_and_before_the_activations(path, start, loads, prologue):
    body = _body(path, start)
    trig, wait = body.index("pdl_trigger();"), body.index("pdl_wait();")
    assert trig < body.index(loads)
    last_wait = body.index("pdl_wait();", body.index(loads))
    assert body.index(loads) < last_wait < body.index(prologue)
    early = re.search(r"if \(c <= 0\) \{[^\n]*\s*pdl_wait\(\);\s*return;", body)
    assert early is not None or path == "gemv.cu"
    assert wait <= last_wait


@pytest.mark.parametrize(
    "path, kernels, waits",
    [("decode_attention.cu", 4, 4), ("rope_kv.cu", 1, 1), ("embedding.cu", 1, 0)],
)
def test_the_kernels_before_a_pdl_launch_trigger(path, kernels, waits):
    """Every kernel before a PDL launch of a small step triggers; rope_kv and attention,
    PDL launches themselves, wait first thing (right after their trigger)."""
    text = (CUDA / path).read_text()
    assert '#include "pdl.cuh"' in text
    assert text.count("pdl_trigger();") == kernels
    assert len(re.findall(r"pdl_trigger\(\);[^\n]*\n\s*pdl_wait\(\);", text)) == waits
    assert text.count("pdl_wait();") == waits


def test_rope_and_attention_use_pdl_in_small_steps_only():
    b = object.__new__(cb.CudaBackend)
    b.fused_decode_max_tokens, b.pdl_attention = 4, True
    assert b._pdl_step(1) and b._pdl_step(4) and not b._pdl_step(5)
    b.pdl_attention = False
    assert not b._pdl_step(1)
