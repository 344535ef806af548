"""Where sample_cluster_kernel's top-p time goes at a large batch: variants of sampling.cu,
each compiled with NVRTC and timed on the same logits (H200 only; no counters needed).

Variants are text edits of the kernel source (``llmc.cuda.kernels.source``):

- ``base``: the kernel as it is;
- ``u32mass``: ``mass_of`` through a 32-bit conversion (e < 1) instead of a 64-bit one;
- ``hialways``: ``mass_add`` adds the high word even when it adds 0 (as measured for v4/v5);
- ``nohist``: no histogram at all (the scan of values, keys and masses alone) — timing only;
- ``rounds1`` / ``rounds2``: the top-p select stops after 1 / 2 of its 4 radix rounds
  (wrong tokens: timing only, to split the time by round).

Exact variants must give the tokens of ``base`` (checked); the others are timing only.
Prints ms per launch (CUDA events over ``--iters`` launches cycling 4 logits copies).

    python3 scripts/sampling_variants.py --rows 512 64
"""

from __future__ import annotations

import argparse
import functools

import cupy as cp
import numpy as np

from llmc.cuda.kernels import KernelConfig, source

V = 128256
CLUSTER = 8
MASS_BASE = "    return (unsigned long long)(expf(__fsub_rn(l, M)) * 4294967296.0f);"
MASS_U32 = (
    "    const float e = expf(__fsub_rn(l, M));\n"
    "    return e < 1.f ? (unsigned long long)__float2uint_rz(e * 4294967296.0f)"
    " : 4294967296ull;"
)
HI_NOW = "    if (hi) atomicAdd(w + 1, hi);"
HI_ALWAYS = "    atomicAdd(w + 1, hi);"
ROUND_TAIL = "; shift -= 8) {\n        unsigned cnt;\n        unsigned long long mass;"
ROUND_LOOP = "    for (int shift = 24; shift >= 0" + ROUND_TAIL  # select_top_p's rounds
HIST_CALL = (
    "if (__any_sync(0xffffffffu, d != RADIX_NONE)) hist_add<MASS>(h.cnt[b], h.mass[b], d, q);"
)
EXACT = {"base", "u32mass", "hialways"}


def _edit(src: str, old: str, new: str) -> str:
    assert old in src, f"sampling.cu no longer holds {old!r}"
    return src.replace(old, new)


def variant(name: str) -> str:
    """The source of one variant (``a+b``: both edits)."""
    src = source("sampling", KernelConfig("float32", 128, 32, 8))
    for p in name.split("+"):
        if p == "u32mass":
            src = _edit(src, MASS_BASE, MASS_U32)
        elif p == "hialways":
            src = _edit(src, HI_NOW, HI_ALWAYS)
        elif p == "nohist":  # the scan alone (values, keys, masses), no histogram at all
            src = _edit(src, HIST_CALL, "if (q == 12345ull) h.cnt[b][0] = d;")
        elif p in ("rounds1", "rounds2"):
            stop = {"rounds1": 24, "rounds2": 16}[p]
            src = _edit(src, ROUND_LOOP, f"    for (int shift = 24; shift >= {stop}" + ROUND_TAIL)
        elif p != "base":
            raise SystemExit(f"unknown variant {p}")
    return src


def _row_params(rows: int) -> list:
    """temperature, top_k, top_p, min_p, seeds, offsets, repetition / presence / frequency
    penalties of ``rows`` rows at temperature 0.7, top_p 0.9 (the 8B sampled bench row)."""
    f32 = functools.partial(cp.full, rows, dtype=cp.float32)
    return [
        f32(0.7), cp.zeros(rows, dtype=cp.int32), f32(0.9), f32(0.0),
        cp.arange(rows, dtype=cp.int64), cp.zeros(rows, dtype=cp.int64),
        f32(1.0), f32(0.0), f32(0.0),
    ]  # fmt: skip


def _launch(k, rows: int, smem: int, params: list, out, x) -> None:
    args = (x, np.int32(V), *params, x, x, np.int32(0), np.int32(0), out)
    k((CLUSTER, rows), (256,), args, shared_mem=smem)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 64])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["base", "hialways", "nohist", "rounds1", "rounds2"],
    )
    args = ap.parse_args()
    slice_ = (-(-V // CLUSTER) + 3) // 4 * 4
    smem = 4 * slice_
    for rows in args.rows:
        rng = cp.random.default_rng(0)
        logits = [rng.standard_normal((rows, V), dtype=cp.float32) * 3 for _ in range(4)]
        common = _row_params(rows)
        want = None
        for name in args.variants:
            mod = cp.RawModule(code=variant(name), options=("-std=c++17",))
            k = mod.get_function("sample_cluster_kernel")
            k.max_dynamic_shared_size_bytes = smem
            out = cp.zeros(rows, dtype=cp.int64)

            launch = functools.partial(_launch, k, rows, smem, common, out)

            launch(logits[0])
            cp.cuda.Device().synchronize()
            toks = out.get()
            for i in range(4):
                launch(logits[i])
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for i in range(args.iters):
                launch(logits[i % 4])
            end.record()
            end.synchronize()
            ms = cp.cuda.get_elapsed_time(start, end) / args.iters
            if name == "base":
                want = toks
            same = (
                ""
                if name not in EXACT or want is None
                else (" tokens == base" if np.array_equal(toks, want) else " TOKENS DIFFER")
            )
            print(f"rows {rows:4d} {name:>16}: {ms:7.3f} ms{same}", flush=True)


if __name__ == "__main__":
    main()
