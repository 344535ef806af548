"""`llmc bench` / `llmc compare` on a tiny engine: JSON fields, failures, ratios, flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers.engines import SMALL_LIMITS
from llmc.base.errors import BenchFailure, ConfigError, UsageError
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


AGG_FIELDS = (
    "num_requests num_completed num_failed failures duration_s total_prompt_tokens "
    "total_output_tokens request_throughput output_tokens_per_s total_tokens_per_s ttft tpot "
    "itl e2e per_user_tokens_per_s num_steps busy_time_s kv_blocks_total kv_capacity_tokens "
    "kv_peak_blocks_used kv_peak_utilization kv_mean_utilization num_preemptions "
    "prefix_hit_rate mean_batch_size peak_batch_size mean_tokens_per_step "
    "peak_tokens_per_step percentiles"
).split()


def test_bench_writes_json_with_every_field(engine, tmp_path) -> None:
    out = tmp_path / "a.json"
    code, stdout, stderr = bench(
        engine, "--num_requests", "6", "--isl", "12", "--osl", "5", "--isl_stdev", "3",
        "--warmup", "1", "--percentiles", "50,90,99.9", "--json", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    for section in ("Engine and build config", "Workload", "Throughput", "Latency", "KV cache"):
        assert section in stdout
    assert "loading engine" in stderr and "loading engine" not in stdout
    r = json.loads(out.read_text())
    assert (r["schema"], r["schema_version"]) == ("llmc.bench", 1)
    for key in ("config", "environment", "ceilings", "aggregates", "achieved", "requests"):
        assert r[key] is not None, key
    assert r["peer"] is None and r["ratios"] == {}
    a = r["aggregates"]
    assert set(AGG_FIELDS) <= set(a)
    # every number a completed offline run must have is measured, not missing
    for k in AGG_FIELDS:
        if k not in ("failures", "prefix_hit_rate"):
            assert a[k] is not None, k
    assert a["num_requests"] == 6 and a["num_completed"] == 6 and a["num_failed"] == 0
    assert a["total_output_tokens"] == 30  # ignore_eos: exact lengths
    assert set(a["ttft"]["percentiles"]) == {"p50", "p90", "p99.9"}
    assert a["tpot"]["count"] == 6 and a["itl"]["count"] == 6 * 4
    assert a["kv_capacity_tokens"] == a["kv_blocks_total"] * 16
    assert a["peak_tokens_per_step"] <= 64 and a["peak_batch_size"] <= 8
    env = r["environment"]
    assert env["torch_version"] and env["llmc_version"] and env["device_name"]
    assert r["ceilings"]["copy_bandwidth_gb_s"] > 0 and r["ceilings"]["source"]
    assert r["achieved"]["weight_read_gb_s"] > 0 and r["achieved"]["mfu"] > 0
    assert r["config"]["workload"]["warmup"] == 1 and r["config"]["engine"]["num_layers"] == 2
    rows = r["requests"]
    assert len(rows) == 6 and all(row["num_output_tokens"] == 5 for row in rows)
    for row in rows:
        assert len(row["token_times"]) == 5 and row["ttft"] > 0 and row["error"] is None
        assert row["arrival_time"] <= row["first_token_time"] <= row["finish_time"]


def test_impossible_requests_fail_the_bench(engine, tmp_path) -> None:
    data = tmp_path / "d.jsonl"
    lines = [
        {"task_id": "ok1", "input_ids": [5, 6, 7], "output_tokens": 3},
        {"task_id": "too_long", "input_ids": [5] * 100, "output_tokens": 3},  # > max_input_len
        {"task_id": "ok2", "input_ids": [9, 10], "output_tokens": 4},
    ]
    data.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "f.json"
    code, stdout, stderr = bench(
        engine, "--dataset", str(data), "--warmup", "0", "--json", str(out)
    )
    assert code == BenchFailure.exit_code
    assert "1 of 3 requests failed" in stderr and "max_input_len" in stderr
    rid = json.loads(out.read_text())["aggregates"]["failures"][0]["request_id"]
    assert f"first: request {rid}: prompt" in " ".join(stderr.split())  # named once
    assert "Failed requests (1)" in stdout
    a = json.loads(out.read_text())["aggregates"]
    assert a["num_completed"] == 2 and a["num_failed"] == 1
    assert "100 tokens" in a["failures"][0]["reason"]
    # the rest were served and measured; a failure rate within the limit passes
    code, _, _ = bench(engine, "--dataset", str(data), "--warmup", "0", "--max_failure_rate", "0.5")
    assert code == 0


def test_compare_prints_ratios(engine, tmp_path) -> None:
    paths = []
    for name, conc in (("fast", "8"), ("slow", "1")):
        p = tmp_path / f"{name}.json"
        code, _, err = bench(engine, "--num_requests", "4", "--isl", "8", "--osl", "4",
                             "--concurrency", conc, "--json", str(p))  # fmt: skip
        assert code == 0, err
        paths.append(p)
    res = runner.invoke(app, ["compare", str(paths[0]), str(paths[1])])
    assert res.exit_code == 0, res.stderr
    a, b = (json.loads(p.read_text())["aggregates"] for p in paths)
    ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"]
    assert "fast ÷ slow" in res.stdout and f"{ratio:.2f}×" in res.stdout
    assert "Output tokens/s" in res.stdout and "TTFT p99" in res.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = runner.invoke(app, ["compare", str(paths[0]), str(bad)])
    assert res.exit_code == UsageError.exit_code and "not an llmc bench result" in res.stderr
    res = runner.invoke(app, ["compare", str(paths[0])])
    assert res.exit_code == UsageError.exit_code and "no peer run" in res.stderr


def test_json_stdout_and_flag_errors(engine, tmp_path) -> None:
    code, stdout, _ = bench(engine, "--num_requests", "2", "--isl", "4", "--osl", "2",
                            "--request_rate", "200", "--json", "-")  # fmt: skip
    assert code == 0
    r = json.loads(stdout)  # nothing but the JSON on stdout
    assert r["config"]["arrival"]["mode"] == "request_rate"
    code, _, err = bench(engine, "--concurrency", "2", "--request_rate", "3")
    assert code == UsageError.exit_code and "exclusive" in err
    code, _, err = bench(engine, "--percentiles", "50,abc")
    assert code == UsageError.exit_code and "'abc'" in err
    prof = tmp_path / "p.yaml"
    prof.write_text("workload:\n  num_requets: 3\n")
    code, _, err = bench(engine, "--profile", str(prof))
    assert code == UsageError.exit_code and "did you mean 'num_requests'" in err
    code, _, err = bench(engine, "--max_batch_size", "64")
    assert code != 0 and "max_batch_size" in err


def test_peer_hf_same_run(engine, tmp_path) -> None:
    out = tmp_path / "peer.json"
    args = ["--num_requests", "4", "--isl", "8", "--osl", "4", "--peer", "hf"]
    code, stdout, stderr = bench(engine, *args, "--peer_batch_size", "2", "--json", str(out))
    assert code == 0, stderr
    assert "peer (hf)" in stdout and "llmc ÷ peer" in stdout
    r = json.loads(out.read_text())
    p = r["peer"]
    assert p["config"]["batch_size"] == 2 and p["config"]["cache_implementation"] == "dynamic"
    assert p["aggregates"]["num_completed"] == 4 and p["aggregates"]["total_output_tokens"] == 16
    assert all(len(row["token_times"]) == 4 for row in p["requests"])
    llmc_tps = r["aggregates"]["output_tokens_per_s"]
    assert r["ratios"]["Output tokens/s"] == pytest.approx(
        llmc_tps / p["aggregates"]["output_tokens_per_s"]
    )
    res = runner.invoke(app, ["compare", str(out)])  # one file: llmc vs its peer
    assert res.exit_code == 0 and "llmc ÷ peer" in res.stdout


def test_bench_drives_the_llm_not_its_executor(engine, monkeypatch, tmp_path) -> None:
    """bench loads through llmc.LLM and runs closed and open loops with its verbs only."""
    from llmc import api

    def no_executor(self):
        raise AssertionError("llmc bench reached into llm.executor")

    monkeypatch.setattr(api.LLM, "executor", property(no_executor))
    for mode in (("--concurrency", "2"), ("--request_rate", "500")):
        code, stdout, stderr = bench(engine, "--num_requests", "3", "--isl", "4", "--osl", "2",
                                     "--no_enable_block_reuse", *mode, "--json", "-")  # fmt: skip
        assert code == 0, stderr
        r = json.loads(stdout)
        assert r["aggregates"]["num_completed"] == 3
        assert r["config"]["runtime"]["enable_block_reuse"] is False


def test_logs_and_the_progress_bar_share_one_console(engine, monkeypatch) -> None:
    """On a terminal, log lines print through the console that draws the bar (so Rich puts
    them above it instead of over it)."""
    import io

    import rich.progress
    from rich.console import Console

    from llmc.cli import bench_cmd

    made: list[Console] = []

    def terminal_console() -> Console:
        made.append(Console(file=io.StringIO(), force_terminal=True, width=100))
        return made[-1]

    bars: list[Console] = []

    class SpyProgress(rich.progress.Progress):
        def __init__(self, *a, **k) -> None:
            bars.append(k["console"])
            super().__init__(*a, **k)

    monkeypatch.setattr(bench_cmd, "err_console", terminal_console)
    monkeypatch.setattr(rich.progress, "Progress", SpyProgress)
    code, _, stderr = bench(engine, "--num_requests", "2", "--isl", "4", "--osl", "2")
    assert code == 0, stderr
    logs = [c for c in made if "loading engine" in c.file.getvalue()]
    assert len(bars) == 1 and logs == [bars[0]]
    assert "ceilings:" in bars[0].file.getvalue()


# ---- --temperature / --top_p / --top_k (BenchSampling) ----------------------------------


def test_sampled_requests_are_recorded_and_exact_length(engine, tmp_path) -> None:
    out = tmp_path / "s.json"
    code, _, stderr = bench(
        engine, "--num_requests", "4", "--isl", "10", "--osl", "6", "--warmup", "0",
        "--temperature", "0.7", "--top_p", "0.9", "--top_k", "20", "--json", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    r = json.loads(out.read_text())
    assert r["config"]["workload"]["sampling"] == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "n": 1, "beam_width": 1
    }  # fmt: skip
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
    assert sampling == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "n": 1, "beam_width": 1}


@pytest.mark.parametrize(
    "args,word,code",
    [
        (("--top_p", "1.5", "--temperature", "1"), "top_p", ConfigError.exit_code),
        (("--temperature", "-1"), "temperature", ConfigError.exit_code),
        (("--top_k", "-3", "--temperature", "1"), "top_k", ConfigError.exit_code),
        (("--temperature", "0.7", "--peer", "hf"), "--peer", UsageError.exit_code),
    ],
)
def test_bad_sampling_flags_are_refused_naming_them(engine, args, word, code) -> None:
    got, _, stderr = bench(engine, "--num_requests", "2", "--isl", "8", "--osl", "3", *args)
    assert got == code, stderr
    assert word in stderr and "Traceback" not in stderr


def test_bench_sampling_params() -> None:
    p = BenchSampling(temperature=0.7, top_p=0.9).params(17)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.ignore_eos) == (
        0.7, 0.9, 0, 17, True,
    )  # fmt: skip
    assert BenchSampling().is_greedy and not BenchSampling(temperature=0.5).is_greedy
    with pytest.raises(ConfigError, match="top_p"):
        BenchSampling(temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_an_unwritable_output_file_is_refused_before_the_run(engine, tmp_path, command):
    """--json (and profile's --trace / --plot) FILE that cannot be written: exit 2 naming the
    flag before the engine loads, not an error after the whole run; nothing left behind."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    flags = ["--json", "--trace", "--plot"] if command == "profile" else ["--json"]
    for flag in flags:
        for bad, why in ((blocker / "r.json", "cannot be written"), (tmp_path, "is a directory")):
            res = runner.invoke(app, [command, "--engine_dir", str(engine), "--device", "cpu",
                                      "--num_requests", "2", flag, str(bad)])  # fmt: skip
            assert res.exit_code == UsageError.exit_code, (flag, res.output)
            assert f"{flag} {bad}: {why}" in " ".join(res.stderr.split())
            assert "loading engine" not in res.stderr
    ok = tmp_path / "new" / "r.json"  # a writable place: its folders made, no file left
    res = runner.invoke(app, ["bench", "--engine_dir", str(engine), "--device", "cpu",
                              "--num_requests", "1", "--isl", "4", "--osl", "2", "--warmup",
                              "0", "--json", str(ok)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(ok.read_text())["schema"] == "llmc.bench"


def test_check_output_path_leaves_no_file(tmp_path):
    from llmc.cli.bench_settings import check_output_path

    target = tmp_path / "sub" / "out.json"
    check_output_path(str(target), "--json")
    assert target.parent.is_dir() and not target.exists()
    target.write_text("kept")
    check_output_path(str(target), "--json")  # an existing file is kept as it is
    assert target.read_text() == "kept"
    check_output_path("-", "--json")
    check_output_path(None, "--json")


def test_plot_without_matplotlib_is_refused_before_the_run(engine, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    plot = str(tmp_path / "p.png")
    res = runner.invoke(app, ["profile", "--engine_dir", str(engine), "--device", "cpu",
                              "--num_requests", "2", "--plot", plot])  # fmt: skip
    assert res.exit_code == UsageError.exit_code, res.output
    assert "--plot needs matplotlib" in res.stderr and "loading engine" not in res.stderr


@pytest.mark.parametrize(
    "args, says",
    [
        (["--isl", "65"], "isl 65 is more than the engine's max_input_len=64"),
        (["--isl", "60", "--osl", "69"], "isl + osl = 129 is more than the engine's max_seq_len"),
    ],
)
def test_a_workload_no_request_of_fits_is_refused_before_it_runs(engine, args, says) -> None:
    code, _, stderr = bench(engine, "--num_requests", "3", "--warmup", "0", *args)
    assert code == ConfigError.exit_code and says in " ".join(stderr.split())
    assert "requests failed" not in stderr
    # with a spread some may fit: those run, the others fail alone (exit 9 past the rate)
    code, _, stderr = bench(engine, "--num_requests", "3", "--warmup", "0", *args,
                            "--isl_stdev", "1", "--max_failure_rate", "1")  # fmt: skip
    assert code == 0, stderr
