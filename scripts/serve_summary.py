"""Summary of ``scripts/serve_h200.sh``: in-process ``llmc bench`` beside ``llmc serve`` +
``llmc bench --url`` on the same engine and workload, with issue 15's two targets.

Usage: python scripts/serve_summary.py RESULTS_DIR
Reads inproc_256.json, http_256.json, inproc_c1.json, http_c1.json (any missing one prints
as n/a); prints a Markdown table on stdout and writes RESULTS_DIR/serve_summary.json.

Targets: through HTTP, output tok/s at concurrency 256 >= 90 % of in-process; TTFT p50 at
concurrency 1 within 2 ms of in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _load(d: Path, name: str) -> dict[str, Any] | None:
    p = d / f"{name}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _dig(r: dict[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(r, dict):
            return None
        r = r.get(key)
    return r


def _f(v: Any, scale: float = 1.0, spec: str = ",.1f") -> str:
    return "n/a" if v is None else f"{v * scale:{spec}}"


def main(directory: str) -> int:
    d = Path(directory)
    runs = {n: _load(d, n) for n in ("inproc_256", "http_256", "inproc_c1", "http_c1")}
    rows = []
    for name, r in runs.items():
        a = _dig(r, "aggregates") or {}
        rows.append(
            f"| {name} | {_f(a.get('num_completed'), spec=',.0f')} / "
            f"{_f(a.get('num_failed'), spec=',.0f')} | {_f(a.get('output_tokens_per_s'))} | "
            f"{_f(_dig(a, 'ttft', 'percentiles', 'p50'), 1e3, ',.2f')} | "
            f"{_f(_dig(a, 'tpot', 'mean'), 1e3, ',.2f')} | "
            f"{_f(_dig(a, 'itl', 'mean'), 1e3, ',.2f')} | "
            f"{_f(a.get('total_output_tokens'), spec=',.0f')} |"
        )
    tput_in = _dig(runs["inproc_256"], "aggregates", "output_tokens_per_s")
    tput_http = _dig(runs["http_256"], "aggregates", "output_tokens_per_s")
    ttft_in = _dig(runs["inproc_c1"], "aggregates", "ttft", "percentiles", "p50")
    ttft_http = _dig(runs["http_c1"], "aggregates", "ttft", "percentiles", "p50")
    share = tput_http / tput_in if tput_in and tput_http else None
    gap_ms = (ttft_http - ttft_in) * 1e3 if ttft_in is not None and ttft_http is not None else None
    summary = {
        "throughput_share": share,
        "throughput_target_met": share is not None and share >= 0.90,
        "ttft_p50_gap_ms": gap_ms,
        "ttft_target_met": gap_ms is not None and gap_ms <= 2.0,
    }
    print("| run | completed / failed | output tok/s | TTFT p50 ms | TPOT mean ms | ITL mean ms "
          "| output tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    met = "met" if summary["throughput_target_met"] else "NOT met"
    print(f"- HTTP / in-process output tok/s at concurrency 256: {_f(share, 100)} % "
          f"(target >= 90 %: {met})")  # fmt: skip
    met = "met" if summary["ttft_target_met"] else "NOT met"
    print(f"- TTFT p50 at concurrency 1, HTTP - in-process: {_f(gap_ms, 1, ',.2f')} ms "
          f"(target <= 2 ms: {met})")  # fmt: skip
    (d / "serve_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
