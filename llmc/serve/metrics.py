"""``/metrics``: the server's Prometheus metrics (``prometheus-client``, its own registry).

Counted by the server as requests go: requests routed to each replica, requests by model
and outcome (``success``,
``cancelled`` — the client left —, ``client_error`` — 4xx —, ``rejected`` — 503 —,
``server_error`` — 5xx), prompt and generated tokens, and the latency histograms seen from
the HTTP side: time to first token and inter-token latency (streamed requests: a
non-streamed one has no tokens before its end), end-to-end latency (every served request),
and where a streamed request's time to first token went (``llmc_first_token_stage_seconds``,
label ``stage``: ``admit`` = HTTP arrival → the engine's enqueue (body, validation, plan),
``queue`` = enqueue → first scheduled step, ``compute`` = that step → the first token on the
host (the engine's own records), ``deliver`` = that token → its chunk written by the event
loop (the engine thread's post and the loop hop); the four add up to arrival → first chunk sent).

Read from each replica at scrape time (``ReplicaCollector``, through ``llmc.LLM``'s
``scheduler_stats`` and ``kv_stats``): running and waiting requests, KV blocks used and
total and their ratio, preemptions and prefix-cache hits (full blocks reused) since start,
and the server's unfinished requests per replica. Labels: ``model`` and ``replica`` (its
index under the model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

OUTCOMES = ("success", "cancelled", "client_error", "rejected", "server_error")
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
FIRST_TOKEN_STAGES = ("admit", "queue", "compute", "deliver")
STAGE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01,
    0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def outcome_of(status: int) -> str:
    if status < 400:
        return "success"
    if status == 503:
        return "rejected"
    return "client_error" if status < 500 else "server_error"


class ReplicaCollector(Collector):
    """Gauges and counters read from the replicas when ``/metrics`` is scraped."""

    def __init__(self, replicas: Callable[[], Iterable[Any]]) -> None:
        self._replicas = replicas

    FAMILIES = (
        (GaugeMetricFamily, "llmc_requests_running", "Requests in the running batch."),
        (GaugeMetricFamily, "llmc_requests_waiting", "Requests waiting to be scheduled."),
        (GaugeMetricFamily, "llmc_server_requests_unfinished",
         "Engine requests the server submitted and the engine has not finished."),
        (GaugeMetricFamily, "llmc_kv_cache_blocks_used", "KV-cache blocks in use."),
        (GaugeMetricFamily, "llmc_kv_cache_blocks_total", "KV-cache blocks in the pool."),
        (GaugeMetricFamily, "llmc_kv_cache_usage_ratio", "KV-cache blocks used / total."),
        (CounterMetricFamily, "llmc_preemptions", "Sequences preempted (recomputed later)."),
        (CounterMetricFamily, "llmc_prefix_cache_hits",
         "Full KV blocks reused from the prefix cache."),
        (CounterMetricFamily, "llmc_prefix_cache_queries",
         "Full KV blocks looked up in the prefix cache."),
    )  # fmt: skip

    def collect(self) -> Iterable[Any]:
        labels = ["model", "replica"]
        families = [kind(name, doc, labels=labels) for kind, name, doc in self.FAMILIES]
        for r in self._replicas():
            stats = r.stats()
            if stats is None:
                continue
            sched, kv = stats
            values = (
                sched.num_running,
                sched.num_waiting,
                r.load,
                kv.used_blocks,
                kv.total_blocks,
                kv.used_blocks / kv.total_blocks if kv.total_blocks else 0.0,
                sched.num_preemptions,
                kv.reuse_hits,
                kv.reuse_hits + kv.reuse_misses,
            )
            for family, value in zip(families, values, strict=True):
                family.add_metric([r.model, str(r.index)], value)
        yield from families


@dataclass(frozen=True)
class ModelMetrics:
    """One model's labelled histograms and counters."""

    ttft: Any
    itl: Any
    e2e: Any
    stages: tuple[Any, ...]
    """``first_token_stage`` children, in ``FIRST_TOKEN_STAGES`` order."""
    prompt_tokens: Any
    generation_tokens: Any


class ServerMetrics:
    """The server's metrics, in a registry of their own (several servers in one process,
    as the tests make, do not share counters)."""

    def __init__(self, replicas: Callable[[], Iterable[Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "llmc_requests", "HTTP requests by model and outcome.", ["model", "outcome"],
            registry=reg,
        )  # fmt: skip
        self.routed = Counter(
            "llmc_replica_requests", "HTTP requests routed to each replica.",
            ["model", "replica"], registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "llmc_prompt_tokens", "Prompt tokens of served requests.", ["model"], registry=reg
        )
        self.generation_tokens = Counter(
            "llmc_generation_tokens", "Generated tokens.", ["model"], registry=reg
        )
        self.ttft = Histogram(
            "llmc_time_to_first_token_seconds", "Request arrival to its first streamed token.",
            ["model"], buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.itl = Histogram(
            "llmc_inter_token_latency_seconds", "Gap between consecutive streamed tokens.",
            ["model"], buckets=ITL_BUCKETS, registry=reg,
        )  # fmt: skip
        self.e2e = Histogram(
            "llmc_e2e_request_latency_seconds", "Request arrival to its last byte.",
            ["model"], buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.first_token_stage = Histogram(
            "llmc_first_token_stage_seconds",
            "A streamed request's time to first token, by stage (admit, queue, compute, "
            "deliver).", ["model", "stage"], buckets=STAGE_BUCKETS, registry=reg,
        )  # fmt: skip
        reg.register(ReplicaCollector(replicas))
        self._models: dict[str, ModelMetrics] = {}

    def of_model(self, model: str) -> ModelMetrics:
        """The per-model children, looked up once per model (``labels()`` costs a lock and
        a dict lookup: not per token)."""
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(
                self.ttft.labels(model),
                self.itl.labels(model),
                self.e2e.labels(model),
                tuple(self.first_token_stage.labels(model, s) for s in FIRST_TOKEN_STAGES),
                self.prompt_tokens.labels(model),
                self.generation_tokens.labels(model),
            )
        return m

    def outcome(self, model: str, outcome: str) -> None:
        self.requests.labels(model, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
