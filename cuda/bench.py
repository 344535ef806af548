"""``python -m llmc.cuda.bench``: each kernel's achieved rate beside the measured ceilings.

Measures the device-to-device copy bandwidth (bytes read + written) and the bf16 matmul
rate once per run, then times every CudaBackend kernel on random inputs at the issue's
shapes (replayed from a CUDA graph of 10 calls, as the runner replays its steps: CUDA
events, warm-up, median of repeats; tensors of 64 MB and up, so L2 does not serve them) and
prints a table: achieved GB/s (memory-bound kernels) or TFLOP/s
(prefill attention: ``llmc.cuda.bench_prefill``; GEMMs), the fraction of the ceiling, and
the target of issue 4 (issue 12 for the sm90 prefill and the FP8 rows of
``llmc.cuda.bench_fp8``). Writes JSON
(``--json PATH``, default ``$OUT/kernel_bench.json`` when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmc.cuda.bench_gemv8 import fp8_gemv
from llmc.cuda.bench_sampling import sampling_rows
from llmc.cuda.bench_wo import wo_gemm_rows, wo_rows

DEV = torch.device("cuda")
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


def time_ms(fn: Callable[[], Any], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` event-timed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn: Callable[[], Any], calls: int = 10) -> float:
    """Median ms of one ``fn`` replayed from a CUDA graph of ``calls`` calls (no host
    launch cost: short kernels are host-bound when launched one by one from Python, and an
    event-timed eager launch also counts the GPU's wait for the host's launch: 257 against
    210 us for the H100's 64 x 4,096 fp8-KV decode attention, 2026-12-07). Every kernel row
    of the bench is timed so since 2026-12-07; ``time_ms`` times the ceilings (1 GiB copies,
    8192^3 matmuls: launch-bound by ~1 %)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return time_ms(g.replay) / calls


def ceilings() -> dict[str, float]:
    n = 1 << 30  # 1 GiB each way
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    m = 8192
    a = torch.randn(m, m, device=DEV).to(BF16)
    b = torch.randn(m, m, device=DEV).to(BF16)
    mm_ms = time_ms(lambda: a @ b, repeats=10)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "matmul_TFLOPs": 2 * m**3 / mm_ms / 1e9}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from llmc.cuda.cuda_backend import CudaBackend

    torch.manual_seed(0)
    be = CudaBackend(DEV, max_num_seqs=256)
    ceil = ceilings()
    bw, mm = ceil["copy_GBps"], ceil["matmul_TFLOPs"]
    rows: list[dict[str, Any]] = []

    def add_row(name, shape, ms, achieved, unit, ceiling, target, **extra) -> None:
        row = dict(kernel=name, shape=shape, ms=ms, **extra)
        row.update(achieved=achieved, unit=unit, fraction=achieved / ceiling, target=target)
        rows.append(row)

    def mem_row(name, shape, nbytes, ms, target) -> None:  # GB/s against the copy ceiling
        add_row(name, shape, ms, nbytes / ms / 1e6, "GB/s", bw, target, MB=nbytes / 1e6)

    def flops_row(name, shape, flops, ms, target) -> None:  # TFLOP/s against the matmul ceiling
        add_row(name, shape, ms, flops / ms / 1e9, "TFLOP/s", mm, target)

    if args.only == "gemv8":  # the fp8 GEMV rows alone (seconds of GPU time)
        fp8_gemv(be, rows, mem_row, graph_ms, _cycle)
        return _result(ceil, rows)
    if args.only == "sampling":  # the sampling rows alone (seconds of GPU time)
        sampling_rows(be, mem_row, graph_ms, _cycle, bw)
        return _result(ceil, rows)
    if args.only == "decode":  # decode attention alone (seconds of GPU time)
        from llmc.cuda.bench_fp8 import decode_64x4096

        decode_64x4096(be, graph_ms, mem_row)
        decode_short(be, rows, mem_row)
        return _result(ceil, rows)
    if args.only in ("gemvwo", "gemmwo"):  # the weight-only rows alone (llmc.cuda.bench_wo)
        if args.only == "gemvwo":
            wo_rows(be, rows, mem_row, flops_row, graph_ms, _cycle)
        wo_gemm_rows(be, flops_row, graph_ms)
        return _result(ceil, rows)

    # RMSNorm / fused add + RMSNorm: 16384 x 4096 bf16 (128 MiB per tensor)
    t, h = 16384, 4096
    x = torch.randn(t, h, device=DEV).to(BF16)
    res = torch.randn(t, h, device=DEV).to(BF16)
    w = torch.randn(h, device=DEV).to(BF16)
    out = torch.empty_like(x)
    mem_row(
        "rms_norm",
        f"{t}x{h} bf16",
        2 * x.nbytes,
        graph_ms(lambda: be.rms_norm(x, w, 1e-5, out)),
        0.8,
    )
    mem_row(
        "add_rms_norm",
        f"{t}x{h} bf16",
        4 * x.nbytes,
        graph_ms(lambda: be.add_rms_norm(x, res, w, 1e-5, out)),
        0.8,
    )
    ids = torch.randint(0, 32000, (t,), device=DEV)
    table = torch.randn(32000, h, device=DEV).to(BF16)
    mem_row(
        "embedding",
        f"{t} ids x {h} bf16",
        2 * x.nbytes,
        graph_ms(lambda: be.embedding(ids, table, out)),
        None,
    )

    # SiLU-and-mul: 4096 x 2*14336 bf16 in (235 MB), 117 MB out
    t, i = 4096, 14336
    gu = torch.randn(t, 2 * i, device=DEV).to(BF16)
    act = torch.empty(t, i, device=DEV, dtype=BF16)
    mem_row(
        "silu_and_mul",
        f"{t}x{2 * i} bf16",
        gu.nbytes + act.nbytes,
        graph_ms(lambda: be.silu_and_mul(gu, act)),
        0.8,
    )

    # RoPE + KV write: 16384 tokens, GQA 32/8, head_dim 128, bf16 (201 MB qkv) and fp8 caches
    from llmc.cuda.bench_fp8 import decode_64x4096, fp8_rows, rope_kv_rows

    rope_kv_rows(be, graph_ms, mem_row)

    # Decode attention: batch 64 x 4096 context, GQA 32/8, head_dim 128, bf16 and fp8 KV,
    # replayed from CUDA graphs as the runner runs decode steps
    decode_64x4096(be, graph_ms, mem_row)
    decode_short(be, rows, mem_row)
    fused_gemv(be, rows, mem_row)
    fp8_gemv(be, rows, mem_row, graph_ms, _cycle)
    wo_rows(be, rows, mem_row, flops_row, graph_ms, _cycle)
    wo_gemm_rows(be, flops_row, graph_ms)

    # Prefill attention: sm90 and mma.sync kernels, bf16 / fp8 KV, beside torch SDPA
    from llmc.cuda.bench_prefill import prefill_rows

    prefill_rows(be, flops_row, graph_ms)

    # FP8: quantizing epilogues and W8A8 GEMMs (llmc.cuda.bench_fp8)
    fp8_rows(be, graph_ms, mem_row, flops_row, torch.cuda.get_device_capability())

    # Sampling: 64 rows x 128256 vocab, each filter (llmc.cuda.bench_sampling)
    sampling_rows(be, mem_row, graph_ms, _cycle, bw)

    return _result(ceil, rows)


def _result(ceil: dict[str, float], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "device": torch.cuda.get_device_name(),
        "ceilings": ceil,
        "kernels": rows,
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }


# (q heads, kv heads, head_dim, max_seq_len at capture, batch, context range): the Llama-3-8B
# shape at the 8B rows' batches, and the SmolLM2-135M shape (9/3 x 64, the dummy profile's
# max_seq_len 2048) at the 135M 128/128 row's ~1,000-row decode batch (its decode steps
# spent ~48 % of their GPU time in attention in the pass-4 profile)
DECODE_SHORT_CASES = (
    *((32, 8, 128, 8192, b, lo, hi) for b, lo, hi in
      ((512, 128, 256), (256, 128, 256), (128, 128, 256), (32, 128, 256), (1, 256, 256),
       (192, 2048, 2176))),
    (9, 3, 64, 2048, 1024, 128, 256),
    (9, 3, 64, 2048, 512, 128, 256),
)  # fmt: skip
# forced (splits, min keys) plans beside the auto one, per cache dtype
DECODE_SHORT_PLANS = {"bf16": ((1, None), (2, 1), (4, 64), (8, 32)), "fp8": ((1, None),)}


def decode_short(be: Any, rows: list, mem_row: Callable) -> None:
    """Decode attention at the end-to-end shapes (``DECODE_SHORT_CASES``): short contexts
    (and the 2048/128 row's), the engine's max_seq_len at capture (as CUDA graphs see it), a
    bf16 and an e4m3 cache; ``auto`` beside forced split plans (splits, min keys,
    ``DECODE_SHORT_PLANS``). Timed as CUDA-graph replays (as the runner runs decode
    steps)."""
    from llmc.cuda.backend import AttentionMetadata

    bs, max_num_seqs = 32, be.max_num_seqs
    g = torch.Generator().manual_seed(1)
    for nq, nkv, hd, max_seq, batch, lo, hi in DECODE_SHORT_CASES:
        if batch > be.max_num_seqs:
            be.reserve(batch, nq, hd)
            be.max_num_seqs = batch
        lens = torch.randint(lo, hi + 1, (batch,), generator=g)
        nbs = [math.ceil(int(n) / bs) for n in lens]
        total = sum(nbs)
        # pad the pool so that KV is >= 64 MB in e4m3 (L2 does not serve repeats)
        pool = max(total, (128 << 20) // (2 * bs * nkv * hd * 2) + 1)
        kc16 = torch.randn(pool, bs, nkv, hd, device=DEV).to(BF16)
        vc16 = torch.randn_like(kc16, dtype=torch.float32).to(BF16)
        perm = torch.randperm(pool)[:total].to(torch.int32)
        tables = torch.full((batch, max_seq // bs), -1, dtype=torch.int32)
        k = 0
        for i, nb in enumerate(nbs):
            tables[i, :nb] = perm[k : k + nb]
            k += nb
        meta = AttentionMetadata(
            positions=(lens - 1).to(DEV),
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEV),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
            seq_lens=lens.to(torch.int32).to(DEV),
            block_tables=tables.to(DEV),
            num_decode_seqs=batch,
            max_query_len=1,
            max_seq_len=max_seq,
        )
        q = torch.randn(batch, nq, hd, device=DEV).to(BF16)
        ao = torch.empty(batch, nq * hd, device=DEV, dtype=BF16)
        cluster = be.cluster_decode_ok(batch, nkv)  # small batch: the cluster kernel
        caches = {
            "bf16": (kc16, vc16, (1.0, 1.0)),
            "fp8": (kc16.to(E4M3), vc16.to(E4M3), (0.05,) * 2),
        }
        for cache, (kc, vc, scales) in caches.items():
            kv_bytes = int(lens.sum()) * nkv * hd * 2 * kc.element_size() + 2 * q.nbytes
            for plan in (None, *DECODE_SHORT_PLANS[cache]):
                if plan is not None and cluster:
                    continue  # split plans are for paged_attention_kernel only
                be.force_splits, be.force_min_keys = plan if plan else (None, None)
                ms = graph_ms(
                    lambda q=q, kc=kc, vc=vc, m=meta, s=scales, o=ao: be.attention(
                        q, kc, vc, m, *s, out=o
                    )
                )
                if plan is None and cluster:
                    label = f"auto: cluster kernel, min_keys={be.min_split_keys(batch, nkv)}"
                elif plan is None:
                    ns, mk = be.num_splits(batch, nkv, max_seq), be.min_split_keys(batch, nkv)
                    label = f"auto: splits<={ns}, min_keys={mk}"
                else:
                    label = f"splits<={plan[0]}, min_keys={plan[1] or '-'}"
                shape = f"{batch}x[{lo},{hi}] {nq}/{nkv}x{hd} {cache} KV"
                mem_row(f"decode_short({label})", shape, kv_bytes, ms, None)
                rows[-1]["us"] = ms * 1000
    be.force_splits = be.force_min_keys = None
    be.max_num_seqs = max_num_seqs


def _cycle(fns: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable running fns[0], fns[1], ... in turn (a graph of len(fns) calls reads
    every weight copy once, so the weights come from HBM, not L2)."""
    state = {"i": 0}

    def call() -> Any:
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()

    return call


def fused_gemv(be: Any, rows: list, mem_row: Callable) -> None:
    """Fused small-step GEMVs (cuda/gemv.cu) at the Llama-3-8B shapes, M = 1, 2, 4, 8 token
    rows, beside the unfused sequences they replace (cuBLAS mm + our norm / SiLU kernels):

    - qkv:     norm_linear          vs mm (its norm is the add_rms_norm of the rows below)
    - o_proj:  linear_residual_add  vs mm + add_rms_norm
    - gate_up: norm_gate_up_silu    vs mm + silu_and_mul
    - down:    linear_residual_add  vs mm + add_rms_norm
    - layer:   sums of the four rows (one decoder layer without attention)

    CUDA-graph replays over enough weight copies (>= 256 MB) that L2 serves none of them;
    GB/s counts weight bytes only (activations are < 0.3 MB)."""
    h, nqkv, inter = 4096, 6144, 14336
    g = torch.Generator(device=DEV).manual_seed(3)

    def weights(r: int, k: int) -> list[torch.Tensor]:
        n = max(2, math.ceil((256 << 20) / (r * k * 2)))
        return [(torch.randn(r, k, device=DEV, generator=g) / k**0.5).to(BF16) for _ in range(n)]

    ws = {
        "qkv": weights(nqkv, h),
        "o_proj": weights(h, h),
        "gate_up": weights(2 * inter, h),
        "down": weights(h, inter),
    }
    norm_w = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).to(BF16)
    for m in (1, 2, 4, 8):
        totals = {"fused": [0.0, 0], "unfused": [0.0, 0]}
        for op, (fused, unfused) in _gemv_ops(be, m, h, inter, norm_w, g).items():
            for label, fn in (("fused", fused), ("unfused", unfused)):
                copies = ws[op]
                ms = graph_ms(_cycle([lambda w=w, fn=fn: fn(w) for w in copies]), len(copies))
                nbytes = copies[0].nbytes
                shape = f"{copies[0].shape[1]}->{copies[0].shape[0]} bf16"
                kind = "fused" if label == "fused" else "unfused (cuBLAS)"
                mem_row(f"gemv M={m} {op} {kind}", shape, nbytes, ms, 0.9 if fused is fn else None)
                rows[-1]["us"] = ms * 1000
                totals[label][0] += ms
                totals[label][1] += nbytes
        for label, (ms, nbytes) in totals.items():
            mem_row(f"gemv M={m} layer ({label}, sum of rows)", "4 GEMVs bf16", nbytes, ms, None)
            rows[-1]["us"] = ms * 1000


def _gemv_ops(
    be: Any, m: int, h: int, inter: int, norm_w: torch.Tensor, g: torch.Generator
) -> dict[str, tuple[Callable, Callable]]:
    """op -> (fused(weight), unfused(weight)) on static M-row inputs (see fused_gemv)."""
    eps = 1e-5
    res = torch.randn(m, h, device=DEV, generator=g).to(BF16)
    x_o = torch.randn(m, h, device=DEV, generator=g).to(BF16)
    x_d = torch.randn(m, inter, device=DEV, generator=g).to(BF16)
    normed, proj = torch.empty_like(res), torch.empty_like(res)
    qkv = torch.empty(m, 6144, device=DEV, dtype=BF16)
    gu = torch.empty(m, 2 * inter, device=DEV, dtype=BF16)
    act = torch.empty(m, inter, device=DEV, dtype=BF16)

    def mm_add_norm(x: torch.Tensor, w: torch.Tensor) -> None:
        torch.mm(x, w.t(), out=proj)
        be.add_rms_norm(proj, res, norm_w, eps, normed)

    def mm_silu(w: torch.Tensor) -> None:
        torch.mm(normed, w.t(), out=gu)
        be.silu_and_mul(gu, act)

    return {
        "qkv": (
            lambda w: be.norm_linear(res, norm_w, eps, w, out=qkv),
            lambda w: torch.mm(normed, w.t(), out=qkv),
        ),
        "o_proj": (lambda w: be.linear_residual_add(x_o, w, res), lambda w: mm_add_norm(x_o, w)),
        "gate_up": (lambda w: be.norm_gate_up_silu(res, norm_w, eps, w, out=act), mm_silu),
        "down": (lambda w: be.linear_residual_add(x_d, w, res), lambda w: mm_add_norm(x_d, w)),
    }


def _commit() -> str:
    """LLMC_COMMIT when set (the device tool's copy of the tree keeps a stale .git, as
    scripts/bench_h200.sh says), else the checkout's HEAD."""
    if os.environ.get("LLMC_COMMIT"):
        return os.environ["LLMC_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def render(res: dict[str, Any]) -> str:
    c = res["ceilings"]
    lines = [
        f"device {res['device']}  commit {res['commit']}  "
        f"copy {c['copy_GBps']:.0f} GB/s  bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s",
        f"{'kernel':52s} {'shape':28s} {'ms':>8s} {'achieved':>14s} {'of ceil':>8s} "
        f"{'target':>7s} ok",
    ]
    for r in res["kernels"]:
        tgt = r["target"]
        ok = "" if tgt is None else ("yes" if r["fraction"] >= tgt else "NO")
        lines.append(
            f"{r['kernel']:52s} {r['shape']:28s} {r['ms']:8.3f} "
            f"{r['achieved']:9.1f} {r['unit']:>4s} {100 * r['fraction']:7.1f}% "
            f"{'' if tgt is None else f'{100 * tgt:.0f}%':>7s} {ok}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(os.environ["OUT"]) / "kernel_bench.json" if os.environ.get("OUT") else None
    ap.add_argument("--json", type=Path, default=default, help="write results here")
    ap.add_argument(
        "--only",
        choices=("gemv8", "sampling", "gemvwo", "gemmwo", "decode"),
        default=None,
        help="gemv8: only the FP8 GEMV rows; sampling: only the sampling rows; gemvwo: only "
        "the weight-only rows; gemmwo: only the weight-only large-step (GEMM plan) rows; "
        "decode: only the decode attention rows (64 x 4096 and the end-to-end shapes)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("llmc.cuda.bench: no CUDA device; nothing to measure")
        return 0
    res = run(args)
    print(render(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
