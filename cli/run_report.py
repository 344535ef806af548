"""The human-readable report of ``llmc run``: outputs, a Rich table per request, a summary.

Reads only the plain dictionaries ``cli/run_cmd.py`` also prints with ``--json``.
"""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def print_report(console: Any, outputs: list[dict[str, Any]], summary: dict, printed: bool):
    """Outputs (unless already streamed), their logprob tables when asked for, a table per
    request, then the summary."""
    from rich.markup import escape
    from rich.table import Table

    if not printed:
        for o in outputs:
            console.rule(f"[bold]request {o['index']}[/]: {escape(o['prompt'][:60])}")
            if o["error"] is not None:
                console.print(f"[red]error:[/] {escape(o['error'])}")
            else:
                console.print(o["text"], markup=False, highlight=False, soft_wrap=True)
            for c in o.get("completions", [])[1:]:  # the other outputs (n, beams)
                console.print(f"[dim]output {c['index']}:[/]")
                console.print(c["text"], markup=False, highlight=False, soft_wrap=True)
    for o in outputs:
        for key, title in (("prompt_logprobs", "prompt"), ("logprobs", "generated")):
            if o.get(key):
                console.print(_logprob_table(o[key], f"request {o['index']}: {title} logprobs"))
    table = Table(title="requests")
    for col in ("#", "prompt tok", "generated tok", "TTFT ms", "tokens/s", "finish"):
        table.add_column(col, justify="right" if col != "finish" else "left")
    for o in outputs:
        t = o["timings"] or {}
        table.add_row(
            str(o["index"]),
            str(t.get("num_prompt_tokens", "-")),
            str(len(o["token_ids"])),
            _fmt(t.get("ttft_s"), 1e3),
            _fmt(t.get("tokens_per_s")),
            o["finish_reason"] or "-",
        )
    console.print(table)
    s = summary
    console.print(
        f"{s['num_requests']} request{'s' if s['num_requests'] != 1 else ''} "
        f"({s['num_failed']} failed), {s['generated_tokens']} "
        f"tokens in {s['wall_s']:.2f} s = {_fmt(s['tokens_per_s'])} tokens/s; "
        f"peak KV-cache utilization {100 * s['peak_kv_utilization']:.1f}% "
        f"({s['peak_kv_blocks']}/{s['kv_blocks']} blocks); preemptions {s['preemptions']}",
        highlight=False,
        soft_wrap=True,
    )


def _token(text: str | None, token_id: int) -> str:
    """A token's text as a table cell: quoted (whitespace shows), markup escaped."""
    from rich.markup import escape

    return escape(repr(text)) if text is not None else f"<{token_id}>"


def _logprob_table(entries: list[dict[str, Any] | None], title: str) -> Any:
    """One row per token: its text, logprob, rank and top alternatives (text: logprob)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("#", "token", "logprob", "rank", "top"):
        table.add_column(col, justify="right" if col in ("#", "logprob", "rank") else "left")
    for i, e in enumerate(entries):
        if e is None:  # a prompt's first token: nothing before it to score it
            table.add_row(str(i), "-", "-", "-", "")
            continue
        top = ", ".join(f"{_token(t['token'], t['token_id'])} {t['logprob']:.3f}" for t in e["top"])
        table.add_row(
            str(i),
            _token(e["token"], e["token_id"]),
            f"{e['logprob']:.4f}",
            "-" if e["rank"] is None else str(e["rank"]),
            top,
        )
    return table
