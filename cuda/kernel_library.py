"""``KernelLibrary``: the CuPy kernels of one kernel config, loaded from an engine's
``kernels/`` cubins when present, else from the kernel cache (``llmc.cuda.kernel_cache``,
which compiles a missing cubin with NVRTC once a machine).

Invariant: importing this module needs neither CuPy nor a GPU; a ``KernelLibrary`` needs
CuPy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmc.base.errors import UnsupportedError
from llmc.cuda.kernel_cache import runtime_cubin
from llmc.cuda.kernels import KernelConfig, cubin_name, family_arch, has_kernels


class KernelLibrary:
    """CuPy kernels of one config: cubins from ``kernel_dir`` when present, else from the
    kernel cache (compiled there with NVRTC when missing).

    ``get(family, name)`` returns a ``cupy.RawKernel``; modules are loaded once and cached.
    """

    def __init__(self, cfg: KernelConfig, kernel_dir: Path | str | None = None) -> None:
        import cupy  # noqa: F401  (fail early with ImportError where CuPy is missing)

        self.cfg = cfg
        self.kernel_dir = Path(kernel_dir) if kernel_dir is not None else None
        self._modules: dict[str, Any] = {}
        self.loaded_from: dict[str, str] = {}

    def _arch(self) -> str:
        import cupy

        return f"sm_{cupy.cuda.Device().compute_capability}"  # e.g. sm_90

    def module(self, family: str) -> Any:
        mod = self._modules.get(family)
        if mod is not None:
            return mod
        import cupy

        arch = family_arch(family, self._arch())
        if arch is None or not has_kernels(family, self.cfg):
            raise UnsupportedError(
                f"{family} has no kernel for dtype {self.cfg.dtype} / head_dim "
                f"{self.cfg.head_dim} on {self._arch()}"
            )
        if self.kernel_dir is not None:
            path = self.kernel_dir / cubin_name(family, self.cfg, arch)
            if path.is_file():
                mod = cupy.RawModule(path=str(path))
                self.loaded_from[family] = str(path)
        if mod is None:
            mod = cupy.RawModule(path=str(runtime_cubin(family, self.cfg, arch)))
            self.loaded_from[family] = "nvrtc"
        self._modules[family] = mod
        return mod

    def get(self, family: str, name: str) -> Any:
        return self.module(family).get_function(name)
