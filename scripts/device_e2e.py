"""Summary of ``scripts/bench_h200.sh``: one table from the ``llmc bench`` / ``llmc profile``
JSON results, each number beside its roofline and the peer from the same run, and the GPU
idle share between kernels from the decode-heavy ``llmc profile`` result.

Usage: python scripts/device_e2e.py RESULTS_DIR
Prints the table (Markdown) on stdout and writes RESULTS_DIR/summary.json.

Rooflines (per row, from the result's own engine and ceilings):
- compute: matmul_tflops / FLOPs per output token, where FLOPs per output token =
  2 * matmul parameters (layers + lm_head) * (isl + osl) / osl (prefill and decode
  counted, attention left out);
- decode bandwidth (batch 1): copy_bandwidth / weight_bytes tokens/s (every weight read
  once per step), and its time per output token.
Sampled vs greedy: the temperature 0.7 / top_p 0.9 row's output tok/s over the greedy
128/128 row's (issue 17: >= 95 %).
GPU idle: ``profile.gpu_idle`` of profile_decode.json (first to last GPU event, the share of
time covered by no kernel or copy; also over the decode-only steps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROWS = (
    ("llama8b_128_128", "Llama-3-8B 128/128 offline"),
    ("llama8b_128_128_sampled", "Llama-3-8B 128/128 offline, temperature 0.7 top_p 0.9"),
    ("llama8b_128_128_beam4", "Llama-3-8B 128/128 offline, beam_width 4 (best beam's tokens)"),
    ("llama8b_128_128_peer", "Llama-3-8B 128/128 offline (peer subset)"),
    ("llama8b_b1_128_512", "Llama-3-8B batch 1, 128/512"),
    ("llama8b_2048_128", "Llama-3-8B 2048/128 offline"),
    ("llama8b_128_2048", "Llama-3-8B 128/2048 offline"),
    ("smollm2_128_128_peer", "SmolLM2-135M shape 128/128 offline"),
    ("smollm2_b1_128_512", "SmolLM2-135M shape batch 1, 128/512"),
    ("smollm2_128_128_pw", "SmolLM2-135M shape 128/128 offline, piecewise graphs"),
    ("llama8b_2048_128_pw", "Llama-3-8B 2048/128 offline, piecewise graphs"),
    ("llama8b_128_128_pw", "Llama-3-8B 128/128 offline, piecewise graphs"),
    ("smollm2_128_128_nopw", "SmolLM2-135M shape 128/128, --piecewise_graph_max_tokens 0"),
    ("llama8b_128_128_nopw", "Llama-3-8B 128/128, --piecewise_graph_max_tokens 0"),
    ("llama8b_2048_128_nopw", "Llama-3-8B 2048/128, --piecewise_graph_max_tokens 0"),
    ("llama8b_b1_noprefillgraphs", "Llama-3-8B batch 1, --prefill_graph_max_tokens 0"),
    ("llama8b_128_128_nographs", "Llama-3-8B 128/128, --no_cuda_graphs"),
    ("llama8b_b1_nographs", "Llama-3-8B batch 1, --no_cuda_graphs"),
    ("llama8b_b1_sync", "Llama-3-8B batch 1, --no_async_scheduling"),
    ("llama8b_b1_mb256", "Llama-3-8B batch 1, --max_batch_size 256"),
    ("llama8b_128_128_mb1024", "Llama-3-8B 128/128 offline, max_batch_size 1024"),
    ("llama8b_fp8_128_128", "Llama-3-8B FP8 + FP8 KV 128/128 offline"),
    ("llama8b_fp8_b1_128_512", "Llama-3-8B FP8 + FP8 KV batch 1, 128/512"),
    ("llama8b_fp8_2048_128", "Llama-3-8B FP8 + FP8 KV 2048/128 offline"),
    ("llama8b_fp8_128_2048", "Llama-3-8B FP8 + FP8 KV 128/2048 offline"),
    ("llama8b_int4wo_b1_128_512", "Llama-3-8B int4_wo (g128) batch 1, 128/512"),
    ("llama8b_int4wo_128_128", "Llama-3-8B int4_wo (g128) 128/128 offline"),
    ("llama8b_int8wo_b1_128_512", "Llama-3-8B int8_wo batch 1, 128/512"),
    ("llama8b_int8wo_128_128", "Llama-3-8B int8_wo 128/128 offline"),
    ("llama8b_int4wo_128_128_pw", "Llama-3-8B int4_wo (g128) 128/128 offline, piecewise graphs"),
    ("llama8b_int8wo_128_128_pw", "Llama-3-8B int8_wo 128/128 offline, piecewise graphs"),
    ("llama8b_b1_nopdl", "Llama-3-8B batch 1, LLMC_PDL=0"),
    ("llama8b_fp8_b1_nopdl", "Llama-3-8B FP8 + FP8 KV batch 1, LLMC_PDL=0"),
    ("llama8b_int4wo_b1_nopdl", "Llama-3-8B int4_wo (g128) batch 1, LLMC_PDL=0"),
    ("llama8b_int8wo_b1_nopdl", "Llama-3-8B int8_wo batch 1, LLMC_PDL=0"),
)

TRTLLM_FP8 = {
    "llama8b_fp8_128_128": 29526.0,
    "llama8b_fp8_2048_128": 3794.0,
    "llama8b_fp8_128_2048": 26221.0,
}
"""TensorRT-LLM v0.17's published Llama-3.1-8B FP8 H200 throughput (output tok/s), the
anchor of the FP8 rows (issue 12)."""


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _f(v: float | None, fmt: str = ",.0f", scale: float = 1.0) -> str:
    return "n/a" if v is None else format(v * scale, fmt)


def rooflines(res: dict[str, Any]) -> dict[str, float | None]:
    eng, ceil = res["config"]["engine"], res.get("ceilings") or {}
    w = res["config"]["workload"]
    isl, osl = w.get("mean_isl"), w.get("mean_osl")
    h, hd = eng["hidden_size"], eng["head_dim"]
    qkv = (eng["num_heads"] + 2 * eng["num_kv_heads"]) * hd
    per_layer = h * qkv + eng["num_heads"] * hd * h + 3 * h * eng["intermediate_size"]
    flops0 = 2.0 * (eng["num_layers"] * per_layer + eng["vocab_size"] * h)  # matmuls only
    fp8 = eng.get("quantization") == "fp8"
    tf = ceil.get("fp8_matmul_tflops") if fp8 else ceil.get("matmul_tflops")
    bw = ceil.get("copy_bandwidth_gb_s")
    compute = None
    if flops0 and tf and isl and osl:
        compute = tf * 1e12 / (flops0 * (isl + osl) / osl)
    wb = eng.get("weight_bytes")
    decode_bw = bw * 1e9 / wb if bw and wb else None
    return {"compute_tok_s": compute, "batch1_decode_tok_s": decode_bw}


def gpu_idle(results: Path) -> dict[str, Any] | None:
    """``profile.gpu_idle`` of the decode-heavy profile (``llmc profile`` computes it from
    its kernel events: ``llmc.runtime.bench.gpu_idle``), in milliseconds and shares."""
    p = results / "profile_decode.json"
    if not p.exists():
        return None
    idle = (json.loads(p.read_text()).get("profile") or {}).get("gpu_idle")
    if not idle:
        return {"error": "profile_decode.json has no profile.gpu_idle (a CPU run or an older llmc)"}
    ms = {k.replace("_s", "_ms"): v * 1e3 for k, v in idle.items() if k.endswith("window_s") and v}
    return {**ms, **{k: v for k, v in idle.items() if k.endswith("share")}}


def row(name: str, label: str, res: dict[str, Any]) -> dict[str, Any]:
    a, roof = res["aggregates"], rooflines(res)
    peer = _get(res, "peer", "aggregates") or {}
    w = res["config"]["workload"]
    out_tps = a.get("output_tokens_per_s")
    conc = _get(res, "config", "arrival", "concurrency")
    ref = roof["batch1_decode_tok_s"] if conc == 1 else roof["compute_tok_s"]
    beams = int(_get(w, "sampling", "beam_width") or 1)
    if ref and beams > 1:  # a returned token is one of beam_width rows the step computed
        ref /= beams
    tpot = _get(a, "tpot", "median")
    return {
        "row": name,
        "label": label,
        "requests": w.get("num_requests"),
        "isl": w.get("mean_isl"),
        "osl": w.get("mean_osl"),
        "output_tok_s": out_tps,
        "ttft_median_ms": _get(a, "ttft", "median") and a["ttft"]["median"] * 1e3,
        "tpot_median_ms": tpot and tpot * 1e3,
        "decode_tok_s_per_user": tpot and 1.0 / tpot,
        "roofline_tok_s": ref,
        "roofline_kind": "weight-read (batch 1)" if conc == 1 else "compute",
        "share_of_roofline": (out_tps / ref) if out_tps and ref else None,
        "peer_output_tok_s": peer.get("output_tokens_per_s"),
        "peer_ttft_median_ms": _get(peer, "ttft", "median") and peer["ttft"]["median"] * 1e3,
        "vs_peer": (out_tps / peer["output_tokens_per_s"])
        if out_tps and peer.get("output_tokens_per_s")
        else None,
        "kv_peak_utilization": a.get("kv_peak_utilization"),
        "preemptions": a.get("num_preemptions"),
        "mean_batch": a.get("mean_batch_size"),
        "mfu": _get(res, "achieved", "mfu"),
        "failed": a.get("num_failed"),
        "cuda_graphs": _get(res, "config", "runtime", "cuda_graphs"),
        "trtllm_fp8_published_tok_s": TRTLLM_FP8.get(name),
    }


MULTI_STEP_BASES = {
    "smollm2_128_128_k": "SmolLM2-135M shape 128/128 offline",
    "llama8b_128_128_k": "Llama-3-8B 128/128 offline",
    "llama8b_b1_k": "Llama-3-8B batch 1, 128/512",
}
"""The multi-step rows of bench_h200.sh (smolkK, 128kK, b1kK): name prefix → base label."""


def present_rows(d: Path) -> list[tuple[str, str]]:
    """ROWS, then every multi-step row found in ``d`` (K in ascending order)."""
    found = []
    for p in d.glob("*_k*.json"):
        for prefix, base in MULTI_STEP_BASES.items():
            k = p.stem.removeprefix(prefix)
            if p.stem.startswith(prefix) and k.isdigit():
                found.append((int(k), p.stem, f"{base}, --decode_steps_per_iteration {k}"))
    return list(ROWS) + [(name, label) for _, name, label in sorted(found)]


def main(argv: list[str]) -> int:
    d = Path(argv[0])
    rows = []
    for name, label in present_rows(d):
        p = d / f"{name}.json"
        if p.exists():
            try:
                rows.append(row(name, label, json.loads(p.read_text())))
            except (KeyError, TypeError, ValueError) as e:
                rows.append({"row": name, "label": label, "error": repr(e)})
    summary: dict[str, Any] = {"rows": rows}
    by = {r["row"]: r.get("output_tok_s") for r in rows}
    greedy, sampled = by.get("llama8b_128_128"), by.get("llama8b_128_128_sampled")
    if greedy and sampled:
        summary["sampled_vs_greedy"] = sampled / greedy
    beam = by.get("llama8b_128_128_beam4")
    if greedy and beam:  # returned tokens: each of them cost beam_width rows of the step
        summary["beam4_vs_greedy"] = beam / greedy
    idle = gpu_idle(d)
    if idle is not None:
        summary["gpu_idle"] = idle
    (d / "summary.json").write_text(json.dumps(summary, indent=1))
    head = (
        "| row | req | out tok/s | roofline | % roof | TTFT p50 ms | TPOT p50 ms | peer tok/s "
        "| vs peer | KV peak | preempt | batch | graphs | TRT-LLM FP8 |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | error {r['error']} |")
            continue
        print(
            f"| {r['label']} | {r['requests']} | {_f(r['output_tok_s'])} "
            f"| {_f(r['roofline_tok_s'])} ({r['roofline_kind']}) "
            f"| {_f(r['share_of_roofline'], '.0%')} | {_f(r['ttft_median_ms'], '.1f')} "
            f"| {_f(r['tpot_median_ms'], '.2f')} | {_f(r['peer_output_tok_s'])} "
            f"| {_f(r['vs_peer'], '.2f')}x | {_f(r['kv_peak_utilization'], '.0%')} "
            f"| {r['preemptions']} | {_f(r['mean_batch'], '.0f')} | {r['cuda_graphs']} "
            f"| {_f(r['trtllm_fp8_published_tok_s'])} |"
        )
    if "sampled_vs_greedy" in summary:
        share = summary["sampled_vs_greedy"]
        print(f"Llama-3-8B 128/128 sampled (T 0.7, top_p 0.9) / greedy: {share:.1%} (>= 95%)")
    if "gpu_idle" in summary:
        print("GPU idle (llmc profile, decode-heavy run):", json.dumps(summary["gpu_idle"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
