"""Dequantize-then-cuBLAS against its chunk size: the large-step weight-only linear (int4
g128, int8) of the Llama-3-8B gate_up / down / qkv projections at M = 512 and 1024 for
chunks of 96 / 48 / 24 / 12 / 6 / 3 MB (two chunk buffers in turn under graph capture:
small chunks stay in L2, large ones make fewer, fuller GEMMs), beside torch.mm on the bf16
weight and the device's write rate (fill of 1 GiB: DRAM; of one 12 MB buffer again and
again: L2, launch gaps included). CUDA-graph replays (2026-12-03 at bb2ac9b over 3-24 MB:
24 MB fastest, each further chunk ~6-8 us; at ada9753 over 24-256 MB: one chunk a weight
fastest, the default since). GPU only; run from outside the checkout:

    python3 $REPO/scripts/wo_chunk_sweep.py out.json [CHUNK_MB ...]   # default: CHUNK_MB
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from llmc.cuda.bench import ceilings, graph_ms
from llmc.cuda.bench_gemv8 import SHAPES
from llmc.cuda.bench_wo import LAYOUTS, random_packed
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")
CHUNK_MB = (96, 48, 24, 12, 6, 3)
OPS = ("gate_up", "down", "qkv")
TOKENS = (512, 1024)


def write_rates() -> dict[str, float]:
    """GB/s of fill_ over 1 GiB (DRAM) and over one 12 MB buffer 20 times (L2)."""
    big = torch.empty(1 << 29, device=DEV, dtype=torch.bfloat16)
    small = torch.empty(6 << 20, device=DEV, dtype=torch.bfloat16)
    dram = graph_ms(lambda: big.fill_(1.0), 3)
    l2 = graph_ms(lambda: small.fill_(1.0), 20)
    return {"fill_1GiB_GBps": (1 << 30) / dram / 1e6, "fill_12MB_GBps": (12 << 20) / l2 / 1e6}


def main(path: str, chunk_mb: tuple[int, ...] = CHUNK_MB) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    ceil = ceilings() | write_rates()
    print(ceil, flush=True)
    g = torch.Generator(device=DEV).manual_seed(9)
    rows: list[dict[str, Any]] = []

    def row(**kw: Any) -> None:
        rows.append(kw)
        print(kw, flush=True)

    for op in OPS:
        n, k = SHAPES[op]
        dense = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
        packs = {name: random_packed(n, k, LAYOUTS[name], g) for name in ("int4_g128", "int8")}
        xs = {m: torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16) for m in TOKENS}
        outs = {m: torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for m in TOKENS}
        for m in TOKENS:
            fn = lambda x=xs[m], o=outs[m], d=dense: torch.mm(x, d.t(), out=o)  # noqa: E731
            row(op=op, m=m, what="bf16 torch.mm", us=round(graph_ms(fn, 3) * 1e3, 1))
        for mb in chunk_mb:
            be.wo_chunk_bytes = mb << 20
            for name, w in packs.items():
                for m in TOKENS:
                    fn = lambda x=xs[m], o=outs[m], w=w: be.linear(x, w, out=o)  # noqa: E731
                    row(op=op, m=m, chunk_mb=mb, layout=name, what="linear",
                        us=round(graph_ms(fn, 3) * 1e3, 1))  # fmt: skip
        del be.wo_chunk_bytes
        del dense, packs
    with open(path, "w") as f:
        json.dump({"ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(a) for a in sys.argv[2:]) or CHUNK_MB)
