"""The dequantize kernel of dequantize-then-cuBLAS against variants with more bytes in
flight a thread (cuda/wo_dequant.cu: ``wo_rows_kernel``, one 8-column unit a thread, and
``wo_rows_wide<R>``, R rows x 32 columns a thread) over whole 8B weights (gate_up, down),
int4 g128 / int8 / Q4_K-like, beside the device's write rate (fill of 1 GiB). Every variant's
output is compared with wo_rows_kernel's (bit for bit). CUDA-graph replays. GPU only; run
from outside the checkout:

    python3 $REPO/scripts/wo_dequant_sweep.py out.json
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np
import torch

from llmc.cuda.bench import graph_ms
from llmc.cuda.bench_gemv8 import SHAPES
from llmc.cuda.bench_wo import LAYOUTS, random_packed
from llmc.cuda.cuda_backend import CudaBackend
from llmc.cuda.launch_args import i32, ptr
from llmc.cuda.wo_dequant_ops import wo_scale_flags

DEV = torch.device("cuda")
NULL = np.uint64(0)
VARIANTS = [(r, b) for r in (1, 2, 4) for b in (64, 128, 256)]


def main(path: str) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    big = torch.empty(1 << 29, device=DEV, dtype=torch.bfloat16)
    fill = (1 << 30) / graph_ms(lambda b=big: b.fill_(1.0), 3) / 1e6
    del big
    print({"fill_1GiB_GBps": fill}, flush=True)
    g = torch.Generator(device=DEV).manual_seed(5)
    rows: list[dict[str, Any]] = []
    lib = be._lib(torch.bfloat16)
    for op in ("gate_up", "down"):
        n, k = SHAPES[op]
        out = torch.empty(n, k, device=DEV, dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        for name in ("int4_g128", "int8", "q4_k"):
            w = random_packed(n, k, LAYOUTS[name], g)
            base = graph_ms(lambda w=w, n=n, o=ref: be._wo_dequant_rows(w, 0, n, o), 3)
            gbps = n * k * 2 / base / 1e6
            rows.append({"op": op, "layout": name, "kernel": "wo_rows_kernel",
                         "us": round(base * 1e3, 1), "GBps": round(gbps)})  # fmt: skip
            print(rows[-1], flush=True)
            for r, b in VARIANTS:
                kern = lib.get("wo_dequant", f"wo_rows_wide{r}")
                offs = ptr(w.offsets) if w.offsets is not None else NULL
                args = (ptr(w.codes), ptr(w.scales), offs, ptr(out), i32(n), i32(k),
                        i32(w.bits), i32(w.code_zero), i32(w.group_size),
                        i32(w.scales.shape[1]), i32(wo_scale_flags(w)))  # fmt: skip
                grid = (math.ceil(k / (32 * b)), math.ceil(n / r))
                out.fill_(float("nan"))
                fn = lambda kern=kern, grid=grid, b=b, args=args: be._launch(kern, grid, (b,), args)  # noqa: E731
                fn()
                same = bool(torch.equal(out, ref))
                t = graph_ms(fn, 3)
                rows.append({"op": op, "layout": name, "kernel": f"wide{r}", "block": b,
                             "us": round(t * 1e3, 1), "GBps": round(n * k * 2 / t / 1e6),
                             "bit_exact": same})  # fmt: skip
                print(rows[-1], flush=True)
            del w
        del out, ref
    with open(path, "w") as f:
        json.dump({"fill_1GiB_GBps": fill, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
