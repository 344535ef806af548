"""The CudaBackend's fused gemv ops on the CPU with their launches recorded instead of run
(tests/cuda/test_gemv_launch.py for cuda/gemv.cu, test_gemv_fp8_launch.py for gemv_fp8.cu):

- ``kernel_signatures``: the C parameter types of each kernel family, read from the source's
  instantiation macro;
- ``recording_backend``: a CudaBackend without a GPU whose ``_launch`` appends
  (kernel, grid, block, args, shared_mem) to ``.launches`` and whose kernels are ``Recorder``s;
- ``check_args``: a recorded launch's arguments against a signature (pointers as uint64,
  float as float32, int as int32) and the block size;
- ``aligned``: a CPU tensor whose base is 16-byte aligned.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda import cuda_backend as cb
from llmc.cuda import gemv_fp8_ops, gemv_ops
from llmc.cuda.kernels import CUDA_DIR

NP_TYPE = {"float": np.float32, "int": np.int32}


def kernel_signatures(file: str, macro: str, end: str) -> dict[str, list[str]]:
    """family -> C parameter types, from the text of ``file`` between ``#define <macro>`` and
    ``#define <end>`` (kernels named ``<family>_m##M##SUFFIX``)."""
    text = (CUDA_DIR / file).read_text()
    text = text[text.index(f"#define {macro}") : text.index(f"#define {end}")]
    text = text.replace("\\\n", " ")
    out = {}
    for name, params in re.findall(
        r"void __launch_bounds__\([^)]*\) (\w+?)_m##M##SUFFIX\((.*?)\)", text
    ):
        out[name] = [p.strip().rsplit(" ", 1)[0] for p in params.split(",")]
    return out


class Recorder:
    def __init__(self, family: str, name: str):
        self.family, self.name = family, name
        self.max_dynamic_shared_size_bytes = 0


class FakeLib:
    def get(self, family: str, name: str) -> Recorder:
        return Recorder(family, name)


def _need(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    """launch_args.need without the is_cuda requirement."""
    if not t.is_contiguous():
        raise UnsupportedError(f"CudaBackend: {name} must be a contiguous CUDA tensor")
    if dtype is not None and t.dtype != dtype:
        raise UnsupportedError(f"CudaBackend: {name} must be {dtype}, got {t.dtype}")


def recording_backend(monkeypatch: Any) -> Any:
    """A CudaBackend on the CPU (132 SMs, the default staging budget) recording launches."""
    monkeypatch.setattr(gemv_ops, "_need", _need)
    monkeypatch.setattr(gemv_fp8_ops, "_need", _need)
    b = object.__new__(cb.CudaBackend)
    b.device = torch.device("cpu")
    b._sm_count, b._gemv_smem, b._gemv_kernels = 132, gemv_ops.GEMV_SMEM_BYTES, {}
    b.fused_decode_max_tokens = 8
    b._lib = lambda dtype: FakeLib()
    b.launches = []
    b.pdl_launches = []  # the pdl flag of each launch

    def launch(k, grid, block, args, shared_mem=0, pdl=False):
        b.launches.append((k, grid, block, args, shared_mem))
        b.pdl_launches.append(pdl)

    b._launch = launch
    return b


def aligned(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype)
    assert t.data_ptr() % 16 == 0
    return t


def check_args(launch: tuple, types: list[str], family: str) -> tuple:
    """(kernel, grid, args, shared_mem) of a launch whose args match ``types``."""
    kern, grid, block, args, smem = launch
    assert len(args) == len(types), (family, len(args), types)
    for a, ty in zip(args, types, strict=True):
        want = np.uint64 if "*" in ty else NP_TYPE[ty]
        assert type(a) is want, (family, ty, type(a))
    assert block == (gemv_ops.GEMV_THREADS,)
    return kern, grid, args, smem
