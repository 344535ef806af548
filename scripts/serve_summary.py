"""Summary of ``scripts/serve_h200.sh``: in-process ``llmc bench`` beside ``llmc serve`` +
``llmc bench --url`` on the same engine and workload, with issue 15's two targets.

Usage: python scripts/serve_summary.py RESULTS_DIR
Reads inproc_256.json, http_256.json, inproc_c1.json, http_c1.json (any missing one prints
as n/a); prints a Markdown table on stdout and writes RESULTS_DIR/serve_summary.json.
With the server's /metrics scraped after the 256 run (metrics_256.txt) and after the
concurrency-1 run (metrics.txt), it also prints where each HTTP run's first tokens went:
the server's ``llmc_first_token_stage_seconds`` (admit / queue / compute / deliver, mean
and bucket-interpolated median; the c1 row is the difference of the two scrapes) beside
the server's arrival → first chunk and the client's TTFT (the rest: client and loopback).

Targets: through HTTP, output tok/s at concurrency 256 >= 90 % of in-process; TTFT p50 at
concurrency 1 within 2 ms of in-process.
"""

from __future__ import annotations

import json
import re
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


STAGES = ("admit", "queue", "compute", "deliver")
SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _histograms(d: Path, name: str) -> dict[str, dict[str, Any]] | None:
    """``parse_histograms`` of a file; None when it is missing."""
    try:
        return parse_histograms((d / name).read_text())
    except OSError:
        return None


def parse_histograms(text: str) -> dict[str, dict[str, Any]]:
    """{histogram: {label 'stage' or '': {'sum', 'count', 'buckets': {le: n}}}} of
    Prometheus text (every model summed)."""
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line.strip())
        if m is None or line.startswith("#"):
            continue
        metric, labels, value = m.group(1), dict(LABEL.findall(m.group(2) or "")), m.group(3)
        for suffix in ("_bucket", "_sum", "_count"):
            if metric.endswith(suffix):
                fam = out.setdefault(metric.removesuffix(suffix), {})
                h = fam.setdefault(
                    labels.get("stage", ""), {"sum": 0.0, "count": 0.0, "buckets": {}}
                )
                if suffix == "_bucket":
                    le = float(labels["le"])
                    h["buckets"][le] = h["buckets"].get(le, 0.0) + float(value)
                else:
                    h[suffix[1:]] += float(value)
    return out


def hist_minus(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    if b is None:
        return a
    return {
        "sum": a["sum"] - b["sum"],
        "count": a["count"] - b["count"],
        "buckets": {le: n - b["buckets"].get(le, 0.0) for le, n in a["buckets"].items()},
    }


def hist_median(h: dict[str, Any]) -> float | None:
    """The median of a histogram, linear inside its bucket; None when it is empty."""
    n, lo, below = h["count"], 0.0, 0.0
    if n <= 0:
        return None
    for le, cum in sorted(h["buckets"].items()):
        if cum >= n / 2:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (n / 2 - below) / max(cum - below, 1e-12)
        lo, below = le, cum
    return lo


def stage_rows(d: Path, runs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per HTTP run: the server's first-token stages (ms), its arrival → first chunk, and
    the client's TTFT mean (ms)."""
    after256, after_c1 = _histograms(d, "metrics_256.txt"), _histograms(d, "metrics.txt")
    scrapes = [("http_256", after256, None)]
    if after_c1 is not None and after256 is not None:  # c1 alone: the later scrape - the earlier
        scrapes.append(("http_c1", after_c1, after256))
    elif after_c1 is not None:  # one scrape after both runs (an older serve_h200.sh)
        scrapes.append(("http_256 + http_c1", after_c1, None))
    rows = []
    for name, now, before in scrapes:
        if now is None:
            continue
        row: dict[str, Any] = {"run": name}
        fam = now.get("llmc_first_token_stage_seconds", {})
        base = (before or {}).get("llmc_first_token_stage_seconds", {})
        for s in STAGES:
            h = hist_minus(fam[s], base.get(s)) if s in fam else None
            ok = h is not None and h["count"] > 0
            row[f"{s}_mean_ms"] = h["sum"] / h["count"] * 1e3 if ok else None
            row[f"{s}_p50_ms"] = (hist_median(h) or 0.0) * 1e3 if ok else None
        ttft = now.get("llmc_time_to_first_token_seconds", {}).get("")
        if ttft is not None:
            h = hist_minus(ttft, (before or {}).get("llmc_time_to_first_token_seconds", {}).get(""))
            row["server_ttft_mean_ms"] = h["sum"] / h["count"] * 1e3 if h["count"] else None
        row["client_ttft_mean_ms"] = _dig(runs.get(name), "aggregates", "ttft", "mean")
        if row["client_ttft_mean_ms"] is not None:
            row["client_ttft_mean_ms"] *= 1e3
        rows.append(row)
    return rows


def main(directory: str) -> int:
    d = Path(directory)
    runs = {n: _load(d, n) for n in ("inproc_256", "http_256", "inproc_c1", "http_c1")}
    extra = {n: _load(d, n) for n in ("inproc_256_mnt", "http_256_mnt")}  # MNT2 runs
    if any(extra.values()):
        runs.update(extra)
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
    if "http_256_mnt" in runs:
        mnt_in = _dig(runs["inproc_256_mnt"], "aggregates", "output_tokens_per_s")
        mnt_http = _dig(runs["http_256_mnt"], "aggregates", "output_tokens_per_s")
        summary["throughput_share_mnt"] = mnt_share = (
            mnt_http / mnt_in if mnt_in and mnt_http else None
        )
        vs_default = mnt_in / tput_in if mnt_in and tput_in else None
        print(f"- the same with MNT2 (--max_num_tokens on both sides): {_f(mnt_share, 100)} %; "
              f"in-process MNT2 / default: {_f(vs_default, 100)} %")  # fmt: skip
    stages = stage_rows(d, runs)
    summary["first_token_stages"] = stages
    if stages:
        print()
        print("| HTTP run | admit | queue | compute | deliver | server TTFT | client TTFT | "
              "client + loopback |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for row in stages:
            cells = [f"{_f(row[f'{s}_mean_ms'], spec=',.2f')} / "
                     f"{_f(row[f'{s}_p50_ms'], spec=',.2f')}" for s in STAGES]  # fmt: skip
            srv, cli = row.get("server_ttft_mean_ms"), row.get("client_ttft_mean_ms")
            rest = cli - srv if srv is not None and cli is not None else None
            print(f"| {row['run']} | " + " | ".join(cells) + f" | {_f(srv, spec=',.2f')} | "
                  f"{_f(cli, spec=',.2f')} | {_f(rest, spec=',.2f')} |")  # fmt: skip
        print("\nms; stages: mean / median of the server's first-token stage histogram "
              "(the server's runs include their warm-up); TTFT columns: means.")  # fmt: skip
    (d / "serve_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
