"""`llmc bench --temperature/--top_p/--top_k`: sampled benchmark requests, recorded in the
result, bad values refused with exit code 2 naming the flag, greedy-only drivers refusing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers.engines import SMALL_LIMITS
from llmc.base.errors import UsageError
from llmc.cli.main import app
from llmc.runtime.bench.workload import BenchSampling

pytestmark = pytest.mark.usefixtures("small_ceilings")

runner = CliRunner()


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir) -> Path:
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)


def bench(engine: Path, *args: str) -> tuple[int, str, str]:
    res = runner.invoke(
        app, ["bench", "--engine_dir", str(engine), "--device", "cpu", "--seed", "1", *args]
    )
    return res.exit_code, res.stdout, res.stderr


def test_sampled_requests_are_recorded_and_exact_length(engine, tmp_path) -> None:
    out = tmp_path / "s.json"
    code, _, stderr = bench(
        engine, "--num_requests", "4", "--isl", "10", "--osl", "6", "--warmup", "0",
        "--temperature", "0.7", "--top_p", "0.9", "--top_k", "20", "--json", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    r = json.loads(out.read_text())
    assert r["config"]["workload"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    assert r["aggregates"]["num_completed"] == 4
    assert r["aggregates"]["total_output_tokens"] == 4 * 6


def test_greedy_by_default_in_the_result(engine, tmp_path) -> None:
    out = tmp_path / "g.json"
    code, _, stderr = bench(
        engine, "--num_requests", "2", "--isl", "8", "--osl", "3", "--warmup", "0",
        "--json", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    sampling = json.loads(out.read_text())["config"]["workload"]["sampling"]
    assert sampling == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


@pytest.mark.parametrize(
    "args,word",
    [
        (("--top_p", "1.5", "--temperature", "1"), "top_p"),
        (("--temperature", "-1"), "temperature"),
        (("--top_k", "-3", "--temperature", "1"), "top_k"),
        (("--temperature", "0.7", "--peer", "hf"), "--peer"),
    ],
)
def test_bad_sampling_flags_exit_2_naming_them(engine, args, word) -> None:
    code, _, stderr = bench(engine, "--num_requests", "2", "--isl", "8", "--osl", "3", *args)
    assert code == 2, stderr
    assert word in stderr and "Traceback" not in stderr


def test_bench_sampling_params() -> None:
    p = BenchSampling(temperature=0.7, top_p=0.9).params(17)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.ignore_eos) == (
        0.7, 0.9, 0, 17, True,
    )  # fmt: skip
    assert BenchSampling().is_greedy and not BenchSampling(temperature=0.5).is_greedy
    with pytest.raises(UsageError, match="top_p"):
        BenchSampling(temperature=1.0, top_p=0.0)
