"""The weight-only rows of python -m llmc.cuda.bench (cuda/bench_wo.py) on the CPU: built on
the TorchBackend at tiny shapes with the timing replaced (the GPU run is the lead's): every op
of every layout is called with the protocol's signatures on PackedWeights of the right
layout, and the table has the per-op rows, the layer sums, the decode projection, the
lm_head row and the linear (GEMM) rows."""

from __future__ import annotations

import torch

from llmc.cuda import bench_wo as bw
from llmc.cuda.bench import _cycle as bench_cycle
from llmc.cuda.reference_wo import PackedWeight
from llmc.cuda.torch_backend import TorchBackend


def test_rows_on_the_torch_backend(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(bw, "DEV", cpu)
    shapes = {"qkv": (96, 128), "o_proj": (128, 128), "gate_up": (512, 128), "down": (128, 256)}
    monkeypatch.setattr(bw, "SHAPES", shapes)
    monkeypatch.setattr(bw, "LM_HEAD", (300, 128))
    monkeypatch.setattr(bw, "COPY_BYTES", 1)  # two copies per op
    seen: list[object] = []

    def graph_ms(fn, n):
        for _ in range(n):
            seen.append(fn())
        return 0.5

    rows: list[dict] = []

    def mem_row(name, shape, nbytes, ms, target):
        rows.append(dict(kernel=name, shape=shape, MB=nbytes / 1e6, ms=ms, target=target))

    def flops_row(name, shape, flops, ms, target):
        rows.append(dict(kernel=name, shape=shape, flops=flops, ms=ms, target=target))

    bw.wo_rows(
        TorchBackend(cpu), rows, mem_row, flops_row, graph_ms, bench_cycle,
        tokens=(1, 3), gemm_tokens=(16,),
    )  # fmt: skip
    by = {r["kernel"]: r for r in rows}
    labels = [*bw.LAYOUTS, "bf16"]
    for m in (1, 3):
        for label in labels:
            for op in shapes:
                assert f"wo T={m} {label} {op}" in by
            assert f"wo T={m} {label} layer (sum of rows)" in by
    assert "wo 8B decode projection int4_g128" in by and "wo 8B decode projection bf16" in by
    assert (
        "wo 8B decode projection int4_g128" in by and "tok_s" in by["wo 8B decode projection int8"]
    )
    assert by["wo T=1 int4_g128 qkv"]["target"] == 0.85 and by["wo T=3 int8 qkv"]["target"] is None
    # int4 g128 with f16 scales and offsets: K/2 code bytes + 2 x 2 bytes per 128 columns
    assert by["wo T=1 int4_g128 gate_up"]["MB"] == 512 * (64 + 2 * 2) / 1e6
    assert by["wo T=1 bf16 gate_up"]["MB"] == 512 * 128 * 2 / 1e6
    assert by["wo lm_head T=1 q6_k"]["shape"] == "128->300"
    for label in ("bf16 cuBLAS", *bw.LAYOUTS):
        assert by[f"wo linear M=16 {label} down"]["flops"] == 2 * 16 * 128 * 256
    # (T, layout incl. bf16, op, copy) + lm_head + the linear rows: (op, bf16 + layouts) x 3
    # calls a graph (the TorchBackend runs no gemv passes: no dequant+cuBLAS rows)
    assert len(seen) == 2 * 4 * 4 * 2 + 2 + 4 * (1 + len(bw.LAYOUTS)) * 3
    assert all(
        isinstance(w, PackedWeight)
        for w in (bw.random_packed(16, 256, v, torch.Generator()) for v in bw.LAYOUTS.values())
    )


def test_stage_sweep_rows(monkeypatch):
    """A backend with the CudaBackend's knobs (wo_stages, wo_prefetch) gets the "(stages S)"
    and "(no L2 prefetch)" rows, each knob back to its class default afterwards."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(bw, "DEV", cpu)
    shapes = {"qkv": (32, 128), "o_proj": (128, 128), "gate_up": (512, 128), "down": (128, 256)}
    monkeypatch.setattr(bw, "SHAPES", shapes)
    monkeypatch.setattr(bw, "LM_HEAD", (40, 128))
    monkeypatch.setattr(bw, "COPY_BYTES", 1)

    class Knobs(TorchBackend):
        wo_stages = 8
        wo_prefetch = True

    be = Knobs(cpu)
    set_to: list[int] = []

    def graph_ms(fn, n):
        set_to.append(be.wo_stages)
        for _ in range(n):
            fn()
        return 0.5

    table: list[dict] = []

    def row(name, *_):
        table.append({"kernel": name})

    bw.wo_rows(
        be, table, row, row, graph_ms, bench_cycle, tokens=(1, 8),
        gemm_tokens=(),
    )  # fmt: skip
    rows = [r["kernel"] for r in table]
    for label in bw.LAYOUTS:
        for op in shapes:
            for st in bw.STAGE_SWEEP[1]:
                assert f"wo T=1 {label} {op} (stages {st})" in rows
            assert f"wo T=8 {label} {op} (stages 0)" in rows
        assert f"wo T=8 {label} qkv (stages 4)" not in rows
    assert "wo T=1 int4_g128 qkv (no L2 prefetch)" in rows
    assert sorted(set(set_to)) == sorted({8, *bw.STAGE_SWEEP[1]})
    assert be.wo_stages == 8 and "wo_stages" not in vars(be)
