"""``llmc run``: prompts (flags or a file) through the front door ``llmc.LLM``; outputs and
timings.

Flags → ``RuntimeConfig`` (device, backend, lowered limits, KV pool, policy; the runtime
flags ``llmc bench`` and ``profile`` share, cli/options.py) and default ``SamplingParams``;
precedence CLI > the profile's ``run:`` section > defaults. The requests go to
``LLM.enqueue_request`` / ``await_responses``; timings come from ``LLM.request_records``,
the summary from its step records and KV stats. Requests (read in cli/run_inputs.py) come
from ``--prompt`` (repeatable) or ``--input_file``: plain text (one prompt per line) or JSONL
(``prompt``, ``input_ids`` or ``messages``, optional ``chat`` and per-request sampling fields
overriding the flags), or ``--messages_file``: JSONL, one conversation per line (a list of
``{"role", "content"}``). ``--system TEXT`` makes each text prompt a conversation (that system
message, then the prompt as the user's) and is the system message of every conversation that
has none; conversations go through the engine's chat template. A request that fails (bad
sampling values, too long, ...) is reported with its message while the others run; the exit
code is then that error's code (RequestError: 8).

Output: ``--json`` prints one object on stdout (outputs with text, token ids, finish reason
and timings; a summary; the runtime) and nothing else there. Otherwise each output, then a
Rich table per request and a summary; with ``--logprobs K`` / ``--prompt_logprobs K`` each
token's logprob, rank and top-K alternatives, with their texts. ``--stream`` prints the
first unfinished request's text as it is generated (the others follow in order); with
``--json`` the deltas are listed.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmc.base.errors import LlmcError, RequestError, UsageError
from llmc.cli.options import (
    ENGINE_DIR_FLAG,
    JSON_OPTION,
    PROFILE_OPTION,
    RUNTIME_FLAGS,
    Flag,
    check_keys,
    err_console,
    handle_errors,
    merge_settings,
    out_console,
    print_json,
    profile_section,
    runtime_config,
    with_flags,
)
from llmc.cli.run_inputs import RUN_KEYS, bias_map, int_list, read_requests
from llmc.runtime.logprobs import entry_json, with_texts
from llmc.runtime.types import Request

if TYPE_CHECKING:
    from llmc.api import LLM


def _timings(rec: Any) -> dict[str, Any]:
    from llmc.runtime.bench.metrics import e2e, tpot, ttft

    total = e2e(rec)
    n = rec.num_output_tokens
    return {
        "num_prompt_tokens": rec.num_prompt_tokens,
        "num_output_tokens": n,
        "num_cached_tokens": rec.num_cached_tokens,
        "num_preemptions": rec.num_preemptions,
        "ttft_s": ttft(rec),
        "tpot_s": tpot(rec),
        "e2e_s": total,
        "tokens_per_s": n / total if total and n else None,
    }


class _Printer:
    """Streams the text of the head request live; later requests follow in order."""

    def __init__(self, order: list[int], live: bool) -> None:
        self.order, self.live = order, live
        self.head = 0
        self.buffers: dict[int, list[str]] = {i: [] for i in order}
        self.done: set[int] = set()

    def add(self, rid: int, text: str, final: bool) -> None:
        self.buffers[rid].append(text)
        if final:
            self.done.add(rid)
        while self.live and self.head < len(self.order):
            cur = self.order[self.head]
            sys.stdout.write("".join(self.buffers[cur]))
            self.buffers[cur] = []
            if cur not in self.done:
                break
            sys.stdout.write("\n")
            self.head += 1
        sys.stdout.flush()


def run_requests(llm: LLM, items: list[tuple[str, Request]], printer: _Printer | None):
    """Enqueue every request, collect responses; returns {request_id: [responses]}."""
    ids = [llm.enqueue_request(req) for _, req in items]
    got: dict[int, list[Any]] = {rid: [] for rid in ids}
    finals = 0
    if printer is not None:
        printer.order[:] = ids
        printer.buffers = {i: [] for i in ids}
    while finals < len(ids):
        for r in llm.await_responses(ids):
            got[r.request_id].append(r)
            finals += r.is_final
            if printer is not None:  # several outputs: output 0 is printed as it comes
                printer.add(r.request_id, r.new_text if r.index == 0 else "", r.is_final)
    return ids, got


# fmt: off
RUN_FLAGS: tuple[Flag, ...] = (
    ENGINE_DIR_FLAG,
    Flag("prompt", list[str], "A prompt (repeatable). Default: none."),
    Flag("input_file", str, "Prompts: text (one per line) or JSONL with prompt or input_ids "
         "and per-request sampling fields. Default: none.", metavar="PATH"),
    Flag("max_new_tokens", int, "Most tokens to generate. Default: 32."),
    Flag("temperature", float, "Sampling temperature; 0 = greedy. Default: 0."),
    Flag("top_k", int, "Top-k; 0 = off. Default: 0."),
    Flag("top_p", float, "Top-p in (0, 1]. Default: 1."),
    Flag("min_p", float, "Min-p in [0, 1]. Default: 0."),
    Flag("repetition_penalty", float, "> 0; 1 = off. Default: 1."),
    Flag("presence_penalty", float, "In [-2, 2]. Default: 0."),
    Flag("frequency_penalty", float, "In [-2, 2]. Default: 0."),
    Flag("seed", int, "Sampling seed per request. Default: from the request id."),
    Flag("stop", list[str], "Stop string (repeatable); cut from the output. Default: none."),
    Flag("stop_token_ids", list[str], "Stop token ids (repeatable or a,b,c). Default: none."),
    Flag("ignore_eos", bool, "Do not stop at EOS. Default: off."),
    Flag("max_tokens", int, "vLLM's name of --max_new_tokens (give one). Default: 32."),
    Flag("min_tokens", int, "Suppress EOS and stop ids until this many tokens. Default: 0."),
    Flag("logit_bias", list[str], "TOKEN_ID:BIAS added to that token's logit every step, bias "
         "in [-100, 100] (-100 bans it; repeatable or a:b,c:d). Default: none.",
         metavar="ID:BIAS"),
    Flag("logprobs", int, "Each generated token's logprob, rank and this many top ones. "
         "Default: none (off; 0: the sampled token's alone)."),
    Flag("prompt_logprobs", int, "Each prompt token's logprob, rank and this many top ones. "
         "Default: none (off)."),
    Flag("n", int, "Outputs per prompt (samples, or the best beams). Default: 1; beams: all."),
    Flag("best_of", int, "Samples drawn (>= n); the n best by logprob sum kept. Default: n."),
    Flag("beam_width", int, "Beam search with this many beams; 1 = off. Default: 1."),
    Flag("length_penalty", float, "Beam score = logprob sum / length**this. Default: 1."),
    Flag("clamp_max_new_tokens", bool, "Lower max_new_tokens to fit max_seq_len instead of "
         "failing. Default: off."),
    Flag("messages_file", str, "Conversations: JSONL, one JSON list of {role, content} per "
         "line, through the chat template. Default: none.", metavar="PATH"),
    Flag("system", str, "A system message: each prompt becomes a chat (system, then the prompt "
         "as the user's); the system turn of conversations that have none. Default: none.",
         metavar="TEXT"),
    Flag("chat", bool, "Apply the engine's chat template. Default: off."),
    Flag("stream", bool, "Print tokens as they come. Default: off."),
)
# fmt: on


@with_flags(RUN_FLAGS, RUNTIME_FLAGS)
def run_command(
    profile: Annotated[str | None, PROFILE_OPTION] = None,
    json_out: Annotated[bool, JSON_OPTION] = False,
    **flags: Any,
) -> None:
    """Run prompts through an engine and print the outputs with per-request timings."""
    cli = dict(flags)
    cli["stop"] = cli["stop"] or None
    cli["stop_token_ids"] = int_list(cli["stop_token_ids"], "stop_token_ids")
    cli["logit_bias"] = bias_map(cli["logit_bias"])
    section = profile_section(profile, "run")
    check_keys(section, RUN_KEYS, f"profile {profile} (run:)")
    settings = merge_settings(cli, section)
    if not settings.get("engine_dir"):
        raise UsageError("--engine_dir is required (an engine built with `llmc build`)")
    items = read_requests(settings)
    config = runtime_config(settings)

    from llmc.api import LLM

    log = err_console()
    t0 = time.perf_counter()
    llm = LLM(engine_dir=settings["engine_dir"], runtime_config=config)
    try:
        _serve(llm, items, settings, json_out, log, t0)
    finally:
        llm.shutdown()


def _serve(llm: LLM, items: list, settings: dict[str, Any], json_out: bool, log: Any, t0: float):
    info = llm.summary()
    log.print(
        f"loaded {settings['engine_dir']} on {info['device']} ({info['backend']} backend) in "
        f"{time.perf_counter() - t0:.2f} s; KV cache {info['kv_blocks']} blocks "
        f"({info['kv_tokens']} tokens)",
        markup=False,
    )
    good = [(label, r) for label, r in items if isinstance(r, Request)]
    streaming = bool(settings.get("stream"))
    printer = _Printer([], live=not json_out) if streaming else None
    t1 = time.perf_counter()
    ids, got = run_requests(llm, good, printer)
    wall = time.perf_counter() - t1
    records = {r.request_id: r for r in llm.request_records}
    token_text = None if llm.tokenizer is None else llm.tokenizer.token_text
    outputs, it = [], iter(ids)
    for index, (label, req) in enumerate(items):
        if not isinstance(req, Request):
            outputs.append(_failed_output(index, label, req))
            continue
        rid = next(it)
        out = _output(index, label, got[rid], records[rid], streaming, token_text)
        if out["error"] is not None and "where" in req.metadata:  # the line it came from
            out["error"] = f"{req.metadata['where']}: {out['error']}"
        outputs.append(out)
    summary = _summary(llm, outputs, wall)
    if json_out:
        print_json({"outputs": outputs, "summary": summary, "runtime": info})
    else:
        from llmc.cli.run_report import print_report

        print_report(out_console(), outputs, summary, printed=streaming)
    failed = [o for o in outputs if o["error"] is not None]
    if failed:
        for o in failed:
            log.print(f"[bold red]error:[/] request {o['index']}: {o['error']}", highlight=False)
        raise typer.Exit(failed[0]["error_code"] or RequestError.exit_code)


def _failed_output(index: int, label: str, error: LlmcError) -> dict[str, Any]:
    return {
        "index": index,
        "request_id": None,
        "prompt": label,
        "text": "",
        "token_ids": [],
        "finish_reason": "error",
        "error": str(error),
        "error_code": error.exit_code,
        "timings": None,
    }


def _output(
    index: int, label: str, responses: list[Any], rec: Any, streaming: bool, token_text: Any
):
    final = responses[-1]
    out = {
        "index": index,
        "request_id": final.request_id,
        "prompt": label,
        "text": final.text or "",
        "token_ids": list(final.token_ids or []),
        "finish_reason": final.finish_reason.value if final.finish_reason else None,
        "error": _strip_id(final.error, final.request_id),
        "error_code": final.error_code,
        "timings": _timings(rec),
    }
    lps = [lp for r in responses if r.index == 0 for lp in (r.logprobs or [])]
    for key, entries in (("logprobs", lps), ("prompt_logprobs", final.prompt_logprobs)):
        if entries:
            if token_text is not None:
                entries = with_texts(entries, token_text)
            out[key] = [entry_json(e) for e in entries]
    if streaming:
        out["deltas"] = [r.new_text for r in responses if r.index == 0]
    if final.completions:  # several outputs (n, beams); finish_reason is a str enum
        keys = ("index", "text", "token_ids", "cumulative_logprob", "finish_reason")
        out["completions"] = [{k: getattr(c, k) for k in keys} for c in final.completions]
    return out


def _strip_id(error: str | None, request_id: int) -> str | None:
    """The executor names its own request id; the CLI names the prompt's index instead."""
    prefix = f"request {request_id}: "
    return error[len(prefix) :] if error and error.startswith(prefix) else error


def _summary(llm: LLM, outputs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    kv = llm.kv_stats()
    steps = llm.step_records
    outs = [c for o in outputs for c in o.get("completions", [o])]  # every output's tokens
    generated = sum(len(c["token_ids"]) for c in outs)
    return {
        "num_requests": len(outputs),
        "num_failed": sum(o["error"] is not None for o in outputs),
        "generated_tokens": generated,
        "wall_s": wall,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "num_steps": len(steps),
        "peak_kv_utilization": kv.peak_utilization,
        "peak_kv_blocks": kv.peak_used_blocks,
        "kv_blocks": kv.total_blocks,
        "kv_reuse_hits": kv.reuse_hits,
        "preemptions": sum(s.num_preempted for s in steps),
    }


def register(app: typer.Typer) -> None:
    app.command("run", no_args_is_help=False)(handle_errors(run_command))
