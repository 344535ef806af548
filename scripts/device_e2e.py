"""Summary of ``scripts/bench_h200.sh``: one table from the ``llmc bench`` / ``llmc profile``
JSON results, each number beside its roofline and the peer from the same run, and the GPU
idle share between steps from the profile's Chrome trace.

Usage: python -m ... (or python scripts/device_e2e.py) RESULTS_DIR [--trace TRACE.json]
Prints the table (Markdown) on stdout and writes RESULTS_DIR/summary.json.

Rooflines (per row, from the result's own engine and ceilings):
- compute: matmul_tflops / FLOPs per output token, where FLOPs per output token =
  2 * matmul parameters (layers + lm_head) * (isl + osl) / osl (prefill and decode
  counted, attention left out);
- decode bandwidth (batch 1): copy_bandwidth / weight_bytes tokens/s (every weight read
  once per step), and its time per output token.
GPU idle: within the measured window of the trace (first to last GPU event), the share of
time covered by no kernel or copy; also restricted to decode-only steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROWS = (
    ("llama8b_128_128", "Llama-3-8B 128/128 offline"),
    ("llama8b_128_128_peer", "Llama-3-8B 128/128 offline (peer subset)"),
    ("llama8b_b1_128_512", "Llama-3-8B batch 1, 128/512"),
    ("llama8b_2048_128", "Llama-3-8B 2048/128 offline"),
    ("llama8b_128_2048", "Llama-3-8B 128/2048 offline"),
    ("smollm2_128_128_peer", "SmolLM2-135M shape 128/128 offline"),
    ("llama8b_128_128_nographs", "Llama-3-8B 128/128, --no_cuda_graphs"),
    ("llama8b_b1_nographs", "Llama-3-8B batch 1, --no_cuda_graphs"),
    ("llama8b_b1_sync", "Llama-3-8B batch 1, --no_async_scheduling"),
    ("llama8b_b1_mb256", "Llama-3-8B batch 1, --max_batch_size 256"),
    ("llama8b_128_128_mb1024", "Llama-3-8B 128/128 offline, max_batch_size 1024"),
)


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
    tf, bw = ceil.get("matmul_tflops"), ceil.get("copy_bandwidth_gb_s")
    compute = None
    if flops0 and tf and isl and osl:
        compute = tf * 1e12 / (flops0 * (isl + osl) / osl)
    wb = eng.get("weight_bytes")
    decode_bw = bw * 1e9 / wb if bw and wb else None
    return {"compute_tok_s": compute, "batch1_decode_tok_s": decode_bw}


def gpu_idle(trace_path: Path) -> dict[str, Any]:
    ev = json.loads(trace_path.read_text())["traceEvents"]
    ks = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("pid") == 2 and e["ph"] == "X")
    steps = [e for e in ev if e.get("cat") == "step"]
    if not ks:
        return {"error": "no GPU events in the trace"}
    merged: list[list[float]] = []
    for a, b in ks:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def busy_in(lo: float, hi: float) -> float:
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged if b > lo and a < hi)

    lo, hi = merged[0][0], merged[-1][1]
    out = {"window_ms": (hi - lo) / 1e3, "idle_share": 1 - busy_in(lo, hi) / (hi - lo)}
    dec = [s for s in steps if s["args"].get("prefill_tokens") == 0]
    if len(dec) > 2:
        # decode-only stretch: from the first to the last decode-only step of the run
        d_lo, d_hi = dec[0]["ts"], dec[-1]["ts"] + dec[-1]["dur"]
        d_lo, d_hi = max(d_lo, lo), min(d_hi, hi)
        if d_hi > d_lo:
            out["decode_window_ms"] = (d_hi - d_lo) / 1e3
            out["decode_idle_share"] = 1 - busy_in(d_lo, d_hi) / (d_hi - d_lo)
        durs = sorted(s["dur"] for s in dec)
        out["decode_step_median_ms"] = durs[len(durs) // 2] / 1e3
    return out


def row(name: str, label: str, res: dict[str, Any]) -> dict[str, Any]:
    a, roof = res["aggregates"], rooflines(res)
    peer = _get(res, "peer", "aggregates") or {}
    w = res["config"]["workload"]
    out_tps = a.get("output_tokens_per_s")
    conc = _get(res, "config", "arrival", "concurrency")
    ref = roof["batch1_decode_tok_s"] if conc == 1 else roof["compute_tok_s"]
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
    }


def main(argv: list[str]) -> int:
    d = Path(argv[0])
    trace = Path(argv[argv.index("--trace") + 1]) if "--trace" in argv else None
    rows = []
    for name, label in ROWS:
        p = d / f"{name}.json"
        if p.exists():
            try:
                rows.append(row(name, label, json.loads(p.read_text())))
            except (KeyError, TypeError, ValueError) as e:
                rows.append({"row": name, "label": label, "error": repr(e)})
    summary: dict[str, Any] = {"rows": rows}
    if trace is not None and trace.exists():
        summary["gpu_idle"] = gpu_idle(trace)
    (d / "summary.json").write_text(json.dumps(summary, indent=1))
    head = (
        "| row | req | out tok/s | roofline | % roof | TTFT p50 ms | TPOT p50 ms | peer tok/s "
        "| vs peer | KV peak | preempt | batch | graphs |"
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
            f"| {r['preemptions']} | {_f(r['mean_batch'], '.0f')} | {r['cuda_graphs']} |"
        )
    if "gpu_idle" in summary:
        print("GPU idle (profile trace):", json.dumps(summary["gpu_idle"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
