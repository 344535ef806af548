"""The ``wo gemm`` rows of python -m llmc.cuda.bench (cuda/bench_wo.py ``wo_gemm_rows``) on
the CPU: built on the TorchBackend at tiny shapes with the timing replaced (the GPU run is
the lead's): every (M, layout, projection, plan) row and its bf16 cuBLAS row, the right
FLOP count, each plan really set on the backend while it is timed, and the backend's plan
attributes restored afterwards."""

from __future__ import annotations

import torch

from llmc.cuda import bench_wo as bw
from llmc.cuda.torch_backend import TorchBackend


def test_gemm_rows_on_the_torch_backend(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(bw, "DEV", cpu)
    shapes = {"qkv": (96, 128), "o_proj": (128, 128), "gate_up": (512, 128), "down": (128, 256)}
    monkeypatch.setattr(bw, "SHAPES", shapes)
    be = TorchBackend(cpu)
    seen: list[str] = []

    def graph_ms(fn, calls):
        seen.append(getattr(be, "wo_gemm", "-"))
        out = fn()
        assert torch.isfinite(out).all()
        return 0.25

    rows: list[dict] = []

    def flops_row(name, shape, flops, ms, target):
        rows.append(dict(kernel=name, shape=shape, flops=flops, ms=ms, target=target))
        rows[-1]["plan_set"] = seen[-1]  # graph_ms ran just before

    bw.wo_gemm_rows(be, flops_row, graph_ms, tokens=(16, 40))
    by = {r["kernel"]: r for r in rows}
    plans = ("mma", "dequant")  # no sm_90 device here: no sm90 rows
    assert len(rows) == 2 * len(shapes) * (1 + len(bw.GEMM_PLAN_LAYOUTS) * len(plans))
    for m in (16, 40):
        for op, (r, k) in shapes.items():
            assert by[f"wo gemm M={m} bf16 cuBLAS {op}"]["flops"] == 2 * m * r * k
            for layout in bw.GEMM_PLAN_LAYOUTS:
                for plan in plans:
                    row = by[f"wo gemm M={m} {layout} {op} {plan}"]
                    assert row["shape"] == f"{m}x{k}->{r}" and row["target"] is None
                    assert row["plan_set"] == plan
    assert "wo_gemm" not in vars(be) and "wo_gemv_passes" not in vars(be)
