"""Workload generation: lengths, determinism, dataset parsing, arrival schedules."""

from __future__ import annotations

import json
import statistics

import pytest

from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.bench.workload import (
    ArrivalSpec,
    BenchSampling,
    SyntheticSpec,
    WorkloadRequest,
    arrival_offsets,
    is_sharegpt,
    load_dataset,
    synthetic_workload,
    write_dataset,
)
from llmc.runtime.types import SamplingParams


def test_exact_lengths_without_stdev() -> None:
    w = synthetic_workload(SyntheticSpec(num_requests=5, isl=7, osl=3, seed=1), vocab_size=50)
    assert [r.input_len for r in w] == [7] * 5 and [r.output_tokens for r in w] == [3] * 5
    assert all(0 <= t < 50 for r in w for t in r.prompt_token_ids)
    assert len({r.prompt_token_ids for r in w}) == 5  # random, not repeated


@pytest.mark.parametrize("dist", ["normal", "uniform"])
def test_length_distribution_moments(dist: str) -> None:
    spec = SyntheticSpec(2000, isl=200, osl=100, isl_stdev=20, osl_stdev=10, distribution=dist)
    w = synthetic_workload(spec, vocab_size=10)
    isls = [r.input_len for r in w]
    osls = [r.output_tokens for r in w]
    assert statistics.mean(isls) == pytest.approx(200, abs=2)
    assert statistics.pstdev(isls) == pytest.approx(20, rel=0.08)
    assert statistics.pstdev(osls) == pytest.approx(10, rel=0.08)
    if dist == "uniform":  # bounded by mean ± sqrt(3)·stdev
        assert 165 <= min(isls) and max(isls) <= 235


def test_seed_determinism_and_min_length() -> None:
    spec = SyntheticSpec(50, isl=2, osl=2, isl_stdev=5, osl_stdev=5, seed=3)
    a, b = synthetic_workload(spec, 100), synthetic_workload(spec, 100)
    assert a == b
    assert min(r.input_len for r in a) >= 1 and min(r.output_tokens for r in a) >= 1
    c = synthetic_workload(SyntheticSpec(50, isl=2, osl=2, isl_stdev=5, seed=4), 100)
    assert a != c


def test_bad_specs() -> None:
    with pytest.raises(ConfigError, match="isl"):
        SyntheticSpec(isl=0)
    with pytest.raises(ConfigError, match="distribution"):
        SyntheticSpec(distribution="zipf")
    with pytest.raises(ConfigError, match="osl_stdev"):
        SyntheticSpec(osl_stdev=-1)
    with pytest.raises(UsageError, match="exclusive"):
        ArrivalSpec.from_flags(concurrency=2, request_rate=1.0)
    with pytest.raises(ConfigError, match="request_rate"):
        ArrivalSpec("request_rate", request_rate=0)
    with pytest.raises(ConfigError, match="burstiness"):
        ArrivalSpec.from_flags(None, 1.0, burstiness=0)


def test_dataset_round_trip_and_errors(tmp_path) -> None:
    reqs = [
        WorkloadRequest("a", 4, prompt_token_ids=(1, 2, 3)),
        WorkloadRequest("b", 2, prompt="hello"),
    ]
    path = tmp_path / "d.jsonl"
    write_dataset(path, reqs)
    assert load_dataset(path) == reqs
    assert load_dataset(path, num_requests=1) == reqs[:1]

    def bad(line: dict | str, match: str) -> None:
        p = tmp_path / "bad.jsonl"
        p.write_text("\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")
        with pytest.raises(UsageError, match=match):
            load_dataset(p, vocab_size=10)

    bad("{not json", r"bad.jsonl:2: not valid JSON")
    bad({"task_id": 1, "input_ids": [1], "output_tokens": 0}, "output_tokens")
    bad({"task_id": 1, "output_tokens": 3}, "exactly one of")
    bad({"input_ids": [1], "prompt": "x", "output_tokens": 3}, "exactly one of")
    bad({"input_ids": [11], "output_tokens": 3}, "outside the vocabulary")
    bad({"input_ids": [1], "output_tokens": 3, "logits": 1}, "unknown key")
    with pytest.raises(UsageError, match="does not exist"):
        load_dataset(tmp_path / "missing.jsonl")


def test_arrivals() -> None:
    assert arrival_offsets(3, ArrivalSpec()) is None
    for rate in (float("inf"), float("nan"), 0.0, -1.0):  # refused, never silently offline
        with pytest.raises(ConfigError, match="request_rate must be a finite number > 0"):
            ArrivalSpec.from_flags(None, rate)
    spec = ArrivalSpec.from_flags(None, 50.0, burstiness=1.0, seed=1)
    t = arrival_offsets(4000, spec)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:], strict=False))
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.06)
    # Poisson: coefficient of variation 1; burstiness 0.25 gives CV 2
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = arrival_offsets(4000, ArrivalSpec.from_flags(None, 50.0, burstiness=0.25))
    g2 = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.mean(g2) == pytest.approx(1 / 50, rel=0.1)
    assert statistics.pstdev(g2) / statistics.mean(g2) == pytest.approx(2.0, rel=0.15)
    assert arrival_offsets(10, spec) == arrival_offsets(10, spec)


def test_git_commit_named_by_llmc_commit(monkeypatch):
    """A copied tree whose .git is stale names its commit through LLMC_COMMIT."""
    from llmc.runtime.bench.benchmark import git_commit

    monkeypatch.setenv("LLMC_COMMIT", "abc123def456")
    assert git_commit() == "abc123def456"
    monkeypatch.delenv("LLMC_COMMIT")
    assert git_commit() != "abc123def456"


def _conv(prompt: str, reply: str, **extra) -> dict:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]
    return {"conversations": turns, **extra}


def test_sharegpt_is_read_as_vllm_reads_it(tmp_path) -> None:
    def encode(text: str) -> list[int]:  # one id per character
        return [ord(c) % 200 for c in text]

    data = [
        _conv("p" * 10, "r" * 6, id="keep"),
        _conv("p" * 3, "r" * 9, id="prompt too short"),
        _conv("p" * 9, "r" * 2, id="reply too short"),
        _conv("p" * 60, "r" * 6, id="over max_input_len"),
        _conv("p" * 40, "r" * 40, id="over max_seq_len"),
        {"conversations": [{"from": "human", "value": "one turn"}]},
        _conv("q" * 8, "s" * 5, id="keep too"),
    ]
    path = tmp_path / "sg.json"
    path.write_text("\n  " + json.dumps(data))
    assert is_sharegpt(path)
    reqs = load_dataset(path, encode=encode, limits=(50, 64))
    assert sorted(r.task_id for r in reqs) == ["keep", "keep too"]
    keep = next(r for r in reqs if r.task_id == "keep")
    assert keep.output_tokens == 6 and keep.prompt_token_ids == tuple(encode("p" * 10))
    assert len(load_dataset(path, 1, encode=encode, limits=(50, 64))) == 1
    orders = {tuple(r.task_id for r in load_dataset(path, encode=encode, seed=s)) for s in range(6)}
    assert len(orders) > 1  # shuffled by the seed, as vLLM does
    assert [r.task_id for r in load_dataset(path, encode=encode, seed=4)] == [
        r.task_id for r in load_dataset(path, encode=encode, seed=4)
    ]


@pytest.mark.parametrize(
    "content,needle",
    [
        ('{"a": 1}', "task_id"),  # a JSON object is JSONL, whose keys are checked
        ("[1, 2]", "no 'conversations' list"),
        ('[{"conversations": [{"value": 3}, {"value": "x"}]}]', "text 'value'"),
        ('[{"conversations": []}]', "no conversation within"),
        ("[not json", "not valid JSON"),
    ],
)
def test_sharegpt_errors_name_the_file(tmp_path, content, needle) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=needle):
        load_dataset(path, encode=lambda t: [1] * len(t))


def test_sharegpt_needs_a_tokenizer(tmp_path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([_conv("hello there", "general kenobi")]))
    with pytest.raises(UsageError, match="tokenizer"):
        load_dataset(path)


def test_bench_sampling_shares_one_params_object_per_output_length() -> None:
    how = BenchSampling(temperature=0.7, top_p=0.9)
    a, b, c = how.params(128), how.params(128), how.params(64)
    assert a is b and a is not c
    assert a == SamplingParams(max_new_tokens=128, temperature=0.7, top_p=0.9, ignore_eos=True)
    assert c.max_new_tokens == 64 and BenchSampling().params(128).temperature == 0.0
