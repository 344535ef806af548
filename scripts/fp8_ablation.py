"""Where an fp8 engine's perplexity loss comes from: one bfloat16 engine, run on the torch
reference backend with FP8 applied to chosen parts only (a backend wrapper that quantizes
what the fp8 engine would, with ``llmc.cuda.reference_fp8``'s recipes), scored like
``llmc eval`` over a text.

A variant is ``NAME=SPEC``, SPEC a space-separated list of

- ``w:FAMILIES`` fp8 weights (per output channel) of the families ``qkv,o,gate_up,down``;
- ``a:FAMILIES`` per-token dynamic fp8 activations into those families (W8A8 = both);
- ``layers:A-B`` fp8 weights / activations only in layers A..B (default all);
- ``kvlayers:A-B`` the e4m3 KV cache only in layers A..B (default all);
- ``kv:k`` / ``kv:v`` / ``kv:kv`` an e4m3 KV cache for K, V or both (the values written are
  e4m3-rounded; the bf16 cache then holds them, exactly for scale 1.0);
- ``smooth:ALPHA`` SmoothQuant on the ``a:`` families: per input channel ``s = amax_x^ALPHA /
  amax_w^(1-ALPHA)`` (amax_x over ``--calib_file``), x / s and w * s quantized (float math;
  w is the bf16 engine's, also with ``--fp8_engine``);
- ``kvscale:one|layer|head`` the KV scales: 1.0, per layer or per KV head from max |k| / |v|
  over ``--calib_file`` (k after RoPE);
- ``ksmooth`` smooth K (SageAttention): subtract a per-layer, per-KV-head, per-channel mean m
  of post-RoPE k over ``--calib_file`` before quantizing and store k - m (softmax is invariant
  to the same q.m for every key of a query); the K scales then come from max |k - m|.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/fp8_ablation.py --engine_dir E \
        --variant "bf16=" --variant "W8A8 qkv=w:qkv a:qkv" --variant "KV=kv:kv"

``E`` is a bfloat16 engine of the model (``llmc build ... --dtype bfloat16``); the default
variant ``full`` (fp8 weights + fp8 KV) is what ``--quantization fp8 --kv_cache_dtype fp8``
runs. Prints one line per variant (perplexity and vs the first variant) and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qkv", "o", "gate_up", "down")
ENGINE_NAMES = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class Variant:
    name: str
    w: frozenset[str] = frozenset()
    a: frozenset[str] = frozenset()
    layers: tuple[int, int] | None = None
    kvlayers: tuple[int, int] | None = None
    kv: str = ""
    kvscale: str = "one"
    smooth: float | None = None
    ksmooth: bool = False


def parse_variant(text: str) -> Variant:
    name, _, spec = text.partition("=")
    got: dict[str, Any] = {}
    for part in spec.split():
        key, _, value = part.partition(":")
        if key in ("w", "a"):
            fams = frozenset(FAMILIES if value == "all" else value.split(","))
            if not fams <= set(FAMILIES):
                raise SystemExit(f"variant {name!r}: unknown family in {part!r}")
            got[key] = fams
        elif key in ("layers", "kvlayers"):
            lo, _, hi = value.partition("-")
            got[key] = (int(lo), int(hi or lo))
        elif key == "kv" and value in ("k", "v", "kv"):
            got["kv"] = value
        elif key == "smooth":
            got["smooth"] = float(value)
        elif key == "ksmooth" and not value:
            got["ksmooth"] = True
        elif key == "kvscale" and value in ("one", "layer", "head"):
            got["kvscale"] = value
        else:
            raise SystemExit(f"variant {name!r}: cannot read {part!r}")
    return Variant(name=name.strip(), **got)


class Fp8Probe:
    """A backend that is ``inner`` but applies ``variant``'s FP8 quantization."""

    def __init__(
        self,
        inner: Any,
        runner: Any,
        variant: Variant,
        kv_amax: Any,
        codes: Any = None,
        x_amax: Any = None,
        k_mean: Any = None,
    ) -> None:
        from llmc.cuda.reference_fp8 import quantize_weight_fp8

        self._inner, self.v = inner, variant
        self.k_mean = k_mean  # (mean [layers, nkv, hd], amax of k - mean [layers, nkv]) or None
        spec = runner.spec
        self.nq, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        lo, hi = variant.layers or (0, spec.num_layers - 1)
        self.kv_lo, self.kv_hi = variant.kvlayers or (0, spec.num_layers - 1)
        self.weight_of: dict[int, tuple[str, torch.Tensor | None]] = {}
        self.smooth: dict[int, torch.Tensor] = {}
        for i in range(spec.num_layers):
            for fam in FAMILIES:
                w = runner.weights[f"layers.{i}.{ENGINE_NAMES[fam]}"]
                deq = None
                on = fam in variant.a and lo <= i <= hi
                if on and variant.smooth is not None:
                    a = variant.smooth
                    sm = x_amax[w.data_ptr()].clamp(min=1e-5) ** a
                    sm = (sm / w.float().abs().amax(0).clamp(min=1e-5) ** (1 - a)).clamp(min=1e-5)
                    self.smooth[w.data_ptr()] = sm
                    ws = w.float() * sm[None, :]
                    q, s = (
                        quantize_weight_fp8(ws) if fam in variant.w else (ws, torch.ones(len(ws)))
                    )
                    deq = q.float() * s[:, None]
                elif fam in variant.w and lo <= i <= hi:
                    name = f"layers.{i}.{ENGINE_NAMES[fam]}"
                    q, s = (
                        (codes[name], codes[name + "_scale"])
                        if codes
                        else quantize_weight_fp8(w.float())
                    )
                    deq = q.float() * s[:, None]
                self.weight_of[w.data_ptr()] = (fam if on else "", deq)
        self.layer_of = {runner.kv_cache.layer(i)[0].data_ptr(): i for i in range(spec.num_layers)}
        self.kv_amax = kv_amax  # [layers, 2, nkv] or None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def linear(self, x: torch.Tensor, w: Any, bias: Any = None, *, out: torch.Tensor) -> Any:
        from llmc.cuda.reference_fp8 import quantize_fp8

        act, deq = self.weight_of.get(w.data_ptr(), ("", None))
        if not act and deq is None:
            return self._inner.linear(x, w, bias, out=out)
        sm = self.smooth.get(w.data_ptr())
        xs = x.float() / sm if sm is not None else x
        xf = quantize_fp8(xs).dequantize() if act else xs.float()
        y = xf @ (w.float() if deq is None else deq).t()
        if bias is not None:
            y = y + bias.float()
        return out.copy_(y.to(out.dtype))

    def _scales(self, i: int, which: int) -> torch.Tensor:  # [nkv] float32
        if self.v.kvscale == "one" or self.kv_amax is None:
            return torch.ones(self.nkv)
        amax = self.kv_amax[i, which]
        if which == 0 and self.v.ksmooth:
            amax = self.k_mean[1][i]
        amax = amax.clamp(min=1e-6) / 448.0
        return amax if self.v.kvscale == "head" else amax.max().expand(self.nkv)

    def rope_and_cache_write(self, qkv: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from llmc.cuda import reference as ref
        from llmc.cuda.reference_fp8 import saturate_to_fp8

        q = self._inner.rope_and_cache_write(qkv, *args, **kwargs)
        positions, cos, sin, k_cache, v_cache, slot_mapping = args[:6]
        i = self.layer_of[k_cache.data_ptr()]
        if not self.v.kv or not self.kv_lo <= i <= self.kv_hi:
            return q
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        nq, nkv, hd = self.nq, self.nkv, self.hd
        t = qkv.shape[0]
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        k = ref.apply_rope(qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd), c, s)
        v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd).float()
        for which, (x, cache) in enumerate(((k, k_cache), (v, v_cache))):
            if "kv"[which] not in self.v.kv:
                continue
            if which == 0 and self.v.ksmooth:
                x = x - self.k_mean[0][i]
            sc = self._scales(i, which)[None, :, None]
            deq = saturate_to_fp8(x[keep] * (1.0 / sc)).float() * sc
            cache.view(-1, nkv, hd)[slots] = deq.to(cache.dtype)
        return q


class XAmax:
    """Records max |x| per input channel of every projection's input (by weight)."""

    def __init__(self, inner: Any, runner: Any) -> None:
        self._inner, self.amax = inner, {}
        for i in range(runner.spec.num_layers):
            for fam in FAMILIES:
                w = runner.weights[f"layers.{i}.{ENGINE_NAMES[fam]}"]
                self.amax[w.data_ptr()] = torch.zeros(w.shape[1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def linear(self, x: torch.Tensor, w: Any, *args: Any, **kwargs: Any) -> Any:
        m = self.amax.get(w.data_ptr())
        if m is not None and x.shape[0]:
            torch.maximum(m, x.float().abs().amax(0), out=m)
        return self._inner.linear(x, w, *args, **kwargs)


class KVAmax:
    """Records max |k| (after RoPE) and max |v| per layer and KV head."""

    def __init__(self, inner: Any, runner: Any, k_mean: Any = None) -> None:
        spec = runner.spec
        self._inner, self.k_mean = inner, k_mean  # k_mean [layers, nkv, hd]: max |k - mean|
        self.k_sum = torch.zeros(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.k_rows = torch.zeros(spec.num_layers)
        self.nq, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.layer_of = {runner.kv_cache.layer(i)[0].data_ptr(): i for i in range(spec.num_layers)}
        self.amax = torch.zeros(spec.num_layers, 2, spec.num_kv_heads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def rope_and_cache_write(self, qkv: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from llmc.cuda import reference as ref

        positions, cos, sin, k_cache, _v, slot_mapping = args[:6]
        i = self.layer_of[k_cache.data_ptr()]
        nq, nkv, hd, t = self.nq, self.nkv, self.hd, qkv.shape[0]
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        k = ref.apply_rope(qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd), c, s)
        v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd).float()
        keep = slot_mapping >= 0
        self.k_sum[i] += k[keep].sum(0)
        self.k_rows[i] += int(keep.sum())
        if self.k_mean is not None:
            k = k - self.k_mean[i]
        for which, x in enumerate((k[keep], v[keep])):
            if x.shape[0]:
                self.amax[i, which] = torch.maximum(self.amax[i, which], x.abs().amax((0, 2)))
        return self._inner.rope_and_cache_write(qkv, *args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine_dir", required=True, help="a bfloat16 engine of the model")
    p.add_argument("--text_file", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--calib_file", default="/usr/share/common-licenses/Apache-2.0")
    p.add_argument("--variant", action="append", default=[], help="NAME=SPEC (see above)")
    p.add_argument(
        "--fp8_engine",
        default=None,
        help="an fp8-weight engine of the same model: w: takes its codes and scales (default: "
        "quantize the bfloat16 engine's weights)",
    )
    p.add_argument("--max_windows", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from llmc.api import LLM
    from llmc.runtime.bench.perplexity import EvalSettings, evaluate
    from llmc.runtime.engine_runtime import RuntimeConfig

    variants = [parse_variant(t) for t in args.variant or ["full=w:all a:all kv:kv"]]
    config = RuntimeConfig(device="cpu", backend="torch", enable_block_reuse=False)
    settings = EvalSettings(text_file=args.text_file, max_windows=args.max_windows)
    results: dict[str, float] = {}
    codes = None
    if args.fp8_engine:
        from safetensors.torch import load_file

        codes = load_file(str(Path(args.fp8_engine) / "weights.safetensors"))
    with LLM(engine_dir=args.engine_dir, runtime_config=config) as llm:
        runner = llm.runtime.runner
        base = runner.layers.backend
        kv_amax = None
        if any(v.kvscale != "one" and not v.ksmooth for v in variants):
            obs = KVAmax(base, runner)
            runner.layers.backend = obs
            calib = EvalSettings(text_file=args.calib_file, max_windows=2)
            evaluate(llm, calib)
            kv_amax = obs.amax
        k_mean = None
        if any(v.ksmooth for v in variants):
            obs = KVAmax(base, runner)
            runner.layers.backend = obs
            evaluate(llm, EvalSettings(text_file=args.calib_file, max_windows=2))
            mean, raw = obs.k_sum / obs.k_rows[:, None, None], obs.amax[:, 0]
            obs = KVAmax(base, runner, mean)
            runner.layers.backend = obs
            evaluate(llm, EvalSettings(text_file=args.calib_file, max_windows=2))
            k_mean = (mean, obs.amax[:, 0])
            if kv_amax is None:
                kv_amax = obs.amax  # v's are unchanged by the mean
            spread = (raw / k_mean[1]).mean()
            print(f"ksmooth: max |k| / max |k - mean| = {spread:.2f} (mean over layers, heads)")
        x_amax = None
        if any(v.smooth is not None for v in variants):
            xo = XAmax(base, runner)
            runner.layers.backend = xo
            evaluate(llm, EvalSettings(text_file=args.calib_file, max_windows=2))
            x_amax = xo.amax
        for v in variants:
            runner.layers.backend = Fp8Probe(base, runner, v, kv_amax, codes, x_amax, k_mean)
            try:
                ppl = evaluate(llm, settings).perplexity
            finally:
                runner.layers.backend = base
            results[v.name] = ppl
            first = next(iter(results.values()))
            print(f"{v.name:<28} {ppl:.4f}  {ppl / first - 1:+.2%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
