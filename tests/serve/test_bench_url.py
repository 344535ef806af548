"""`llmc bench --url` against `llmc serve`: the same workload gives the same token counts as
in-process, for synthetic and ShareGPT workloads; its refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmc.cli.main import app

pytestmark = pytest.mark.usefixtures("small_ceilings")
runner = CliRunner()


def _bench(*args: str) -> dict:
    res = runner.invoke(app, ["bench", "--seed", "3", "--warmup", "1", "--json", "-", *args])
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def _counts(result: dict) -> tuple:
    a = result["aggregates"]
    rows = sorted(result["requests"], key=lambda r: r["task_id"])
    per = [(r["task_id"], r["num_prompt_tokens"], r["num_output_tokens"]) for r in rows]
    return a["num_completed"], a["total_prompt_tokens"], a["total_output_tokens"], per


def _sharegpt(path) -> str:
    convs = [
        {"id": f"c{i}", "conversations": [
            {"from": "human", "value": "tell me " + "ab" * (i + 2)},
            {"from": "gpt", "value": "ok " + "cd" * (i + 3)},
        ]}
        for i in range(8)
    ] + [{"id": "short", "conversations": [{"from": "human", "value": "one turn"}]}]  # fmt: skip
    path.write_text(json.dumps(convs))
    return str(path)


def test_http_and_in_process_agree_on_token_counts(shared_server, serve_engine, tmp_path):
    url = shared_server.base_url
    common = ["--num_requests", "12", "--isl", "10", "--osl", "6", "--concurrency", "4"]
    local = _bench("--engine_dir", str(serve_engine), "--device", "cpu", *common)
    remote = _bench("--url", url, "--model", "tiny", "--engine_dir", str(serve_engine), *common)
    assert _counts(remote) == _counts(local)
    assert remote["config"]["endpoint"] == {"url": url, "model": "tiny"}
    a = remote["aggregates"]
    assert a["num_failed"] == 0 and a["output_tokens_per_s"] > 0
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert a[key]["count"] > 0, key
    assert a["kv_blocks_total"] is None  # the engine's steps are the server's

    data = _sharegpt(tmp_path / "sg.json")
    sg = ["--dataset", data, "--num_requests", "6", "--concurrency", "3"]
    local = _bench("--engine_dir", str(serve_engine), "--device", "cpu", *sg)
    remote = _bench("--url", url, "--model", "tiny", "--engine_dir", str(serve_engine), *sg)
    assert _counts(remote) == _counts(local)
    assert local["aggregates"]["num_completed"] == 6


def test_url_refusals(shared_server, serve_engine) -> None:
    url = shared_server.base_url
    res = runner.invoke(app, ["bench", "--url", url, "--num_requests", "2"])
    assert res.exit_code == 2 and "--model" in res.stderr
    res = runner.invoke(app, ["bench", "--url", url, "--model", "tiny", "--num_requests", "2"])
    assert res.exit_code == 2 and "vocabulary" in res.stderr
    res = runner.invoke(app, ["bench", "--url", "ftp://x", "--model", "tiny"])
    assert res.exit_code == 3 and "http://" in res.stderr
    res = runner.invoke(
        app, ["bench", "--url", url, "--model", "nope", "--engine_dir", str(serve_engine),
              "--num_requests", "2", "--warmup", "0", "--isl", "8", "--osl", "4"],
    )  # fmt: skip
    assert res.exit_code == 9 and "HTTP 404" in res.stderr
    # the engine's limits are known from --engine_dir: a workload none of fits is refused
    res = runner.invoke(
        app, ["bench", "--url", url, "--model", "tiny", "--engine_dir", str(serve_engine),
              "--num_requests", "2", "--warmup", "0", "--isl", "500"],
    )  # fmt: skip
    assert res.exit_code == 3 and "max_input_len" in res.stderr


def test_client_workers_split_the_streams(shared_server, serve_engine) -> None:
    """Two client processes (--client_workers 2) send the same workload as one: the same
    token counts as in-process, the records of both on one clock inside the window."""
    url = shared_server.base_url
    common = ["--num_requests", "10", "--isl", "8", "--osl", "5", "--concurrency", "4"]
    local = _bench("--engine_dir", str(serve_engine), "--device", "cpu", *common)
    remote = _bench(
        "--url", url, "--model", "tiny", "--engine_dir", str(serve_engine),
        "--client_workers", "2", *common,
    )  # fmt: skip
    assert _counts(remote) == _counts(local)
    assert remote["config"]["client_workers"] == 2
    a = remote["aggregates"]
    assert a["num_failed"] == 0 and a["ttft"]["count"] == 10
    rate = _bench(
        "--url", url, "--model", "tiny", "--engine_dir", str(serve_engine),
        "--client_workers", "3", "--num_requests", "6", "--isl", "8", "--osl", "4",
        "--request_rate", "50",
    )  # fmt: skip
    assert rate["aggregates"]["num_completed"] == 6
    assert rate["config"]["client_workers"] == 3
    res = runner.invoke(
        app, ["bench", "--url", url, "--model", "tiny", "--engine_dir", str(serve_engine),
              "--client_workers", "-1", "--num_requests", "2"],
    )  # fmt: skip
    assert res.exit_code == 2 and "--client_workers" in res.stderr
