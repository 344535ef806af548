"""The FP8 GEMV rows of python -m llmc.cuda.bench (cuda/bench_gemv8.py) on the CPU: built
on the TorchBackend at tiny shapes with the timing replaced (the GPU run is the lead's):
every op of every label is called with the protocol's signatures on weights of the right
dtype, and the table has the fp8 fused / fp8 unfused / bf16 fused rows per (T, op) plus the
layer sums."""

from __future__ import annotations

import torch

from llmc.cuda import bench_gemv8 as b8
from llmc.cuda.bench import _cycle as bench_cycle
from llmc.cuda.torch_backend import TorchBackend


def test_rows_on_the_torch_backend(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(b8, "DEV", cpu)
    shapes = {"qkv": (96, 64), "o_proj": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    monkeypatch.setattr(b8, "SHAPES", shapes)
    monkeypatch.setattr(b8, "COPY_BYTES", 1)  # two copies per op
    calls = []

    def graph_ms(fn, n):
        for _ in range(n):
            out = fn()
            calls.append(out)
        return 0.5

    rows: list[dict] = []

    def mem_row(name, shape, nbytes, ms, target):
        rows.append(dict(kernel=name, shape=shape, MB=nbytes / 1e6, ms=ms, target=target))

    b8.fp8_gemv(TorchBackend(cpu), rows, mem_row, graph_ms, bench_cycle, tokens=(1, 3))
    names = [r["kernel"] for r in rows]
    assert len(rows) == 2 * (4 * 3 + 3) and len(calls) == 2 * 4 * 3 * 2
    assert names[:3] == [
        "gemv8 T=1 qkv fp8 fused",
        "gemv8 T=1 qkv fp8 unfused",
        "gemv8 T=1 qkv bf16 fused",
    ]
    assert "gemv8 T=3 layer (fp8 fused, sum of rows)" in names
    by = {r["kernel"]: r for r in rows}
    assert by["gemv8 T=1 gate_up fp8 fused"]["MB"] == 256 * 64 / 1e6
    assert by["gemv8 T=1 gate_up bf16 fused"]["MB"] == 2 * 256 * 64 / 1e6
    assert by["gemv8 T=1 down fp8 fused"]["shape"] == "128->64"
    assert by["gemv8 T=1 qkv fp8 fused"]["target"] == 0.85
    assert by["gemv8 T=3 qkv fp8 fused"]["target"] is None
    layer = by["gemv8 T=1 layer (bf16 fused, sum of rows)"]
    assert (
        layer["ms"] == 4 * 0.5 and layer["MB"] == 2 * sum(r * k for r, k in shapes.values()) / 1e6
    )
