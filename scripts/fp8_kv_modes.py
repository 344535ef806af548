"""Decode attention on an e4m3 KV cache under each ``LLMC_FP8_KV_MODE`` of
cuda/decode_mma.cuh (how the codes become fp16 mma operands: 0 = cvt for K and V, 1 = K by
integer ops, 2 = V by integer ops, 3 = both, 4 = no conversion, timing only), beside the
bf16 cache: 64 x 4,096 (GQA 32/8 x 128, issue 12's 85 % row) and the end-to-end batch
shapes (8B 256 x 4,096 and 512 x [128, 256]). Each mode's output is compared with mode 0's
bit for bit (modes 1-3 must be equal). CUDA-graph replays; GB/s against the copy rate
measured in the same run. GPU only; run from outside the checkout:

    python3 $REPO/scripts/fp8_kv_modes.py out.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import llmc.cuda.kernels as kernels
from llmc.cuda.bench import ceilings, graph_ms
from llmc.cuda.bench_fp8 import decode_meta
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
MODES = (0, 1, 2, 3, 4)
SHAPES = ((64, 4096), (256, 1024), (512, 256))  # (batch, context)
SOURCE = kernels.source


def backend(mode: int) -> CudaBackend:
    """A backend whose decode_attention family is compiled with LLMC_FP8_KV_MODE = mode."""
    def source(family: str, cfg: Any = None) -> str:
        text = SOURCE(family, cfg)
        return f"#define LLMC_FP8_KV_MODE {mode}\n" + text if family == "decode_attention" else text

    kernels.source = source  # KernelLibrary compiles lazily: keep the patch for its life
    return CudaBackend(DEV, max_num_seqs=512)


def main(path: str) -> None:
    bw = ceilings()["copy_GBps"]
    nq, nkv, hd, bs = 32, 8, 128, 32
    rows: list[dict[str, Any]] = []
    base: dict[tuple[int, int], torch.Tensor] = {}
    g = torch.Generator(device=DEV).manual_seed(3)
    data = {}
    for batch, ctx in SHAPES:
        meta = decode_meta(batch, ctx, bs)
        q = torch.randn(batch, nq, hd, device=DEV, generator=g).to(BF16)
        kc = torch.randn(batch * (ctx // bs), bs, nkv, hd, device=DEV, generator=g)
        vc = torch.randn(kc.shape, device=DEV, generator=g)
        data[batch, ctx] = (meta, q, kc.to(BF16), vc.to(BF16), (kc * 20).to(E4M3),
                            (vc * 20).to(E4M3))  # fmt: skip
    for mode in MODES:
        be = backend(mode)
        for (batch, ctx), (meta, q, kb, vb, k8, v8) in data.items():
            caches = [("fp8", k8, v8, (0.05, 0.05))]
            if mode == 0:
                caches.insert(0, ("bf16", kb, vb, (1.0, 1.0)))
            for label, kc, vc, sc in caches:
                out = torch.empty(batch, nq * hd, device=DEV, dtype=BF16)

                def fn(q=q, kc=kc, vc=vc, meta=meta, sc=sc, out=out) -> None:
                    be.attention(q, kc, vc, meta, *sc, out)

                fn()
                torch.cuda.synchronize()
                ms = graph_ms(fn, 5)
                nbytes = kc.nbytes + vc.nbytes + 2 * q.nbytes
                eq = None
                if label == "fp8":
                    ref = base.setdefault((batch, ctx), out.clone())
                    eq = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                rows.append(dict(mode=mode, cache=label, shape=f"{batch}x{ctx}",
                                 us=round(ms * 1e3, 2),
                                 of_copy=round(nbytes / ms / 1e6 / bw, 3),
                                 equal_to_mode0=eq))  # fmt: skip
                print(rows[-1], flush=True)
    with open(path, "w") as f:
        json.dump({"copy_GBps": bw, "device": torch.cuda.get_device_name(), "rows": rows}, f,
                  indent=1)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
