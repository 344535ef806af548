"""The weight-only GEMV rows of ``python -m llmc.cuda.bench --only gemvwo`` without its stage
sweeps and large-step rows (seconds of GPU time instead of minutes): the four fused ops of
one Llama-3-8B layer at T = 1 and 8 token rows for int4 g128, int8, Q4_K-like and bf16
weights (llmc.cuda.bench_wo's layouts and inputs), CUDA-graph replays over >= 256 MB of
weight copies; at T = 1 each quantized op also without the L2 prefetch
(``WoOps.wo_prefetch = False``). Microseconds and the fraction of the copy rate measured in
the same run, as JSON. GPU only; run from outside the checkout:

    python3 $REPO/scripts/wo_gemv_quick.py out.json
"""

from __future__ import annotations

import json
import sys

import torch

from llmc.cuda import bench_wo
from llmc.cuda.bench import _cycle, ceilings, graph_ms
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")


def main(path: str) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    bw = ceilings()["copy_GBps"]
    g = torch.Generator(device=DEV).manual_seed(7)
    res: dict = {"copy_GBps": bw}

    def timed(key: str, fn, copies, nbytes: int) -> float:
        ms = graph_ms(_cycle([lambda w=w, fn=fn: fn(w) for w in copies]), len(copies))
        res[key] = dict(us=round(ms * 1000, 2), frac=round(nbytes / ms / 1e6 / bw, 3))
        return ms

    for m in (1, 8):
        fns = bench_wo._ops(be, m, g)
        for label, layout in {**bench_wo.LAYOUTS, "bf16": None}.items():
            total_ms = total_bytes = 0.0
            for op, (r, k) in bench_wo.SHAPES.items():
                copies = bench_wo._copies(r, k, layout, g)
                nbytes = bench_wo._nbytes(copies[0])
                total_ms += timed(f"T{m} {label} {op}", fns[op], copies, nbytes)
                total_bytes += nbytes
                if layout is not None and m == 1:
                    be.wo_prefetch = False
                    timed(f"T{m} {label} {op} nopf", fns[op], copies, nbytes)
                    del be.wo_prefetch  # back to the class default
                del copies
            res[f"T{m} {label} layer"] = dict(
                us=round(total_ms * 1000, 2), frac=round(total_bytes / total_ms / 1e6 / bw, 3)
            )
            print(f"T{m} {label} layer", res[f"T{m} {label} layer"], flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "wo_gemv_quick.json")
