"""Rich tables of a build (or dry run): the build summary and the memory plan.

Pure rendering of a ``BuildResult``; no logic a library user would need lives here. The
strings it prints (notes, paths) pass through ``llmc.base.text.printable``.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmc.base.text import printable
from llmc.cli.options import human_bytes
from llmc.compiler.builder import BuildResult
from llmc.compiler.memory_plan import MemoryPlan
from llmc.compiler.quantization import FP8_PROJECTIONS, SCALE_SUFFIX, describe, stores_fp8
from llmc.compiler.tp_layout import rank_spec


def summary_table(result: BuildResult) -> Table:
    spec, b, lim = result.spec, result.build, result.build.limits
    t = Table(title="llmc build" + (" (dry run: nothing written)" if result.dry_run else ""))
    t.add_column("setting", style="bold")
    t.add_column("value")
    t.add_row("model", f"{spec.architecture}, {spec.num_parameters() / 1e6:,.1f} M parameters")
    t.add_row(
        "shape",
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, heads {spec.num_heads}/"
        f"{spec.num_kv_heads} x {spec.head_dim}, MLP {spec.intermediate_size}, "
        f"vocab {spec.vocab_size}" + (", tied embeddings" if spec.tie_word_embeddings else ""),
    )
    t.add_row("dtype / target", f"{lim.dtype} / {b.target}")
    if b.tp_size > 1:
        r = rank_spec(spec, b.tp_size)
        t.add_row(
            "tensor parallel",
            f"tp_size {b.tp_size}; each rank: {r.num_heads} q heads, {r.num_kv_heads} KV heads"
            f"{' (replicated)' if spec.num_kv_heads < b.tp_size else ''}, MLP "
            f"{r.intermediate_size}; embedding, lm_head and norms replicated",
        )
    quant = (result.manifest or {}).get("quantization") or result.quantization or describe(lim)
    t.add_row("quantization", escape(printable(quant["weights"])))
    if quant.get("layouts"):
        for family, layout in quant.get("families", {}).items():
            t.add_row(f"  {family}", escape(printable(layout)))
    if quant.get("float_projections") and not quant.get("layouts"):
        for family, dtypes in quant.get("dtypes", {}).items():
            if family.removesuffix("_scale") in FP8_PROJECTIONS and not family.endswith("_scale"):
                counts = ", ".join(f"{dt} x{n}" for dt, n in dtypes.items())
                t.add_row(f"  {family}", escape(printable(counts)))
    for name, why in quant.get("dequantized", {}).items():
        t.add_row("  dequantized", escape(printable(f"{name}: {why}")))
    if "file_tensor_bytes" in quant:
        t.add_row(
            "weight bytes",
            f"engine {human_bytes(quant['engine_weight_bytes'])} / GGUF file tensors "
            f"{human_bytes(quant['file_tensor_bytes'])}",
        )
    t.add_row("KV cache", escape(printable(quant["kv_cache"])))
    t.add_row(
        "weights",
        f"dummy (seed {b.dummy_seed})" if b.load_format == "dummy" else "from the checkpoint",
    )
    t.add_row("max_batch_size", f"{lim.max_batch_size} sequences")
    t.add_row("max_input_len", f"{lim.max_input_len} tokens")
    t.add_row("max_seq_len", f"{lim.max_seq_len} tokens")
    t.add_row("max_num_tokens", f"{lim.max_num_tokens} tokens per step")
    t.add_row("tokens_per_block", f"{lim.tokens_per_block} tokens")
    t.add_row("chunked prefill", "on" if lim.enable_chunked_prefill else "off")
    for note in result.notes:
        if " dequantized: " not in note:  # (listed under quantization)
            t.add_row("derived", escape(printable(note)))
    if result.output_dir is not None:
        t.add_row("engine", escape(printable(result.output_dir)))
    for path in result.cleaned:
        t.add_row("cleaned", escape(printable(f"stale temp dir of an interrupted build: {path}")))
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings_s.items())
    t.add_row("time", f"{sum(result.timings_s.values()):.2f} s ({phases})")
    return t


def plan_table(result: BuildResult) -> Table:
    """The memory plan; with tensor parallelism one column per rank (each its own device)."""
    plans = result.plans
    t = Table(title="memory plan" + (f" per rank (tp_size {len(plans)})" if len(plans) > 1 else ""))
    t.add_column("item", style="bold")
    columns = [_plan_rows(p) for p in plans]
    for r in range(len(plans)):
        t.add_column("value" if len(plans) == 1 else f"rank {r}", justify="right")
    for i, (item, _) in enumerate(columns[0]):
        t.add_row(item, *(rows[i][1] for rows in columns))
    return t


def _plan_rows(p: MemoryPlan) -> list[tuple[str, str]]:
    rows = [("weights", f"{human_bytes(p.weight_bytes_total)} ({len(p.weight_bytes)} tensors)")]
    if p.limits.quantization == "fp8":
        floats = p.limits.float_projections
        codes = sum(n for k, n in p.weight_bytes.items() if stores_fp8(k, "fp8", floats))
        scales = sum(n for k, n in p.weight_bytes.items() if k.endswith(SCALE_SUFFIX))
        rows.append(
            (
                "  of which fp8",
                f"{human_bytes(codes)} e4m3 projections + {human_bytes(scales)} float32 scales",
            )
        )
    if p.limits.float_projections:
        kept = sum(p.weight_bytes.get(k, 0) for k in p.limits.float_projections)
        rows.append(
            (
                "  of which excluded",
                f"{human_bytes(kept)} in {p.limits.dtype} "
                f"({len(p.limits.float_projections)} projections excluded from quantization)",
            )
        )
    packed = {k: n for k, n in p.weight_bytes.items() if k.endswith(("_scale", "_offset"))}
    if p.limits.quantization in ("int8_wo", "int4_wo", "gguf") and packed:
        extra = sum(packed.values())
        codes = sum(
            p.weight_bytes.get(k.rsplit("_", 1)[0], 0) for k in packed if k.endswith("_scale")
        )
        rows.append(
            (
                "  of which weight-only",
                f"{human_bytes(codes)} codes + {human_bytes(extra)} scales and offsets",
            )
        )
    saved = 1 - p.workspace_bytes / p.naive_workspace_bytes if p.naive_workspace_bytes else 0.0
    rows.append(
        (
            "workspace (packed / naive)",
            f"{human_bytes(p.workspace_bytes)} / {human_bytes(p.naive_workspace_bytes)} "
            f"({saved:.0%} saved, {len(p.buffers)} buffers)",
        )
    )
    rows.append(("KV cache per token", human_bytes(p.kv_bytes_per_token)))
    rows.append(
        (
            "KV cache per block",
            f"{human_bytes(p.kv_bytes_per_block)} ({p.limits.tokens_per_block} tokens)",
        )
    )
    one_request = p.blocks_per_max_seq * p.kv_bytes_per_block
    rows.append(
        ("one max_seq_len request", f"{p.blocks_per_max_seq} blocks ({human_bytes(one_request)})")
    )
    cap = p.capacity
    if cap is None:
        rows += [("KV capacity", escape(printable(note))) for note in p.notes]
        return rows
    source = escape(printable(cap.memory_source))
    rows.append(("device memory", f"{human_bytes(cap.device_memory_bytes)} ({source})"))
    rows.append(
        (
            "KV pool",
            f"{human_bytes(cap.kv_pool_bytes)} (x {cap.kv_cache_free_gpu_mem_fraction} of "
            f"{human_bytes(cap.free_after_weights_bytes)} free)",
        )
    )
    rows.append(("KV capacity", f"{cap.kv_tokens:,} tokens in {cap.kv_blocks:,} blocks"))
    rows.append(
        (f"requests at max_seq_len={p.limits.max_seq_len}", f"{cap.max_concurrent_requests:,}")
    )
    return rows


def buffers_table(result: BuildResult) -> Table:
    p = result.plan
    each = " (each rank)" if len(result.plans) > 1 else ""
    t = Table(title=f"workspace arena at max_num_tokens={p.limits.max_num_tokens}{each}")
    for col in ("buffer", "shape", "dtype", "live ops", "offset", "size"):
        t.add_column(col, justify="right" if col in ("offset", "size") else "left")
    for b in sorted(p.buffers, key=lambda b: (b.offset, b.name)):
        live = p.ops[b.first] if b.first == b.last else f"{p.ops[b.first]}..{p.ops[b.last]}"
        t.add_row(
            b.name,
            "[" + ", ".join(map(str, b.shape)) + "]",
            b.dtype,
            live,
            human_bytes(b.offset),
            human_bytes(b.nbytes),
        )
    return t


def print_report(console: Console, result: BuildResult) -> None:
    console.print(summary_table(result))
    if result.dry_run:
        console.print(buffers_table(result))
    console.print(plan_table(result))
