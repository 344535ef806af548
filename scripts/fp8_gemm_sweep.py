"""FP8 GEMM recipes against each other and bf16 cuBLAS at the Llama-3-8B projection shapes,
replayed from CUDA graphs (as the engine runs its steps) over enough weight copies that the
L2 serves none of them: ``torch._scaled_mm`` with row-wise scales (one per token row and
one per output channel: the engine's recipe) and with per-tensor scales (TensorRT-LLM's and
ModelOpt's default FP8 recipe: static activation scale), each with and without
``use_fast_accum`` (Hopper's fp8 MMAs accumulate in reduced precision; "fast" skips the
periodic promotion to float32), beside ``torch.mm`` in bf16. Each recipe's error is its
output's max |difference| from the float32 product of the same dequantized operands, over
the largest |value| of that product. GPU only (sm_89+); run from outside the checkout:

    python3 $REPO/scripts/fp8_gemm_sweep.py out.json [M ...]
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Any

import torch

from llmc.cuda.bench import _cycle, graph_ms
from llmc.cuda.bench_gemv8 import SHAPES

DEV = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
TOKENS = (128, 256, 512, 1024, 2048, 4096)
L2_BYTES = 256 << 20  # weight copies per timing: >= this many bytes


def _e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and float32 scales of x, one scale per row (amax / 448)."""
    scale = (x.abs().amax(dim=1).float() / 448.0).clamp_min(1e-12)
    return (x.float() / scale[:, None]).clamp(-448, 448).to(E4M3), scale


def _recipes(n: int, k: int, m: int, w: dict[str, Any], x: torch.Tensor) -> list[tuple]:
    """(name, one call per weight copy, float32 reference or None) of every recipe."""
    xq, xs = _e4m3_rows(x)
    xs_t = xs.max().reshape(())
    xq_t = (x.float() / xs_t).clamp(-448, 448).to(E4M3)
    out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)

    def mm(d: torch.Tensor) -> Any:
        return torch.mm(x, d.t(), out=out)

    def rowwise(wq: torch.Tensor, fast: bool) -> Any:
        return torch._scaled_mm(
            xq,
            wq.t(),
            scale_a=xs.view(m, 1),
            scale_b=w["ws"].view(1, n),
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
            out=out,
        )

    def tensorwise(wq: torch.Tensor, fast: bool) -> Any:
        return torch._scaled_mm(
            xq_t,
            wq.t(),
            scale_a=xs_t,
            scale_b=w["ws_t"],
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
            out=out,
        )

    ref_row = (xq.float() * xs[:, None]) @ (w["wq"].float() * w["ws"][:, None]).t()
    ref_t = (xq_t.float() * xs_t) @ (w["wq_t"].float() * w["ws_t"]).t()
    out_list = [("bf16 torch.mm", [partial(mm, d) for d in w["dense"]], None)]
    for fast in (False, True):
        tag = " fast" if fast else ""
        out_list.append(
            (f"fp8 rowwise{tag}", [partial(rowwise, q, fast) for q in w["wqs"]], ref_row)
        )
        out_list.append(
            (f"fp8 tensorwise{tag}", [partial(tensorwise, q, fast) for q in w["wqts"]], ref_t)
        )
    return [(name, fns, ref, out) for name, fns, ref in out_list]


def _weights(n: int, k: int, g: torch.Generator) -> dict[str, Any]:
    dense = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(torch.bfloat16)
    wq, ws = _e4m3_rows(dense)
    ws_t = ws.max().reshape(())  # per-tensor: one scale, codes re-made under it
    wq_t = (dense.float() / ws_t).clamp(-448, 448).to(E4M3)
    copies = max(1, -(-L2_BYTES // (n * k)))
    return {
        "wq": wq,
        "ws": ws,
        "wq_t": wq_t,
        "ws_t": ws_t,
        "wqs": [wq.clone() for _ in range(copies)],
        "wqts": [wq_t.clone() for _ in range(copies)],
        "dense": [dense.clone() for _ in range(max(1, copies // 2))],
    }


def main(path: str, tokens: tuple[int, ...]) -> None:
    g = torch.Generator(device=DEV).manual_seed(7)
    rows: list[dict[str, Any]] = []
    for op, (n, k) in SHAPES.items():
        w = _weights(n, k, g)
        for m in tokens:
            x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
            for name, fns, ref, out in _recipes(n, k, m, w, x):
                ms = graph_ms(_cycle(fns), len(fns))
                err = None
                if ref is not None:
                    fns[0]()
                    err = float(f"{float((out.float() - ref).abs().max() / ref.abs().max()):.3g}")
                rows.append(
                    {
                        "op": op,
                        "m": m,
                        "recipe": name,
                        "us": round(ms * 1e3, 1),
                        "tflops": round(2.0 * m * n * k / ms / 1e9, 1),
                        "err": err,
                    }
                )
                print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], tuple(int(a) for a in args[1:]) or TOKENS)
