"""An ncu target: the fused M = 1 GEMVs of one Llama-3-8B layer (qkv, o_proj, gate_up, down)
in the weight formats named on the command line (bf16, fp8, int4_g128, int8, q4_k; default
all but q4_k), each launched once inside cudaProfilerStart / Stop after a warm-up call (the
kernels compile outside the profiled range). GPU only. Run it under Nsight Compute from
outside the checkout (its cuda/ folder shadows NVIDIA's package):

    ncu --clock-control none --profile-from-start off -k regex:gemv \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis python3 $REPO/scripts/gemv_ncu_target.py int4_g128
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from llmc.cuda import bench_gemv8, bench_wo
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")


def calls(be: CudaBackend, labels: list[str], g: torch.Generator) -> list[Callable[[], None]]:
    """One closure per (format, op): the op on its own random weight of the 8B shape."""
    fns = bench_wo._ops(be, 1, g)
    fp8 = bench_gemv8._ops(be, 1, g)
    out: list[Callable[[], None]] = []
    for label in labels:
        for op, (r, k) in bench_gemv8.SHAPES.items():
            dense = (torch.randn(r, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
            if label == "bf16":
                out.append(lambda w=dense, fn=fns[op]: fn(w))
            elif label == "fp8":
                w8 = ref8.quantize_weight_fp8(dense)
                out.append(lambda w=w8, fn=fp8[op]["fp8 fused"]: fn(w))
            else:
                packed = bench_wo.random_packed(r, k, bench_wo.LAYOUTS[label], g)
                out.append(lambda w=packed, fn=fns[op]: fn(w))
    return out


def main(argv: list[str]) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    todo = calls(
        be, argv or ["bf16", "fp8", "int4_g128", "int8"], torch.Generator(DEV).manual_seed(1)
    )
    for c in todo:  # warm-up: compiles and plans outside the profiled range
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for c in todo:
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("launched", len(todo))


if __name__ == "__main__":
    main(sys.argv[1:])
