"""Programmatic dependent launch (PDL, sm_90+): the host side of cuda/pdl.cuh.

A kernel launched with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may begin
before the previous kernel of its stream has finished: once every CTA of that kernel has
called ``pdl_trigger()`` (or exited), the new kernel's CTAs start where the SMs have room,
run up to their ``pdl_wait()`` (the weight stream of a GEMV) and wait there for the
previous kernel's completion. Inside a CUDA graph capture the attribute becomes a
programmatic edge of the graph, so the decode step's graphs keep the overlap.

CuPy launches through ``cuLaunchKernel``, which takes no launch attributes, so these
launches go through the driver's ``cuLaunchKernelEx`` (ctypes over ``libcuda``) with the
CuPy kernel's ``CUfunction``; the arguments are CuPy's: ``np.uint64`` pointers, ``np.int32``
/ ``np.int64`` integers and ``np.float32`` floats. Only kernels that call ``pdl_wait()``
before touching what an earlier kernel wrote may be launched this way (``CudaBackend.pdl``
picks them: the fused small-step GEMVs; rope_kv and decode attention in those steps).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

from llmc.base.errors import ConfigError, UnsupportedError

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
ENV_SWITCH = "LLMC_PDL"  # "0": every kernel launched plainly; "gemv": the GEMVs only
ENV_VALUES = ("", "1", "0", "gemv")
PDL_DEFAULT = True


def pdl_modes(capability: tuple[int, int]) -> tuple[bool, bool]:
    """(GEMVs, rope_kv + decode attention): which kernels of a small step a backend on a
    device of ``capability`` launches with PDL. Both on sm_90 and later (``griddepcontrol``)
    unless ``LLMC_PDL`` says ``0`` (neither) or ``gemv`` (the GEMVs only)."""
    env = os.environ.get(ENV_SWITCH, "").strip().lower()
    if env not in ENV_VALUES:
        raise ConfigError(
            f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: expected one of 0 (off), gemv (the "
            "GEMVs only), 1 or unset (on)"
        )
    gemv = PDL_DEFAULT and tuple(capability) >= (9, 0) and env != "0"
    return gemv, gemv and env != "gemv"


_KINDS = {np.dtype(t) for t in (np.uint64, np.int64, np.int32, np.uint32, np.float32)}
SLOT = 8  # bytes per argument slot of the packed buffer (each argument's own alignment)
MAX_ARGS = 64


class LaunchAttributeValue(ctypes.Union):
    """``CUlaunchAttributeValue``: 64 bytes; PDL's member is one int."""

    _fields_ = [
        ("pad", ctypes.c_ubyte * 64),
        ("programmaticStreamSerializationAllowed", ctypes.c_int),
    ]


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padded to 8 bytes, and the value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


def pack_args(args: tuple) -> bytes:
    """A CuPy-style argument tuple (numpy scalars) as 8-byte slots, each value at the start
    of its slot (``cuLaunchKernelEx`` reads argument i through pointer i)."""
    if len(args) > MAX_ARGS:
        raise UnsupportedError(f"pdl_launch: {len(args)} arguments; at most {MAX_ARGS}")
    out = []
    for i, a in enumerate(args):
        if not isinstance(a, np.generic) or a.dtype not in _KINDS:
            name = a.dtype.name if isinstance(a, np.generic) else type(a).__name__
            raise UnsupportedError(
                f"pdl_launch: argument {i} is {name}; expected a numpy uint64 / int64 / int32 / "
                "uint32 / float32 scalar"
            )
        out.append(a.tobytes().ljust(SLOT, b"\0"))
    return b"".join(out)


def _dims(d: tuple) -> tuple[int, int, int]:
    d = tuple(int(v) for v in d) + (1, 1, 1)
    return d[0], d[1], d[2]


def launch_config(grid: tuple, block: tuple, shared_mem: int, stream: int) -> LaunchConfig:
    """A ``CUlaunchConfig`` with the programmatic-serialization attribute set (its
    ``attrs`` array is kept alive on the config object)."""
    attr = (LaunchAttribute * 1)()
    attr[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr[0].value.programmaticStreamSerializationAllowed = 1
    gx, gy, gz = _dims(grid)
    bx, by, bz = _dims(block)
    cfg = LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(stream))
    cfg.attrs = ctypes.cast(attr, ctypes.POINTER(LaunchAttribute))
    cfg.numAttrs = 1
    cfg._keep = attr  # type: ignore[attr-defined]
    return cfg


class PdlLauncher:
    """``cuLaunchKernelEx`` with programmatic stream serialization on the current context.
    The driver copies the arguments during the call, so one packed buffer (and one
    ``CUlaunchConfig`` per launch shape) serves every launch."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError) as e:  # pragma: no cover - needs a GPU driver
            raise UnsupportedError(f"pdl_launch: cuLaunchKernelEx is not available ({e})") from e
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.POINTER(LaunchConfig),
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
        ]
        self._fn = fn
        self._init_buffers()

    def _init_buffers(self) -> None:
        self._buf = ctypes.create_string_buffer(SLOT * MAX_ARGS)
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * MAX_ARGS)(*[base + SLOT * i for i in range(MAX_ARGS)])
        self._configs: dict[tuple, LaunchConfig] = {}

    def __call__(
        self, kernel: Any, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream: int
    ) -> None:
        func = int(getattr(kernel, "kernel", kernel).ptr)  # cupy RawKernel -> CUfunction
        data = pack_args(args)
        ctypes.memmove(self._buf, data, len(data))
        key = (grid, block, shared_mem, stream)
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._configs[key] = launch_config(grid, block, shared_mem, stream)
        err = self._fn(ctypes.byref(cfg), func, self._params, None)
        if err != 0:
            raise UnsupportedError(f"pdl_launch: cuLaunchKernelEx failed with CUresult {err}")


class PdlOps:
    """The CudaBackend's PDL state (a mixin): ``pdl`` (the small steps' GEMVs) and
    ``pdl_attention`` (their rope_kv and decode attention), from ``pdl_modes``; the driver
    launcher, loaded on first use."""

    pdl: bool = False
    pdl_attention: bool = False
    fused_decode_max_tokens: int  # (CudaBackend's)
    _pdl_launcher: PdlLauncher | None = None

    def _pdl_ready(self) -> PdlLauncher | None:
        """The driver's cuLaunchKernelEx, loaded on first use; None on a driver without it
        (before CUDA 12), which turns PDL off for this backend: plain launches, the same
        results."""
        if self._pdl_launcher is None:
            try:
                self._pdl_launcher = PdlLauncher()
            except UnsupportedError:
                self.pdl = self.pdl_attention = False
        return self._pdl_launcher

    def _pdl_step(self, t: int) -> bool:
        """Whether a step of ``t`` tokens launches rope_kv and decode attention with PDL:
        the fused small steps (whose GEMVs are PDL launches), unless ``LLMC_PDL=gemv``."""
        return self.pdl_attention and t <= self.fused_decode_max_tokens
