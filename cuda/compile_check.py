"""``python -m llmc.cuda.compile_check``: every .cu file compiles for sm_90 with nvcc.

Each family is compiled (in parallel; prefill_attention_sm90.cu for sm_90a) for a few
configs: the three dtypes at the Llama-8B-like defaults (head_dim 128, GQA 32/8), and odd
shapes (SmolLM2's 64-dim 9/3 heads, the tiny test model's 16-dim 4/2). Prints a skip
message and exits 0 when nvcc is absent; exits 1 on any failure, printing the compiler's
error.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmc.base.errors import LlmcError
from llmc.cuda.build import families_for, nvcc_compile
from llmc.cuda.kernels import FAMILIES, KernelConfig, family_arch, source

CHECK_CONFIGS = (
    KernelConfig("bfloat16", 128, 32, 8),
    KernelConfig("float16", 128, 32, 8),
    KernelConfig("float32", 128, 32, 8),
    KernelConfig("bfloat16", 64, 9, 3),
    KernelConfig("float32", 16, 4, 2),
)


def jobs(arch: str = "sm_90") -> list[tuple[str, KernelConfig]]:
    """(family, config) pairs to compile; config-free families once per dtype."""
    out: list[tuple[str, KernelConfig]] = []
    seen: set[str] = set()
    for cfg in CHECK_CONFIGS:
        for fam in families_for(cfg, arch):
            key = source(fam, cfg)
            if key not in seen:
                seen.add(key)
                out.append((fam, cfg))
    return out


def main(arch: str = "sm_90") -> int:
    if shutil.which("nvcc") is None:
        print("compile_check: nvcc not found on PATH; skipping the kernel compile check")
        return 0
    todo = jobs(arch)
    t0 = time.time()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:

        def one(job: tuple[str, KernelConfig]) -> str | None:
            fam, cfg = job
            out = Path(tmp) / f"{fam}-{abs(hash(cfg))}.cubin"
            try:
                target = family_arch(fam, arch) or arch
                nvcc_compile(source(fam, cfg), target, out, extra=("-Werror", "all-warnings"))
            except LlmcError as e:
                return f"{FAMILIES[fam][0]} {cfg}: {e}"
            return None

        with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
            failures = [r for r in pool.map(one, todo) if r]
    for f in failures:
        print("FAIL", f)
    print(
        f"compile_check: {len(todo) - len(failures)}/{len(todo)} kernel builds for {arch} "
        f"ok in {time.time() - t0:.1f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
