"""The weight-only GEMV rows of ``python -m llmc.cuda.bench --only gemvwo`` without its ring
stage sweeps and large-step rows (seconds of GPU time instead of minutes):
``llmc.cuda.bench_wo.wo_rows`` with ``stage_sweep={}`` and no ``wo linear`` rows — the four
fused ops of one Llama-3-8B layer at T = 1 and 8 token rows for int4 g128, int8, Q4_K-like
and bf16 weights, the int4 / int8 ones at T = 1 also without the L2 prefetch, the layer
sums, the 8B decode projection and the Q6_K lm_head. Microseconds and the fraction of the
copy rate measured in the same run, as JSON. ``STAGES="0 4 8"`` adds the ring rows of those
depths at T = 1 (``WoOps.wo_stages``; 0: the register stream). GPU only; run from outside
the checkout:

    [STAGES="0 4 8"] python3 $REPO/scripts/wo_gemv_quick.py out.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from llmc.cuda.bench import _cycle, ceilings, graph_ms
from llmc.cuda.bench_wo import wo_rows
from llmc.cuda.cuda_backend import CudaBackend


def main(path: str) -> None:
    be = CudaBackend(torch.device("cuda"), max_num_seqs=256)
    bw = ceilings()["copy_GBps"]
    rows: list[dict[str, Any]] = []

    def mem_row(name: str, shape: str, nbytes: int, ms: float, target: float | None) -> None:
        rows.append(dict(kernel=name, shape=shape, us=round(ms * 1000, 2),
                         frac=round(nbytes / ms / 1e6 / bw, 3), target=target))  # fmt: skip
        print(rows[-1], flush=True)

    def flops_row(*_: Any) -> None:  # no wo linear rows here (gemm_tokens=())
        raise AssertionError("unexpected flops row")

    stages = tuple(int(s) for s in os.environ.get("STAGES", "").split())
    sweep = {1: stages} if stages else {}
    wo_rows(be, rows, mem_row, flops_row, graph_ms, _cycle, gemm_tokens=(), stage_sweep=sweep)
    with open(path, "w") as f:
        json.dump({"copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "wo_gemv_quick.json")
