"""The sampling rows of ``python -m llmc.cuda.bench``: ``CudaBackend.sample`` on a
64 x 128,256 float32 logits batch (the Llama-3 vocabulary at batch 64).

Rows: greedy, temperature only, top-k 50 + top-p 0.9, top-p 0.9 alone, min-p 0.05, top-k
50 + top-p 0.9 with penalties (which also read the [64, V] counts and prompt mask), and
top-k 50 + top-p 0.9 on ``sample_kernel`` (one CTA per row: the pre-cluster structure, for
the record); then greedy, temperature 0.7 and temperature 0.7 + top-p 0.9 at batch 512 (the
8B sampled bench row's setting at about its mean decode batch: what that row pays a step),
the last two also on ``sample_kernel`` (which kernel a batch that large should run: the
cluster kernel's 64 KB a CTA allow ~50 rows a wave).
GB/s of the bytes a row must read (logits, plus counts and mask with penalties) against the
copy rate measured in the same run; targets from issue 17: top-k / top-p / min-p in <= 0.3
ms, greedy and temperature not slower than the 0.24 ms measured before the cluster kernel.
CUDA-graph replays cycling over ``COPIES`` logits batches (131 MB: L2 serves none).
``python -m llmc.cuda.bench --only sampling`` runs these alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmc.cuda.backend import SamplingMetadata

DEV = torch.device("cuda")
S, V = 64, 128256
S_LARGE = 512  # about the mean decode batch of the 8B 128/128 rows
COPIES = 4  # 4 x 32.8 MB of logits per graph cycle (4 x 263 MB at S_LARGE)
FILTER_MS, PLAIN_MS = 0.3, 0.24  # issue 17's targets
CASES = (
    # label, temperature, top_k, top_p, min_p, penalties, one CTA per row, target ms
    ("sample(greedy)", 0.0, 0, 1.0, 0.0, False, False, PLAIN_MS),
    ("sample(temperature=0.8)", 0.8, 0, 1.0, 0.0, False, False, PLAIN_MS),
    ("sample(top_k=50,top_p=0.9)", 0.8, 50, 0.9, 0.0, False, False, FILTER_MS),
    ("sample(top_p=0.9)", 0.8, 0, 0.9, 0.0, False, False, FILTER_MS),
    ("sample(min_p=0.05)", 0.8, 0, 1.0, 0.05, False, False, FILTER_MS),
    ("sample(top_k=50,top_p=0.9,penalties)", 0.8, 50, 0.9, 0.0, True, False, FILTER_MS),
    ("sample(top_k=50,top_p=0.9) one CTA/row", 0.8, 50, 0.9, 0.0, False, True, None),
)
LARGE_CASES = (  # batch S_LARGE, no target (the bench row's share of a step is the measure)
    ("sample(greedy)", 0.0, 0, 1.0, 0.0, False, False, None),
    ("sample(temperature=0.7)", 0.7, 0, 1.0, 0.0, False, False, None),
    ("sample(temperature=0.7,top_p=0.9)", 0.7, 0, 0.9, 0.0, False, False, None),
    # the cluster kernel keeps 64 KB of each row per CTA (3 CTAs an SM: ~50 rows a wave of
    # 132 SMs, ~10 waves at 512 rows); one CTA per row re-reads the logits but fits ~1 wave.
    # Measured (H200, 2026-12-02, sampler v5): 0.84 ms cluster against 1.49 one CTA a row
    ("sample(temperature=0.7) one CTA/row", 0.7, 0, 1.0, 0.0, False, True, None),
    ("sample(temperature=0.7,top_p=0.9) one CTA/row", 0.7, 0, 0.9, 0.0, False, True, None),
)


def sampling_meta(
    temp: float, k: int, p: float, m: float, penalties: bool, S: int = S
) -> SamplingMetadata:
    """S rows of one setting; seeds 0..S-1; penalties: 5 % of the vocabulary seen."""
    meta = SamplingMetadata(
        temperature=torch.full((S,), temp, device=DEV),
        top_k=torch.full((S,), k, dtype=torch.int32, device=DEV),
        top_p=torch.full((S,), p, device=DEV),
        min_p=torch.full((S,), m, device=DEV),
        seeds=torch.arange(S, device=DEV),
        offsets=torch.zeros(S, dtype=torch.int64, device=DEV),
        repetition_penalty=torch.full((S,), 1.1 if penalties else 1.0, device=DEV),
        presence_penalty=torch.full((S,), 0.2 if penalties else 0.0, device=DEV),
        frequency_penalty=torch.full((S,), 0.1 if penalties else 0.0, device=DEV),
        all_greedy=temp == 0.0,
    )
    if penalties:
        seen = torch.rand(S, V, device=DEV) < 0.05
        meta.output_counts = (seen * torch.randint(1, 4, (S, V), device=DEV)).to(torch.int32)
        meta.prompt_mask = torch.rand(S, V, device=DEV) < 0.01
    return meta


def sampling_rows(
    be: Any, mem_row: Callable, graph_ms: Callable, cycle: Callable, copy_gbps: float
) -> None:
    """Append the sampling rows (see the module docstring) through ``mem_row``;
    ``copy_gbps``: the copy ceiling of the run (targets are fractions of it)."""
    for rows, cases in ((S, CASES), (S_LARGE, LARGE_CASES)):
        logits = [torch.randn(rows, V, device=DEV) * 3 for _ in range(COPIES)]
        for label, temp, k, p, m, pen, row_kernel, target_ms in cases:
            meta = sampling_meta(temp, k, p, m, pen, rows)
            nbytes = logits[0].nbytes + (rows * V * 5 if pen else 0)  # + counts, mask
            be.cluster_sampling = not row_kernel and be.cluster_decode
            fns = [lambda x=x, meta=meta: be.sample(x, meta) for x in logits]
            ms = graph_ms(cycle(fns), calls=2 * COPIES)
            be.cluster_sampling = be.cluster_decode
            # the target time as a fraction of the copy rate (the table's ok column)
            target = None if target_ms is None else nbytes / target_ms / 1e6 / copy_gbps
            mem_row(f"{label} (graph)", f"{rows}x{V} f32", nbytes, ms, target)
        del logits
