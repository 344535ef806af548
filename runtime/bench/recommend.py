"""Tuning recommendations from an observed run: max_num_tokens, KV pool, max_batch_size,
and (CUDA) whether host work is hidden behind the GPU.

Answers the seeds' tuning advice ("profile the peak KV-cache use first, then size the
pool") with observed numbers. Semantics follow TensorRT-LLM, not the seeds' looser wording:

- ``max_num_tokens`` is the *per-step token budget* (prefill chunk + decode tokens of one
  step); it sizes the activation workspace. It is not the KV pool size.
- The *KV pool* is its own setting: ``max_kv_tokens`` (absolute) or
  ``kv_cache_free_gpu_mem_fraction`` (share of free memory after weights and workspace).
- ``max_batch_size`` caps the running batch (requests in one step).

Each recommendation says which setting it is, what was observed, the suggested value and
why. Nothing is suggested from missing data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from llmc.compiler.limits import EngineLimits
from llmc.runtime.bench.gpu_idle import GpuIdle
from llmc.runtime.bench.metrics import Aggregates
from llmc.runtime.records import RequestRecord


@dataclass(frozen=True)
class Recommendation:
    setting: str
    meaning: str
    current: str
    observed: str
    suggested: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TuningInputs:
    """The limits the run used and the shape of its workload."""

    limits: EngineLimits
    """The run's limits (max_num_tokens, max_batch_size, tokens_per_block, max_seq_len: the
    runtime refuses a KV pool that cannot hold one max_seq_len request, so a suggested pool
    is never smaller)."""
    build_limits: EngineLimits
    """The engine's own limits (a suggestion above them needs a rebuild)."""
    max_kv_tokens: int | None
    kv_cache_free_gpu_mem_fraction: float | None
    max_request_tokens: int
    """Longest prompt + output of the workload."""
    max_prompt_tokens: int
    max_in_flight: int
    """Most requests the workload can have in flight (num_requests offline, or N)."""
    kv_bytes_per_token: int | None = None
    workspace_bytes: int | None = None
    """Activation workspace at the build's max_num_tokens."""
    gpu_decode_idle_share: float | None = None
    """GPU idle share over the decode-only stretch (``llmc.runtime.bench.gpu_idle``; CUDA only)."""
    cuda_graphs: bool | None = None
    async_scheduling: bool | None = None

    @classmethod
    def from_run(
        cls,
        limits: EngineLimits,
        build_limits: EngineLimits,
        engine: dict[str, Any],
        runtime: dict[str, Any],
        requests: Sequence[RequestRecord],
        *,
        max_in_flight: int | None = None,
        idle: GpuIdle | None = None,
    ) -> TuningInputs:
        """The inputs of one observed run: its limits and the engine's; ``engine`` and
        ``runtime`` are the bench result's ``config.engine`` / ``config.runtime`` dicts (memory
        plan; pool settings and switches), ``requests`` the run's records, ``max_in_flight``
        the most requests the workload could have in flight (None: all of ``requests``)."""
        return cls(
            limits=limits,
            build_limits=build_limits,
            max_kv_tokens=runtime.get("max_kv_tokens"),
            kv_cache_free_gpu_mem_fraction=runtime.get("kv_cache_free_gpu_mem_fraction"),
            max_request_tokens=max(
                (r.num_prompt_tokens + r.num_output_tokens for r in requests), default=1
            ),
            max_prompt_tokens=max((r.num_prompt_tokens for r in requests), default=0) or 1,
            max_in_flight=max(1, len(requests) if max_in_flight is None else max_in_flight),
            kv_bytes_per_token=engine.get("kv_bytes_per_token"),
            workspace_bytes=engine.get("workspace_bytes"),
            gpu_decode_idle_share=idle.decode_idle_share if idle is not None else None,
            cuda_graphs=runtime.get("cuda_graphs"),
            async_scheduling=runtime.get("async_scheduling"),
        )


def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


MNT_MEANING = "per-step token budget (prefill chunk + decode tokens); sizes the workspace"
KV_MEANING = "KV-cache pool (max_kv_tokens or kv_cache_free_gpu_mem_fraction)"
MBS_MEANING = "most requests in one step (running batch)"


def _max_num_tokens(agg: Aggregates, t: TuningInputs, peak: int) -> Recommendation:
    m = t.limits.max_num_tokens
    observed = f"peak {peak:,} tokens in one step, mean {agg.mean_tokens_per_step or 0:,.1f}"
    want = _round_up(t.max_prompt_tokens + (agg.peak_batch_size or 0), 64)
    if peak >= m and want > m:
        suggested = min(want, t.build_limits.max_num_tokens)
        rebuild = (
            f"; the engine was built for {t.build_limits.max_num_tokens:,}: rebuild with "
            f"`llmc build --max_num_tokens {want}` to go higher"
            if want > t.build_limits.max_num_tokens
            else ""
        )
        reason = (
            f"steps filled the budget ({peak:,} of {m:,}) and the longest prompt "
            f"({t.max_prompt_tokens:,}) plus the peak decode batch needs {want:,}: prompts were "
            f"split into chunks over several steps. {want:,} finishes a prompt in one step "
            f"(fewer prefill steps, lower TTFT) at the cost of a larger activation "
            f"workspace{rebuild}. This does not change the KV pool."
        )
        return Recommendation(
            "max_num_tokens", MNT_MEANING, f"{m:,}", observed, f"{suggested:,}", reason
        )
    if peak >= m:
        reason = (
            f"steps filled the budget ({peak:,} of {m:,}) because several waiting prompts were "
            f"packed into one step, but every prompt plus the decode batch fits in {m:,} "
            f"tokens, so no prompt waited on chunking. A larger budget packs more prefill per "
            f"step (throughput on a GPU) at the cost of workspace memory and longer steps that "
            f"stall decoding requests (inter-token latency); keep it unless TTFT under bursts "
            f"matters more. This does not change the KV pool."
        )
        return Recommendation("max_num_tokens", MNT_MEANING, f"{m:,}", observed, "keep", reason)
    suggested = max(_round_up(peak, 64), t.limits.tokens_per_block)
    saved = ""
    if t.workspace_bytes:
        saved = (
            f" (workspace ≈ {_mib(t.workspace_bytes * suggested / t.build_limits.max_num_tokens)} "
            f"instead of {_mib(t.workspace_bytes)}, memory the KV pool can use)"
        )
    reason = (
        f"the budget never limited a step: the peak was {peak:,} of {m:,} tokens; {suggested:,} "
        f"covers this workload's peak{saved}. Keep {m:,} if other workloads have longer "
        f"prompts. This is the step budget, not the KV pool size."
    )
    return Recommendation(
        "max_num_tokens", MNT_MEANING, f"{m:,}", observed, f"{suggested:,}", reason
    )


def _kv_pool(agg: Aggregates, t: TuningInputs, used: int, total: int) -> Recommendation:
    b = t.limits.tokens_per_block
    current = (
        f"max_kv_tokens={t.max_kv_tokens:,}"
        if t.max_kv_tokens
        else f"kv_cache_free_gpu_mem_fraction={t.kv_cache_free_gpu_mem_fraction}"
    ) + f" → {total:,} blocks = {total * b:,} tokens"
    observed = (
        f"peak {used:,} of {total:,} blocks ({used / total:.0%}), mean "
        f"{(agg.kv_mean_utilization or 0):.0%}, {agg.num_preemptions} preemptions"
    )
    per_request = math.ceil(t.max_request_tokens / b)
    demand = min(t.limits.max_batch_size, t.max_in_flight) * per_request
    if agg.num_preemptions > 0 or used >= total:
        tokens = max(demand, total + 1) * b
        frac = ""
        if not t.max_kv_tokens and t.kv_cache_free_gpu_mem_fraction:
            f = min(1.0, t.kv_cache_free_gpu_mem_fraction * tokens / (total * b))
            frac = f" (or kv_cache_free_gpu_mem_fraction ≈ {f:.2f}, if memory allows)"
        reason = (
            f"the pool ran full ({used:,}/{total:,} blocks, {agg.num_preemptions} preemptions): "
            f"requests waited or were recomputed for KV space. {tokens:,} tokens hold "
            f"{min(t.limits.max_batch_size, t.max_in_flight)} requests of the longest length "
            f"({t.max_request_tokens:,} tokens = {per_request} blocks){frac}."
        )
        return Recommendation(
            "KV pool", KV_MEANING, current, observed, f"max_kv_tokens={tokens:,}", reason
        )
    if used / total < 0.5:
        tokens = _round_up(min(used * 1.2, max(demand, used)) * b, b)
        floor = ""
        max_seq_len = t.limits.max_seq_len
        if tokens < max_seq_len:
            tokens = _round_up(max_seq_len, b)
            floor = (
                f" (the floor: one request of the engine's max_seq_len={max_seq_len:,} must "
                f"fit; rebuild with a smaller --max_seq_len to go lower)"
            )
        if tokens >= total * b:
            return Recommendation(
                "KV pool", KV_MEANING, current, observed, "keep",
                f"peak use was {used / total:.0%} of the pool, but the pool is already the "
                f"smallest that holds one max_seq_len request; keep it.",
            )  # fmt: skip
        freed = ""
        if t.kv_bytes_per_token:
            freed = f", freeing {_mib((total * b - tokens) * t.kv_bytes_per_token)}"
        reason = (
            f"peak use was {used / total:.0%} of the pool with no preemptions; "
            f"{tokens:,} tokens hold this workload's peak with 20% headroom{floor}{freed}. "
            "Only worth "
            f"it when something else needs the memory (another engine, larger max_num_tokens)."
        )
        return Recommendation(
            "KV pool", KV_MEANING, current, observed, f"max_kv_tokens={tokens:,}", reason
        )
    reason = (
        f"the pool fits this workload: peak {used / total:.0%} with no preemptions and "
        f"headroom for bursts; keep it."
    )
    return Recommendation("KV pool", KV_MEANING, current, observed, "keep", reason)


def _max_batch_size(agg: Aggregates, t: TuningInputs, peak: int) -> Recommendation:
    m = t.limits.max_batch_size
    observed = f"peak {peak} requests in a step, mean {(agg.mean_batch_size or 0):.1f}"
    kv_bound = agg.num_preemptions > 0 or (
        agg.kv_peak_blocks_used is not None
        and agg.kv_blocks_total
        and agg.kv_peak_blocks_used >= 0.9 * agg.kv_blocks_total
    )
    if peak >= m and t.max_in_flight > m:
        if kv_bound:
            reason = (
                f"the batch reached its cap ({m}) while the KV pool was also full: raise the KV "
                f"pool first; a larger batch would only preempt more."
            )
            return Recommendation("max_batch_size", MBS_MEANING, str(m), observed, "keep", reason)
        fit = (agg.kv_blocks_total or 0) // max(
            1, math.ceil(t.max_request_tokens / t.limits.tokens_per_block)
        )
        want = max(m + 1, min(t.max_in_flight, fit))
        rebuild = (
            f" (above the engine's {t.build_limits.max_batch_size}: rebuild with "
            f"`llmc build --max_batch_size {want}`)"
            if want > t.build_limits.max_batch_size
            else ""
        )
        reason = (
            f"the batch cap bound before the KV pool did (peak {peak} = max_batch_size, KV "
            f"peak {(agg.kv_peak_utilization or 0):.0%}); the pool holds {fit} requests of the "
            f"longest length, so {want} lets more requests decode per step{rebuild}."
        )
        return Recommendation("max_batch_size", MBS_MEANING, str(m), observed, str(want), reason)
    limit = (
        "the workload's in-flight requests"
        if t.max_in_flight <= peak
        else ("the KV pool" if kv_bound else "the token budget and arrivals")
    )
    suggested = 1 << max(0, (peak - 1).bit_length())
    reason = (
        f"never more than {peak} of {m} requests ran at once (limited by {limit}); "
        f"{min(suggested, m)} covers this workload (fewer CUDA-graph batch buckets and smaller "
        f"sampling buffers); keep {m} for heavier loads."
    )
    return Recommendation(
        "max_batch_size", MBS_MEANING, str(m), observed, str(min(suggested, m)), reason
    )


OVERLAP_MEANING = "host work hidden behind the GPU (CUDA graphs, async scheduling)"
IDLE_OK = 0.05  # GPU idle share of the decode-only stretch that counts as hidden host work


def _host_overlap(agg: Aggregates, t: TuningInputs, idle: float) -> Recommendation:
    flags = f"cuda_graphs={t.cuda_graphs}, async_scheduling={t.async_scheduling}"
    observed = f"GPU idle {idle:.1%} of the decode-only stretch"
    setting = "cuda_graphs / async_scheduling"
    if idle < IDLE_OK:
        reason = (
            f"the GPU waited for the host under {IDLE_OK:.0%} of the decode-only time: "
            "scheduling, input preparation and launches are hidden behind the GPU steps"
        )
        return Recommendation(setting, OVERLAP_MEANING, flags, observed, "keep", reason)
    if t.cuda_graphs is False:
        reason = (
            "decode steps launch every kernel from the host; replaying one CUDA graph per "
            "step removes most of that launch time (batch 1 on the H200: 145 → 222 tok/s)"
        )
        return Recommendation(setting, OVERLAP_MEANING, flags, observed, "--cuda_graphs", reason)
    if t.async_scheduling is False:
        reason = (
            "the host schedules and prepares step N+1 only after step N's tokens are back; "
            "async scheduling does it while step N runs on the GPU"
        )
        return Recommendation(
            setting, OVERLAP_MEANING, flags, observed, "--async_scheduling", reason
        )
    reason = (
        "host-bound with graphs and async scheduling on: the host's per-request work each "
        "step (scheduling, input preparation, token bookkeeping) takes longer than the GPU "
        f"step at a running batch of {agg.mean_batch_size or 0:,.0f}, so throughput will "
        "not grow with max_batch_size; it grows with per-request GPU work (longer contexts, "
        "a larger model)"
    )
    return Recommendation(setting, OVERLAP_MEANING, flags, observed, "keep (host-bound)", reason)


def recommend(agg: Aggregates, t: TuningInputs) -> list[Recommendation]:
    """Recommendations for max_num_tokens, the KV pool, max_batch_size and host overlap.

    Nothing is suggested from missing data: each rule runs only when the peak it reads was
    observed (no steps: no budget, pool or batch advice; no kernel timing: no overlap)."""
    out = []
    if agg.peak_tokens_per_step is not None:
        out.append(_max_num_tokens(agg, t, agg.peak_tokens_per_step))
    if agg.kv_peak_blocks_used is not None and agg.kv_blocks_total:
        out.append(_kv_pool(agg, t, agg.kv_peak_blocks_used, agg.kv_blocks_total))
    if agg.peak_batch_size is not None:
        out.append(_max_batch_size(agg, t, agg.peak_batch_size))
    if t.gpu_decode_idle_share is not None:
        out.append(_host_overlap(agg, t, t.gpu_decode_idle_share))
    return out
