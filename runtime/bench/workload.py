"""Benchmark workloads: which requests to send, and when.

Requests come from a synthetic generator (random token ids, input/output lengths drawn
from a normal or uniform distribution with a given mean and standard deviation, seeded) or
from a dataset file: trtllm-bench's JSONL form, one request per line::

    {"task_id": 0, "prompt": "text ...", "output_tokens": 128}
    {"task_id": 1, "input_ids": [1, 2, 3], "output_tokens": 64}

or a ShareGPT JSON file (a JSON array, as vLLM's ``bench`` reads it: each entry's first
turn is the prompt, the second's token count the output length; entries with fewer than two
turns are skipped, the rest shuffled with the seed, and pairs with a prompt or reply under
4 tokens, a prompt over 1,024 tokens or a total over 2,048 — or over the engine's
max_input_len / max_seq_len when smaller — are skipped). A file whose first non-blank
character is ``[`` is ShareGPT, anything else JSONL.

Arrival modes: ``offline`` (every request at t=0), ``concurrency`` (closed loop: N requests
in flight, a new one enters when one finishes) and ``request_rate`` (open loop: gamma
inter-arrival times with mean 1/R; burstiness 1 is a Poisson process, lower is burstier).

Invariants: the same seed gives the same workload and the same arrival times; every length
is >= 1; a dataset error names the file and line.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.base.errors import ConfigError, RequestError, UsageError
from llmc.runtime.types import SamplingParams

DISTRIBUTIONS = ("normal", "uniform")
ARRIVAL_MODES = ("offline", "concurrency", "request_rate")


@dataclass(frozen=True)
class WorkloadRequest:
    """One benchmark request: prompt token ids (or text) and an exact output length."""

    task_id: str
    output_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None

    @property
    def input_len(self) -> int | None:
        """Prompt length in tokens, or None for text prompts (known after tokenizing)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else None


@dataclass(frozen=True)
class BenchSampling:
    """The sampling of every benchmark request: greedy unless asked (``llmc bench
    --temperature 0.7 --top_p 0.9``), ``n`` samples each (sharing the prompt's KV blocks) or
    a beam search of ``beam_width`` beams (its best beam returned); ``ignore_eos`` and
    ``max_new_tokens`` stay the workload's (exact output lengths); seeds are the requests'
    derived ones."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    beam_width: int = 1

    def __post_init__(self) -> None:
        try:
            self.params(1)
        except RequestError as e:
            raise ConfigError(f"benchmark sampling: {e}") from None

    @property
    def is_greedy(self) -> bool:
        """One greedy output per request (what --peer and --url compare)."""
        return self.temperature == 0.0 and self.n == 1 and self.beam_width == 1

    def params(self, max_new_tokens: int) -> SamplingParams:
        """One request's SamplingParams (validated there: beam search is greedy), shared by
        the requests of one output length as ``LLM.generate`` callers share theirs (a
        SamplingParams is frozen; building and validating one per request was half of a
        benchmark request's intake)."""
        return _bench_params(self, max_new_tokens)


@functools.lru_cache(maxsize=4096)
def _bench_params(how: BenchSampling, max_new_tokens: int) -> SamplingParams:
    beams = {"use_beam_search": True, "beam_width": how.beam_width}
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=how.temperature,
        top_p=how.top_p,
        top_k=how.top_k,
        ignore_eos=True,
        n=how.n,
        **(beams if how.beam_width != 1 else {}),
    )


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of a synthetic workload."""

    num_requests: int = 100
    isl: int = 128
    osl: int = 128
    isl_stdev: float = 0.0
    osl_stdev: float = 0.0
    distribution: str = "normal"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "isl", "osl"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("isl_stdev", "osl_stdev"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name} must be >= 0, got {v!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(
                f"distribution {self.distribution!r} is not one of {', '.join(DISTRIBUTIONS)}"
            )


@dataclass(frozen=True)
class ArrivalSpec:
    """When requests enter: offline, closed-loop concurrency N, or open-loop rate R."""

    mode: str = "offline"
    concurrency: int | None = None
    request_rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ARRIVAL_MODES:
            raise ConfigError(f"arrival mode {self.mode!r} is not one of {ARRIVAL_MODES}")
        if self.mode == "concurrency" and (self.concurrency is None or self.concurrency < 1):
            raise ConfigError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        if self.mode == "request_rate":
            r = self.request_rate
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0 < r < math.inf):
                raise ConfigError(
                    f"request_rate must be a finite number > 0 requests/s, got {r!r} (leave "
                    "it out to run offline)"
                )
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ConfigError(f"burstiness must be > 0, got {self.burstiness!r}")

    @classmethod
    def from_flags(
        cls,
        concurrency: int | None,
        request_rate: float | None,
        burstiness: float = 1.0,
        seed: int = 0,
    ) -> ArrivalSpec:
        """--concurrency and --request_rate are exclusive; neither means offline."""
        if concurrency is not None and request_rate is not None:
            raise UsageError("--concurrency and --request_rate are exclusive; give one of them")
        if concurrency is not None:
            return cls("concurrency", concurrency=concurrency, burstiness=burstiness, seed=seed)
        if request_rate is not None:  # nan, inf and <= 0 are refused, never offline
            return cls("request_rate", request_rate=request_rate, burstiness=burstiness, seed=seed)
        return cls("offline", burstiness=burstiness, seed=seed)

    def describe(self) -> str:
        if self.mode == "concurrency":
            return f"closed loop, concurrency {self.concurrency}"
        if self.mode == "request_rate":
            return f"{self.request_rate:g} req/s (gamma arrivals, burstiness {self.burstiness:g})"
        return "offline (all requests at once)"


def sample_lengths(
    rng: random.Random, n: int, mean: int, stdev: float, distribution: str
) -> list[int]:
    """``n`` integer lengths >= 1 with the given mean and standard deviation.

    ``uniform`` spans mean ± sqrt(3)·stdev, the uniform distribution with that stdev.
    """
    if stdev == 0:
        return [mean] * n
    if distribution == "normal":
        return [max(1, round(rng.gauss(mean, stdev))) for _ in range(n)]
    half = math.sqrt(3.0) * stdev
    return [max(1, round(rng.uniform(mean - half, mean + half))) for _ in range(n)]


def synthetic_workload(spec: SyntheticSpec, vocab_size: int) -> list[WorkloadRequest]:
    """Random-token requests; the same spec and vocab give the same requests."""
    if vocab_size < 1:
        raise ConfigError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(spec.seed)
    isls = sample_lengths(rng, spec.num_requests, spec.isl, spec.isl_stdev, spec.distribution)
    osls = sample_lengths(rng, spec.num_requests, spec.osl, spec.osl_stdev, spec.distribution)
    return [
        WorkloadRequest(
            task_id=str(i),
            output_tokens=osl,
            prompt_token_ids=tuple(rng.randrange(vocab_size) for _ in range(isl)),
        )
        for i, (isl, osl) in enumerate(zip(isls, osls, strict=True))
    ]


def _parse_line(obj: Any, where: str, vocab_size: int | None) -> WorkloadRequest:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    known = {"task_id", "prompt", "input_ids", "output_tokens"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {unknown}; expected {sorted(known)}")
    out = obj.get("output_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise UsageError(f"{where}: output_tokens must be an integer >= 1, got {out!r}")
    prompt, ids = obj.get("prompt"), obj.get("input_ids")
    if (prompt is None) == (ids is None):
        raise UsageError(f"{where}: give exactly one of 'prompt' and 'input_ids'")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise UsageError(f"{where}: prompt must be a non-empty string")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise UsageError(f"{where}: input_ids must be a non-empty list of token ids")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise UsageError(f"{where}: input_ids holds {t!r}, not a token id")
            if vocab_size is not None and t >= vocab_size:
                raise UsageError(f"{where}: token id {t} is outside the vocabulary ({vocab_size})")
    task_id = obj.get("task_id", where)
    return WorkloadRequest(
        task_id=str(task_id),
        output_tokens=out,
        prompt_token_ids=tuple(ids) if ids is not None else None,
        prompt=prompt,
    )


def is_sharegpt(path: str | Path) -> bool:
    """Whether a dataset file is ShareGPT JSON (its first non-blank character is ``[``)."""
    with Path(path).open("rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def load_dataset(
    path: str | Path,
    num_requests: int | None = None,
    vocab_size: int | None = None,
    *,
    encode: Callable[[str], list[int]] | None = None,
    seed: int = 0,
    limits: tuple[int, int] | None = None,
) -> list[WorkloadRequest]:
    """Read a dataset: trtllm-bench JSONL (blank lines skipped) or ShareGPT JSON (needs
    ``encode``, the engine's tokenizer; ``limits``: the engine's (max_input_len,
    max_seq_len) when known); the first ``num_requests``."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"dataset {str(p)!r} does not exist or is not a file")
    if is_sharegpt(p):
        return load_sharegpt(p, num_requests, encode, seed, limits)
    out: list[WorkloadRequest] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{where}: not valid JSON ({e.msg})") from None
            out.append(_parse_line(obj, where, vocab_size))
            if num_requests is not None and len(out) >= num_requests:
                break
    if not out:
        raise UsageError(f"dataset {str(p)!r} holds no requests")
    return out


SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048


def _sharegpt_pairs(data: Any, where: str) -> list[tuple[str, str, str]]:
    """(id, prompt, reply) of each entry with at least two turns."""
    if not isinstance(data, list):
        raise UsageError(f"{where}: a ShareGPT file is a JSON array of conversations")
    pairs = []
    for n, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise UsageError(f"{where}: entry {n} has no 'conversations' list")
        if len(turns) < 2:
            continue
        texts = []
        for turn in turns[:2]:
            value = turn.get("value") if isinstance(turn, dict) else None
            if not isinstance(value, str):
                raise UsageError(f"{where}: entry {n}: a turn without a text 'value'")
            texts.append(value)
        pairs.append((str(entry.get("id", n)), texts[0], texts[1]))
    return pairs


def load_sharegpt(
    path: Path,
    num_requests: int | None,
    encode: Callable[[str], list[int]] | None,
    seed: int = 0,
    limits: tuple[int, int] | None = None,
) -> list[WorkloadRequest]:
    """Requests from a ShareGPT JSON file (see the module docstring for the rules)."""
    where = str(path)
    if encode is None:
        raise UsageError(
            f"dataset {where!r} is ShareGPT: its output lengths are the replies' token counts, "
            "which need the engine's tokenizer (give --engine_dir or --tokenizer)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    pairs = _sharegpt_pairs(data, where)
    random.Random(seed).shuffle(pairs)
    max_prompt, max_total = SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL
    if limits is not None:
        max_prompt, max_total = min(max_prompt, limits[0]), min(max_total, limits[1])
    out: list[WorkloadRequest] = []
    for task_id, prompt, reply in pairs:
        if num_requests is not None and len(out) >= num_requests:
            break
        ids, n_out = encode(prompt), len(encode(reply))
        if len(ids) < SHAREGPT_MIN_TOKENS or n_out < SHAREGPT_MIN_TOKENS:
            continue
        if len(ids) > max_prompt or len(ids) + n_out > max_total:
            continue
        out.append(WorkloadRequest(task_id, n_out, tuple(ids), prompt))
    if not out:
        raise UsageError(f"dataset {where!r} holds no conversation within the length limits")
    return out


def write_dataset(path: str | Path, requests: list[WorkloadRequest]) -> None:
    """Write requests in the same JSONL form (e.g. to replay a synthetic workload)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, Any] = {"task_id": r.task_id}
            if r.prompt_token_ids is not None:
                obj["input_ids"] = list(r.prompt_token_ids)
            else:
                obj["prompt"] = r.prompt
            obj["output_tokens"] = r.output_tokens
            f.write(json.dumps(obj) + "\n")


def arrival_offsets(n: int, spec: ArrivalSpec) -> list[float] | None:
    """Seconds after the start at which each request arrives (request_rate mode).

    Gamma inter-arrival times with shape ``burstiness`` and mean ``1/request_rate``;
    the first request arrives at 0. None for offline and concurrency modes (no schedule).
    """
    if spec.mode != "request_rate":
        return None
    assert spec.request_rate is not None
    rng = random.Random(spec.seed + 0x5EED)
    theta = 1.0 / (spec.request_rate * spec.burstiness)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.gammavariate(spec.burstiness, theta)
        out.append(t)
    return out
