"""``llmc run`` through typer's CliRunner: text output, --json, --stream, --chat, input
files, exit codes of bad requests (the others still complete) and of bad engine dirs."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir):
    # the error tests name max_batch_size=4; a 40-token prompt limit under max_seq_len 64
    return tiny_engine(
        tiny_llama_dir,
        max_seq_len=64,
        max_input_len=40,
        max_batch_size=4,
        max_num_tokens=64,
        tokens_per_block=8,
    )


def run(*args: str):
    return CliRunner().invoke(app, ["run", *args])


def run_json(*args: str) -> dict:
    res = run(*args, "--json")
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)  # stdout holds exactly one JSON document


def test_text_output_has_outputs_table_and_summary(engine):
    res = run(
        "--engine_dir",
        str(engine),
        "--prompt",
        "hello",
        "--prompt",
        "abc",
        "--max_new_tokens",
        "6",
        "--ignore_eos",
    )
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    assert "request 0" in out and "request 1" in out
    for col in ("prompt tok", "generated tok", "TTFT ms", "tokens/s", "finish"):
        assert col in out
    assert "2 requests (0 failed), 12 tokens" in out and "peak KV-cache utilization" in out
    assert "preemptions 0" in out
    assert "loaded" in res.stderr and "torch backend" in res.stderr


def test_json_matches_the_executor_and_has_timings(engine, tiny_llama_dir):
    doc = run_json(
        "--engine-dir",
        str(engine),
        "--prompt",
        "hello world",
        "--prompt",
        "x",
        "--max-new-tokens",
        "7",
        "--ignore-eos",
    )
    outs = doc["outputs"]
    assert [o["prompt"] for o in outs] == ["hello world", "x"]
    ex = EngineRuntime.load(engine, RuntimeConfig()).executor()
    ref = ex.generate(["hello world", "x"], SamplingParams(7, ignore_eos=True))
    for o, r in zip(outs, ref, strict=True):
        assert o["token_ids"] == r.token_ids and o["text"] == r.text
        assert o["finish_reason"] == "length" and o["error"] is None
        t = o["timings"]
        assert t["num_output_tokens"] == 7 and t["ttft_s"] > 0 and t["tokens_per_s"] > 0
    s = doc["summary"]
    assert s["generated_tokens"] == 14 and s["num_failed"] == 0 and s["preemptions"] == 0
    assert 0 < s["peak_kv_utilization"] <= 1
    assert doc["runtime"]["device"] == "cpu" and doc["runtime"]["backend"] == "torch"


def test_stream_deltas_add_up_to_the_text(engine):
    doc = run_json(
        "--engine_dir",
        str(engine),
        "--prompt",
        "stream me",
        "--prompt",
        "b",
        "--max_new_tokens",
        "9",
        "--ignore_eos",
        "--stream",
    )
    for o in doc["outputs"]:
        assert len(o["deltas"]) >= 2 and "".join(o["deltas"]) == o["text"]
    text = run(
        "--engine_dir",
        str(engine),
        "--prompt",
        "stream me",
        "--max_new_tokens",
        "9",
        "--ignore_eos",
        "--stream",
    )
    assert text.exit_code == 0
    assert text.stdout.startswith(doc["outputs"][0]["text"])


def test_decode_steps_per_iteration_streams_the_same_tokens_in_bursts(engine):
    args = ("--engine_dir", str(engine), "--prompt", "stream me", "--prompt", "b")
    args += ("--max_new_tokens", "11", "--ignore_eos", "--stream")
    one = run_json(*args)
    multi = run_json(*args, "--decode_steps_per_iteration", "4")
    assert multi["runtime"]["decode_steps_per_iteration"] == 4
    for a, b in zip(multi["outputs"], one["outputs"], strict=True):
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
        assert "".join(a["deltas"]) == a["text"]
    assert len(multi["outputs"][0]["deltas"]) < len(one["outputs"][0]["deltas"])


def test_chat_applies_the_template(engine, tiny_llama_dir):
    doc = run_json("--engine_dir", str(engine), "--prompt", "hi", "--chat", "--max_new_tokens", "2")
    tok = Tokenizer.from_dir(tiny_llama_dir)
    n = doc["outputs"][0]["timings"]["num_prompt_tokens"]
    assert n == len(tok.apply_chat_template("hi")) > len(tok.encode("hi"))


def test_sampling_flags_reach_the_requests(engine):
    args = (
        "--engine_dir",
        str(engine),
        "--prompt",
        "seeded",
        "--max_new_tokens",
        "8",
        "--temperature",
        "0.8",
        "--top_k",
        "20",
        "--top_p",
        "0.9",
        "--seed",
        "5",
        "--ignore_eos",
        "--logprobs",
        "2",
    )
    a, b = run_json(*args), run_json(*args)
    assert a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"]
    lps = a["outputs"][0]["logprobs"]
    assert len(lps) == 8 and all(len(lp["top"]) == 2 for lp in lps)
    stop_at = a["outputs"][0]["token_ids"][3]
    unseen = next(t for t in range(256) if t not in a["outputs"][0]["token_ids"])
    c = run_json(*args, "--stop_token_ids", f"{stop_at},{unseen}")  # (9999: refused, hostile)
    assert c["outputs"][0]["finish_reason"] == "stop"
    assert c["outputs"][0]["token_ids"][-1] == stop_at


def test_jsonl_input_with_a_bad_request_exits_8_after_running_the_others(engine, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(
        '{"prompt": "ok one", "max_new_tokens": 3, "ignore_eos": true}\n'
        '{"input_ids": [1, 300]}\n'
        '{"input_ids": [5, 6], "temperature": -1}\n'
        '{"input_ids": [5, 6, 7], "max_new_tokens": 4, "ignore_eos": true}\n'
        '{"prompt": "too long", "max_new_tokens": 60}\n'
    )
    res = run("--engine_dir", str(engine), "--input_file", str(f), "--json")
    assert res.exit_code == 8
    outs = json.loads(res.stdout)["outputs"]
    assert len(outs[0]["token_ids"]) == 3 and len(outs[3]["token_ids"]) == 4
    assert outs[1]["error"] == f"{f}:2: prompt token id 300 is outside the vocabulary [0, 256)"
    assert f"{f}:3: sampling parameter temperature=-1: must be a finite" in outs[2]["error"]
    assert "in.jsonl:5: " in outs[4]["error"]
    assert "exceeds the engine's max_seq_len=64" in outs[4]["error"]
    assert "request 1: " in res.stderr and "in.jsonl:2: prompt token id 300" in res.stderr
    assert "request 1: request" not in res.stderr  # the prefix is said once
    clamp = run(
        "--engine_dir",
        str(engine),
        "--prompt",
        "too long",
        "--max_new_tokens",
        "60",
        "--clamp_max_new_tokens",
        "--json",
    )
    assert clamp.exit_code == 0
    assert len(json.loads(clamp.stdout)["outputs"][0]["token_ids"]) == 64 - 8


def test_text_input_file_one_prompt_per_line(engine, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first\n\nsecond\n")
    doc = run_json("--engine_dir", str(engine), "--input_file", str(f), "--max_new_tokens", "2")
    assert [o["prompt"] for o in doc["outputs"]] == ["first", "second"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ((), 2, "--engine_dir is required"),
        (("--engine_dir", "{engine}"), 2, "no prompt"),
        (("--engine_dir", "/nonexistent/x", "--prompt", "a"), 7, "does not exist"),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--max_batch_size", "9"),
            3,
            "max_batch_size=9 exceeds the engine's max_batch_size=4",
        ),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--device", "gpu"),
            3,
            "device 'gpu' is not one of auto, cpu, cuda",
        ),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--scheduler_policy", "max_util"),
            3,
            "did you mean 'max_utilization'",
        ),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--stop_token_ids", "x"),
            2,
            "--stop_token_ids takes integers",
        ),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--logit_bias", "7=100"),
            2,
            "--logit_bias '7=100': takes TOKEN_ID:BIAS",
        ),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--logit_bias", "7:300"),
            8,
            "logit_bias={7: 300.0}: bias 300.0 of token 7 is not in [-100, 100]",
        ),
        (
            ("--engine_dir", "{engine}", "--prompt", "a", "--decode_steps_per_iteration", "0"),
            3,
            "decode_steps_per_iteration must be a positive integer, got 0",
        ),
    ],
)
def test_usage_and_config_errors(engine, args, code, message):
    res = run(*[a.format(engine=engine) for a in args])
    assert res.exit_code == code, res.output
    assert message in res.stderr and res.stdout == ""


def test_cuda_device_without_a_gpu_is_refused(engine):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = run("--engine_dir", str(engine), "--prompt", "a", "--device", "cuda")
    assert res.exit_code == 5 and "torch sees no CUDA GPU" in res.stderr


@pytest.mark.parametrize("damage", ["missing", "checksum", "version"])
def test_damaged_engine_dir_is_refused_with_the_rebuild_command(engine, tmp_path, damage):
    bad = tmp_path / "engine"
    shutil.copytree(engine, bad)
    if damage == "missing":
        (bad / "tokenizer.json").unlink()
        message = "tokenizer.json is missing; the engine is incomplete"
    elif damage == "checksum":
        with open(bad / "plan.json", "a") as f:
            f.write(" ")
        message = "plan.json is corrupt: sha256"
    else:
        m = json.loads((bad / "manifest.json").read_text())
        m["format_version"] = 999
        (bad / "manifest.json").write_text(json.dumps(m))
        message = "has format version 999"
    res = run("--engine_dir", str(bad), "--prompt", "a")
    assert res.exit_code == 7
    assert message in res.stderr and "llmc build" in res.stderr


def test_engine_for_another_target_is_refused_by_the_cuda_backend(engine, monkeypatch):
    """On an sm_90 GPU, the CUDA backend needs an engine built for sm_90 (this one is cpu)."""
    import torch

    from llmc.base.errors import EngineError
    from llmc.runtime import engine_runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_runtime, "_gpu_arch", lambda: "sm_90")
    with pytest.raises(EngineError, match="built for target 'cpu', but this run needs 'sm_90'"):
        EngineRuntime.load(engine, RuntimeConfig(device="cuda", backend="cuda"))


def test_profile_run_section_fills_flags_and_cli_wins(engine, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(f"run:\n  engine_dir: {engine}\n  max_new_tokens: 3\n  ignore_eos: true\n")
    doc = run_json("--profile", str(prof), "--prompt", "a")
    assert len(doc["outputs"][0]["token_ids"]) == 3
    doc = run_json("--profile", str(prof), "--prompt", "a", "--max_new_tokens", "5")
    assert len(doc["outputs"][0]["token_ids"]) == 5
    prof.write_text("run:\n  max_new_token: 3\n")
    res = run("--profile", str(prof), "--engine_dir", str(engine), "--prompt", "a")
    assert res.exit_code == 2 and "did you mean 'max_new_tokens'" in res.stderr


def test_run_drives_the_llm_not_its_executor(engine, monkeypatch):
    """`llmc run` uses the front door's own verbs and records, never `llm.executor`."""
    from llmc import api

    def no_executor(self):
        raise AssertionError("llmc run reached into llm.executor")

    monkeypatch.setattr(api.LLM, "executor", property(no_executor))
    doc = run_json(
        "--engine_dir", str(engine), "--prompt", "hi", "--prompt", "there",
        "--max_new_tokens", "3", "--ignore_eos", "--stream",
    )  # fmt: skip
    assert [len(o["token_ids"]) for o in doc["outputs"]] == [3, 3]
    assert doc["summary"]["num_steps"] > 0 and doc["outputs"][0]["timings"]["ttft_s"] > 0


def test_runtime_flags_are_declared_once_for_run_bench_and_profile():
    import inspect

    from llmc.cli import bench_cmd, profile_cmd, run_cmd
    from llmc.cli.options import RUNTIME_FLAGS, with_flags

    names = [f.name for f in RUNTIME_FLAGS]
    assert set(names) <= set(RuntimeConfig.field_names())
    for cmd in (run_cmd.run_command, bench_cmd.bench_command, profile_cmd.profile_command):
        params = inspect.signature(cmd).parameters
        assert [n for n in params if n in names] == names, cmd.__name__
    with pytest.raises(AssertionError, match="declared twice"):
        with_flags(RUNTIME_FLAGS)(lambda device=None, **flags: None)
