"""What programmatic dependent launch (cuda/pdl.cuh) saves a batch-1 decode step's GEMVs:
the four fused GEMVs of a Llama-3-8B layer (qkv norm_linear, o_proj add, gate_up
norm_silu, down add; each reads what the one before wrote) chained over ``LAYERS`` layers
of distinct weights (more bytes than L2 holds), for bf16, fp8 (W8A8), int4_wo g128 and
int8_wo weights, captured in one CUDA graph with ``CudaBackend.pdl`` off and on, the two
replayed alternately ``PAIRS`` times. Between qkv and o_proj a torch copy stands where
rope + attention run (a kernel that does not trigger: the chain gains the launch there).
Microseconds per layer, the weight bytes' rate against a 1 GiB copy of the same run, and the
outputs' equality (PDL on = off, bit for bit), as JSON. GPU only; from outside the checkout:

    python3 $REPO/scripts/pdl_chain.py out.json [M] [WO_MAX]

WO_MAX (default 8): ``WoOps.pdl_wo_max_tokens`` for the run, so the weight-only rows compare
PDL off and on at any M (the engine's default is 1).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.bench import ceilings, time_ms
from llmc.cuda.bench_wo import LAYOUTS, random_packed
from llmc.cuda.cuda_backend import CudaBackend

DEV = torch.device("cuda")
H, INTER, QKV = 4096, 14336, 6144
LAYERS, PAIRS = 8, 3
KINDS = ("bf16", "fp8", "int4", "int8")
SHAPES = {"qkv": (QKV, H), "o": (H, H), "gu": (2 * INTER, H), "down": (H, INTER)}


def layer_weights(kind: str, seed: int) -> tuple[dict[str, Any], int]:
    """One layer's weights of ``kind`` and their bytes."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    out: dict[str, Any] = {}
    nbytes = 0
    for name, (rows, k) in SHAPES.items():
        w = torch.randn(rows, k, device=DEV, generator=g) / k**0.5
        if kind == "bf16":
            out[name] = w.to(torch.bfloat16)
            nbytes += out[name].numel() * 2
        elif kind == "fp8":
            out[name] = ref8.quantize_weight_fp8(w)
            nbytes += sum(t.numel() * t.element_size() for t in out[name])
        else:  # int4 (g128) / int8 (per channel) weight-only
            layout = LAYOUTS["int4_g128" if kind == "int4" else "int8"]
            out[name] = p = random_packed(rows, k, layout, g)
            nbytes += sum(t.numel() * t.element_size() for t in (p.codes, p.scales, p.offsets)
                          if t is not None)  # fmt: skip
    return out, nbytes


def chain(be: CudaBackend, kind: str, layers: list, x: torch.Tensor, nw: torch.Tensor,
          qkv: torch.Tensor, attn: torch.Tensor, act: torch.Tensor) -> None:  # fmt: skip
    for w in layers:
        if kind == "fp8":
            be.norm_linear_fp8(x, nw, 1e-5, *w["qkv"], None, out=qkv)
            attn.copy_(qkv[:, :H])
            be.linear_residual_add_fp8(attn, *w["o"], x)
            be.norm_gate_up_silu_fp8(x, nw, 1e-5, *w["gu"], act)
            be.linear_residual_add_fp8(act, *w["down"], x)
        else:
            be.norm_linear(x, nw, 1e-5, w["qkv"], None, out=qkv)
            attn.copy_(qkv[:, :H])
            be.linear_residual_add(attn, w["o"], x)
            be.norm_gate_up_silu(x, nw, 1e-5, w["gu"], out=act)
            be.linear_residual_add(act, w["down"], x)


def run_kind(be: CudaBackend, kind: str, m: int, bw: float) -> dict[str, Any]:
    layers, nbytes = [], 0
    for i in range(LAYERS):
        w, b = layer_weights(kind, i)
        layers.append(w)
        nbytes += b
    g = torch.Generator(device=DEV).manual_seed(1)
    x0 = torch.randn(m, H, device=DEV, generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, device=DEV, generator=g)).to(torch.bfloat16)
    bufs = [torch.empty(m, n, dtype=torch.bfloat16, device=DEV) for n in (QKV, H, INTER)]
    graphs, xs = {}, {}
    for pdl in (False, True):
        be.pdl = pdl
        x = xs[pdl] = x0.clone()
        chain(be, kind, layers, x.clone(), nw, *bufs)  # kernels loaded before the capture
        torch.cuda.synchronize()
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            chain(be, kind, layers, x, nw, *bufs)
    be.pdl = True
    res: dict[str, Any] = {"kind": kind, "m": m, "layers": LAYERS, "weight_MB": nbytes / 1e6}
    outs = {}
    for pdl in (False, True):
        xs[pdl].copy_(x0)
        graphs[pdl].replay()
        torch.cuda.synchronize()
        outs[pdl] = xs[pdl].clone()
    res["equal"] = bool(torch.equal(outs[False], outs[True]))
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(PAIRS):
        for pdl in (False, True):
            times[pdl].append(time_ms(graphs[pdl].replay) * 1000 / LAYERS)
    for pdl, name in ((False, "off"), (True, "on")):
        us = sorted(times[pdl])[len(times[pdl]) // 2]
        res[f"us_per_layer_{name}"] = round(us, 2)
        res[f"copy_frac_{name}"] = round(nbytes / LAYERS / (us * 1e-6) / 1e9 / bw, 3)  # GB/s
        res[f"all_us_{name}"] = [round(t, 2) for t in times[pdl]]
    print(res, flush=True)
    del graphs, layers
    torch.cuda.empty_cache()
    return res


def main(path: str, m: int, wo_max: int) -> None:
    be = CudaBackend(DEV, max_num_seqs=256)
    be.pdl_wo_max_tokens = wo_max  # the weight-only GEMVs' PDL limit (WoOps; default 1)
    bw = ceilings()["copy_GBps"]
    rows = [run_kind(be, kind, m, bw) for kind in KINDS]
    with open(path, "w") as f:
        json.dump({"copy_GBps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "pdl_chain.json",
        int(sys.argv[2]) if len(sys.argv) > 2 else 1,
        int(sys.argv[3]) if len(sys.argv) > 3 else 8,
    )
