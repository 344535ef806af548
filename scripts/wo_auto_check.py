"""The weight-only ``auto`` plan on the GPU where it differs from dequantize-then-cuBLAS:
Llama-3-8B's gate_up (28,672 x 4,096) in int4 g128 and int8 at M = 40 and 64 rows. Prints
the plan ``auto`` picks (``WO_GEMM_TABLE``: mma), both plans' graph-replayed microseconds,
and the difference of their outputs (relative to the largest value; the outputs start
poisoned with NaN). GPU only; run from outside the checkout:

    python3 $REPO/scripts/wo_auto_check.py
"""

from __future__ import annotations

import torch

from llmc.cuda.bench import graph_ms
from llmc.cuda.bench_wo import LAYOUTS, random_packed
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")
N, K = 28672, 4096


def main() -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    g = torch.Generator(device=DEV).manual_seed(1)
    for name in ("int4_g128", "int8"):
        w = random_packed(N, K, LAYOUTS[name], g)
        for m in (40, 64):
            x = torch.randn(m, K, device=DEV, generator=g).to(torch.bfloat16)
            res = {}
            for plan in ("auto", "dequant"):
                be.wo_gemm = plan
                out = torch.full((m, N), float("nan"), device=DEV, dtype=torch.bfloat16)
                chosen = be._wo_gemm_plan(x, w, out)
                be.linear(x, w, out=out)
                res[plan] = out.float()
                us = graph_ms(lambda o=out, x=x, w=w: be.linear(x, w, out=o), 5) * 1e3
                print(name, m, plan, chosen, f"{us:.1f} us", flush=True)
            d = (res["auto"] - res["dequant"]).abs().max() / res["dequant"].abs().max()
            print(name, m, "rel diff", float(d), "nan", bool(res["auto"].isnan().any()))


if __name__ == "__main__":
    main()
