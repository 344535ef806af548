"""Where the large-step weight-only linear spends its time (dequantize-then-cuBLAS, the
default plan): for the four Llama-3-8B projections, int4 g128 and int8 weights and M token
rows, the whole ``CudaBackend.linear`` (launched eagerly, and replayed from a CUDA graph
with and without the side-stream overlap) beside torch.mm on the bf16 weight of the same
shape, and the dequantize kernel alone
(every chunk of the weight into one chunk-sized buffer, as linear does; graph replays, no
launch cost) with its output rate in GB/s against the copy rate of the same run. GPU
only; run from outside the checkout:

    python3 $REPO/scripts/wo_gemm_quick.py out.json [M ...]
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from llmc.cuda.bench import ceilings, graph_ms, time_ms
from llmc.cuda.bench_gemv8 import SHAPES
from llmc.cuda.bench_wo import LAYOUTS, random_packed
from llmc.cuda.cuda_backend import CudaBackend
from llmc.cuda.wo_dequant_ops import wo_chunk_rows

DEV = torch.device("cuda")


def _dequantize(be: CudaBackend, w: Any, buf: torch.Tensor) -> None:
    """Every chunk of ``w`` dequantized into ``buf`` (one chunk's rows), as linear does."""
    n, chunk = w.shape[0], buf.shape[0]
    for n0 in range(0, n, chunk):
        be._wo_dequant_rows(w, n0, min(chunk, n - n0), buf)


def main(path: str, tokens: tuple[int, ...]) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    bw = ceilings()["copy_GBps"]
    g = torch.Generator(device=DEV).manual_seed(5)
    rows: list[dict[str, Any]] = []
    for op, (n, k) in SHAPES.items():
        dense = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
        packs = {name: random_packed(n, k, LAYOUTS[name], g) for name in ("int4_g128", "int8")}
        chunk = wo_chunk_rows(n, k, 2)
        for name, w in packs.items():
            buf = torch.empty(chunk, k, device=DEV, dtype=torch.bfloat16)

            ms = graph_ms(lambda w=w, buf=buf: _dequantize(be, w, buf), 3)
            rate = 2 * n * k / ms / 1e6
            rows.append(dict(op=op, layout=name, what="dequantize kernel", us=round(ms * 1e3, 1),
                             out_GBps=round(rate), copy_frac=round(rate / bw, 3)))  # fmt: skip
            print(rows[-1], flush=True)
        for m in tokens:
            x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            ref = time_ms(lambda x=x, out=out, d=dense: torch.mm(x, d.t(), out=out), repeats=10)
            rows.append(dict(op=op, m=m, layout="bf16", what="torch.mm", us=round(ref * 1e3, 1)))
            print(rows[-1], flush=True)
            for name, w in packs.items():
                fn = lambda x=x, out=out, w=w: be.linear(x, w, out=out)  # noqa: E731
                eager, graph = time_ms(fn, repeats=10), graph_ms(fn, 3)
                be.wo_dequant_overlap = False
                serial = graph_ms(fn, 3)
                del be.wo_dequant_overlap  # back to the class default
                for how, ms in (("eager", eager), ("graph", graph), ("graph, no overlap", serial)):
                    rows.append(
                        dict(
                            op=op,
                            m=m,
                            layout=name,
                            what=f"linear {how}",
                            us=round(ms * 1e3, 1),
                            of_bf16=round(ref / ms, 3),
                        )
                    )
                    print(rows[-1], flush=True)
        del dense, packs
    with open(path, "w") as f:
        json.dump({"copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(a) for a in sys.argv[2:]) or (256, 1024, 2048))
