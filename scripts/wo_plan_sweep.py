"""The large-step weight-only linear's plans against each other and bf16 cuBLAS, all
replayed from CUDA graphs (as the engine runs decode): for the four Llama-3-8B projections,
int4 g128 and int8 weights and M token rows, ``CudaBackend.linear`` under ``wo_gemm`` =
dequant (dequantize-then-cuBLAS), mma (cuda/gemm_wo.cu), sm90 (cuda/gemm_wo_sm90.cu) and
auto (the default: the plan ``WO_GEMM_TABLE`` picks, named in the row's ``chose``), beside
torch.mm on a bf16 weight of the same shape; each plan's output is compared with dequant's
(max |difference| over max |value|: float32 sums in another order). Picks the rows of
``WO_GEMM_TABLE``. GPU only; run from outside the checkout:

    python3 $REPO/scripts/wo_plan_sweep.py out.json [M ...]
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from llmc.cuda.bench import graph_ms
from llmc.cuda.bench_gemv8 import SHAPES
from llmc.cuda.bench_wo import LAYOUTS, random_packed
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")
TOKENS = (16, 64, 128, 256, 512, 1024, 2048)
PLANS = ("dequant", "mma", "sm90", "auto")


def main(path: str, tokens: tuple[int, ...]) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    g = torch.Generator(device=DEV).manual_seed(7)
    rows: list[dict[str, Any]] = []

    def row(**kw: Any) -> None:
        rows.append(kw)
        print(kw, flush=True)

    for op, (n, k) in SHAPES.items():
        dense = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
        packs = {name: random_packed(n, k, LAYOUTS[name], g) for name in ("int4_g128", "int8")}
        for m in tokens:
            x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            fn = lambda x=x, o=out, d=dense: torch.mm(x, d.t(), out=o)  # noqa: E731
            ref_ms = graph_ms(fn, 3)
            row(op=op, m=m, layout="bf16", plan="torch.mm", us=round(ref_ms * 1e3, 1))
            for name, w in packs.items():
                base = None
                for plan in PLANS:
                    be.wo_gemm = plan
                    fn = lambda x=x, o=out, w=w: be.linear(x, w, out=o)  # noqa: E731
                    fn()
                    got = out.float()
                    if base is None:
                        base = got
                    rel = float((got - base).abs().max() / base.abs().max().clamp_min(1e-30))
                    ms = graph_ms(fn, 3)
                    row(op=op, m=m, layout=name, plan=plan, us=round(ms * 1e3, 1),
                        of_bf16=round(ref_ms / ms, 3), rel_diff=rel,
                        chose=be._wo_gemm_plan(x, w, out))  # fmt: skip
        del dense, packs
    del be.wo_gemm
    with open(path, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(a) for a in sys.argv[2:]) or TOKENS)
