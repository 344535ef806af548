"""One benchmark end to end: served engine → workload → run → (peer run) → BenchResult.

The library entry point behind ``llmc bench`` (and the measured part of ``llmc profile``):
``BenchSettings`` says what to run; ``run_bench`` takes an engine already loaded and served
by the front door (``llmc.LLM``, read through ``Served``), builds the workload, runs it,
aggregates the engine's own records, puts achieved rates beside the measured ceilings, then
(with ``peer='hf'``) shuts the LLM down to free its memory and runs the same requests through
transformers on the same device.

Invariant: text prompts are tokenized once with the engine's tokenizer before anything
runs, so llmc and the peer see identical token ids.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.bench.benchmark import (
    BenchResult,
    ProgressFn,
    WorkloadRun,
    aggregate_run,
    environment,
    request_rows,
    run_workload,
)
from llmc.runtime.bench.metrics import DEFAULT_PERCENTILES, Aggregates, achieved, aggregate
from llmc.runtime.bench.served import Served
from llmc.runtime.bench.workload import (
    ArrivalSpec,
    BenchSampling,
    SyntheticSpec,
    WorkloadRequest,
    arrival_offsets,
    load_dataset,
    synthetic_workload,
)

PEERS = ("hf",)


@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark runs (workload, arrivals, measurement options)."""

    synthetic: SyntheticSpec = SyntheticSpec()
    dataset: str | None = None
    arrival: ArrivalSpec = ArrivalSpec()
    warmup: int = 2
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    peer: str | None = None
    peer_batch_size: int | None = None
    peer_cache: str = "auto"
    ceilings: bool = True
    sampling: BenchSampling = BenchSampling()

    def __post_init__(self) -> None:
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        for p in self.percentiles:
            if not 0 <= p <= 100:
                raise ConfigError(f"percentile {p:g} is outside [0, 100]")
        if self.peer is not None and self.peer not in PEERS:
            raise ConfigError(f"peer {self.peer!r} is not one of {', '.join(PEERS)}")
        if self.peer is not None and not self.sampling.is_greedy:
            raise UsageError(
                f"--peer {self.peer} runs greedy decoding: benchmark it without --temperature, "
                "--n or --beam_width"
            )


def parse_percentiles(text: str | Sequence[float]) -> tuple[float, ...]:
    """'50,90,99' → (50.0, 90.0, 99.0); a bad entry is a UsageError naming it."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            p = float(item)
        except (TypeError, ValueError):
            raise UsageError(f"--percentiles: {item!r} is not a number") from None
        if not (math.isfinite(p) and 0 <= p <= 100):
            raise UsageError(f"--percentiles: {item!r} is outside [0, 100]")
        out.append(p)
    if not out:
        raise UsageError("--percentiles: give at least one percentile, e.g. 50,90,99")
    return tuple(dict.fromkeys(out))


def check_synthetic_fits(spec: SyntheticSpec, max_input_len: int, max_seq_len: int) -> None:
    """Refuse (ConfigError, exit 3) a synthetic workload of fixed lengths that every request
    of would be refused by the engine (a prompt over ``max_input_len``, prompt + output over
    ``max_seq_len``), before any is sent; with a spread (``--isl_stdev`` / ``--osl_stdev``)
    some may fit, and those that do not fail alone, as dataset rows do."""
    if spec.isl_stdev == 0 and spec.isl > max_input_len:
        raise ConfigError(
            f"isl {spec.isl} is more than the engine's max_input_len={max_input_len}: every "
            "request would be refused; lower --isl or build with a larger --max_input_len"
        )
    if spec.isl_stdev == 0 and spec.osl_stdev == 0 and spec.isl + spec.osl > max_seq_len:
        raise ConfigError(
            f"isl + osl = {spec.isl + spec.osl} is more than the engine's "
            f"max_seq_len={max_seq_len}: every request would be refused; lower --isl / --osl "
            "or build with a larger --max_seq_len"
        )


def build_requests(
    settings: BenchSettings,
    vocab_size: int | None,
    tokenizer: Any,
    limits: tuple[int, int] | None = None,
    need_ids: bool = True,
) -> tuple[list[WorkloadRequest], list[WorkloadRequest]]:
    """(warm-up requests, measured requests); text prompts tokenized here when there is a
    tokenizer (always in-process; over HTTP without one they are sent as text).
    ``limits``: the engine's (max_input_len, max_seq_len), for the ShareGPT filter."""
    n = settings.synthetic.num_requests
    if settings.dataset is not None:
        encode = tokenizer.encode if tokenizer is not None else None
        reqs = load_dataset(
            settings.dataset,
            n + settings.warmup,
            vocab_size,
            encode=encode,
            seed=settings.synthetic.seed,
            limits=limits,
        )
    else:
        if vocab_size is None:
            raise UsageError(
                "a synthetic workload over HTTP needs the model's vocabulary: give "
                "--engine_dir (the served engine) or --tokenizer, or a --dataset"
            )
        if limits is not None:
            check_synthetic_fits(settings.synthetic, *limits)
        spec = dataclasses.replace(settings.synthetic, num_requests=n + settings.warmup)
        reqs = synthetic_workload(spec, vocab_size)
    if any(r.prompt_token_ids is None for r in reqs) and (need_ids or tokenizer is not None):
        if tokenizer is None:
            raise UsageError(
                f"dataset {settings.dataset} has text prompts but the engine has no tokenizer; "
                "give input_ids instead"
            )
        reqs = [
            r
            if r.prompt_token_ids is not None
            else dataclasses.replace(r, prompt_token_ids=tuple(tokenizer.encode(r.prompt)))
            for r in reqs
        ]
    if settings.dataset is not None and len(reqs) <= settings.warmup:
        raise UsageError(
            f"dataset {settings.dataset} holds {len(reqs)} requests, not more than "
            f"--warmup {settings.warmup}"
        )
    return reqs[: settings.warmup], reqs[settings.warmup :]


def engine_config(rt: Any) -> dict[str, Any]:
    spec, eng = rt.spec, rt.engine
    return {
        "architecture": spec.architecture,
        "num_parameters": spec.num_parameters(),
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "weight_bytes": eng.plan.weight_bytes_total if eng is not None else None,
        "workspace_bytes": eng.plan.workspace_bytes if eng is not None else None,
        "kv_bytes_per_token": eng.plan.kv_bytes_per_token if eng is not None else None,
        **(eng.build.to_dict() if eng is not None else {}),
    }


def workload_config(
    settings: BenchSettings, warm: list[WorkloadRequest], reqs: list[WorkloadRequest]
) -> dict[str, Any]:
    syn = settings.synthetic
    isls = [len(r.prompt_token_ids or ()) for r in reqs]
    osls = [r.output_tokens for r in reqs]
    return {
        "source": "dataset" if settings.dataset else "synthetic",
        "dataset": settings.dataset,
        "num_requests": len(reqs),
        "warmup": len(warm),
        **({} if settings.dataset else dataclasses.asdict(syn)),
        "num_requests_asked": syn.num_requests,
        "mean_isl": sum(isls) / len(isls) if isls else None,
        "mean_osl": sum(osls) / len(osls) if osls else None,
        "max_isl": max(isls, default=None),
        "max_osl": max(osls, default=None),
        "sampling": dataclasses.asdict(settings.sampling),
    }


def _achieved(rt: Any, agg: Aggregates, run: WorkloadRun, ceil: Any) -> dict[str, Any]:
    spec = rt.spec
    f0 = spec.flops_per_token(0)
    return achieved(
        agg,
        run.requests,
        weight_bytes=rt.engine.plan.weight_bytes_total if rt.engine is not None else None,
        flops_at_zero=f0,
        flops_per_context=spec.flops_per_token(1) - f0,
        copy_bandwidth_gb_s=ceil.copy_bandwidth_gb_s if ceil else None,
        matmul_tflops=ceil.matmul_tflops if ceil else None,
    ).to_dict()


@dataclass
class BenchOutcome:
    """The result, plus the live objects ``llmc profile`` reads further."""

    result: BenchResult
    run: WorkloadRun
    llm: Served
    """The engine that ran (shut down when a peer ran after it)."""


def run_bench(
    llm: Served,
    settings: BenchSettings,
    *,
    log: Callable[[str], None] = lambda m: None,
    progress: ProgressFn | None = None,
    measure: AbstractContextManager[Any] | None = None,
) -> BenchOutcome:
    """Run one benchmark on ``llm``. ``measure`` (a profiling session) is entered around
    the measured requests (warm-up excluded)."""
    rt = llm.runtime
    lim = rt.limits
    warm, reqs = build_requests(
        settings, rt.spec.vocab_size, rt.tokenizer, (lim.max_input_len, lim.max_seq_len)
    )
    summary = llm.summary()
    log(
        f"engine on {rt.device} ({rt.backend} backend): KV pool {summary['kv_tokens']:,} tokens; "
        f"{len(reqs)} requests + {len(warm)} warm-up, {settings.arrival.describe()}"
    )
    ceil = None
    if settings.ceilings:
        from llmc.runtime.bench.ceilings import get_ceilings

        ceil = get_ceilings(rt.device)
        log(f"ceilings: {ceil.source}")
    run = run_workload(
        llm,
        reqs,
        settings.arrival,
        warmup=warm,
        progress=progress,
        measure=measure,
        sampling=settings.sampling,
    )
    agg = aggregate_run(run, settings.percentiles, summary["tokens_per_block"])
    config = {
        "engine_dir": str(llm.engine_dir),
        "engine": engine_config(rt),
        "runtime": runtime_config(llm),
        "workload": workload_config(settings, warm, reqs),
        "arrival": {
            **dataclasses.asdict(settings.arrival),
            "description": settings.arrival.describe(),
        },
        "percentiles": list(settings.percentiles),
    }
    result = BenchResult(
        config=config,
        environment=environment(rt.device),
        aggregates=agg,
        requests=request_rows(run),
        ceilings=ceil.to_dict() if ceil else None,
        achieved=_achieved(rt, agg, run, ceil),
    )
    if settings.peer == "hf":
        device, engine, limit = rt.device, rt.engine, summary["max_batch_size"]
        del rt
        llm.shutdown()  # the peer gets the device memory
        _free(device)
        failed = {run.task_ids.get(f.request_id) for f in agg.failures}
        served = [w for w in reqs if w.task_id not in failed]
        if len(served) < len(reqs):
            log(f"peer hf: skipping the {len(reqs) - len(served)} requests llmc could not serve")
        if served:
            result.peer = _run_peer(settings, engine, served, device, limit, log)
    return BenchOutcome(result, run, llm)


def runtime_config(llm: Served) -> dict[str, Any]:
    """The run's runtime settings and what was loaded (``config.runtime`` of the result)."""
    return {**dataclasses.asdict(llm.config), **llm.summary()}


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _run_peer(
    settings: BenchSettings,
    engine: Any,
    reqs: list[WorkloadRequest],
    device: str,
    max_batch_size: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    from llmc.runtime.bench.peer_hf import run_peer

    arr = settings.arrival
    size = settings.peer_batch_size or (
        arr.concurrency if arr.mode == "concurrency" else min(max_batch_size, len(reqs))
    )
    log(f"peer hf: {len(reqs)} requests in static batches of {size} on {device}")
    peer = run_peer(
        engine,
        reqs,
        device=device,
        batch_size=int(size or 1),
        cache=settings.peer_cache,
        arrival_offsets=arrival_offsets(len(reqs), arr),
        log=log,
    )
    agg = aggregate(
        peer.requests, [], percentiles=settings.percentiles, window=(peer.start, peer.end)
    )
    run = WorkloadRun(
        peer.requests, [], {i: r.task_id for i, r in enumerate(reqs)}, peer.start, peer.end
    )
    _free(device)
    return {
        "name": "hf",
        "config": peer.config,
        "aggregates": agg.to_dict(),
        "requests": request_rows(run),
    }
