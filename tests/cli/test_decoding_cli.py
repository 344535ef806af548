"""The decoding-mode flags: ``llmc build --max_beam_width``, ``llmc run --n / --best_of /
--beam_width / --length_penalty`` and ``llmc bench --n / --beam_width`` on a tiny engine
built for 4 beams: what reaches the requests, the outputs in --json, and the refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmc.api import LLM
from llmc.cli.main import app
from llmc.runtime.branches import BeamSearchParams
from llmc.runtime.engine_runtime import RuntimeConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

runner = CliRunner()


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, max_seq_len=64, max_batch_size=8, max_num_tokens=64,
                       tokens_per_block=8, max_beam_width=4)  # fmt: skip


def run_json(engine, *args: str) -> dict:
    res = runner.invoke(app, ["run", "--engine_dir", str(engine), "--prompt", "hello",
                                 "--max_new_tokens", "6", "--json", *args])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


def test_run_n_returns_every_sample(engine):
    doc = run_json(engine, "--n", "3", "--temperature", "1.0", "--seed", "5", "--ignore_eos")
    [out] = doc["outputs"]
    assert [c["index"] for c in out["completions"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 6 for c in out["completions"])
    assert out["token_ids"] == out["completions"][0]["token_ids"]
    assert doc["summary"]["generated_tokens"] == 18


def test_run_beam_width_shows_every_beam_as_the_python_api_does(engine):
    doc = run_json(engine, "--beam_width", "3", "--length_penalty", "0.5")
    [out] = doc["outputs"]
    with LLM(engine, runtime_config=RuntimeConfig(device="cpu")) as llm:
        [ref] = llm.beam_search(["hello"], BeamSearchParams(beam_width=3, max_tokens=6,
                                                            length_penalty=0.5))  # fmt: skip
    assert [c["token_ids"] for c in out["completions"]] == [c.token_ids for c in ref.completions]
    assert [c["text"] for c in out["completions"]] == [c.text for c in ref.completions]


def test_run_best_of_returns_n(engine):
    doc = run_json(engine, "--n", "2", "--best_of", "4", "--temperature", "1.0", "--seed", "1")
    [out] = doc["outputs"]
    assert len(out["completions"]) == 2
    cum = [c["cumulative_logprob"] for c in out["completions"]]
    assert cum == sorted(cum, reverse=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--beam_width", "8"), "beam_width=8 is more beams than the engine's max_beam_width=4"),
        (("--n", "0"), "n=0"),
        (("--beam_width", "2", "--temperature", "0.5"), "beam search is greedy"),
        (("--n", "12", "--temperature", "1"), "max_batch_size=8"),
    ],
)
def test_run_refuses_bad_decoding_flags_with_exit_8(engine, args, message):
    res = runner.invoke(app, ["run", "--engine_dir", str(engine), "--prompt", "hi", *args])
    assert res.exit_code == 8, res.stderr
    assert message in res.stderr.replace("\n", " ")
    assert "Traceback" not in res.stderr


@pytest.mark.usefixtures("small_ceilings")
@pytest.mark.parametrize("flag", ["--n", "--beam_width"])
def test_bench_measures_samples_and_beams(engine, tmp_path, flag):
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", "--engine_dir", str(engine), "--device", "cpu",
                                 "--num_requests", "3", "--isl", "8", "--osl", "4",
                                 "--warmup", "0", flag, "2", "--json", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    r = json.loads(out.read_text())
    w = r["config"]["workload"]["sampling"]
    assert (w["n"], w["beam_width"]) == ((2, 1) if flag == "--n" else (1, 2))
    tokens = r["aggregates"]["total_output_tokens"]
    assert tokens == (3 * 4 * 2 if flag == "--n" else 3 * 4)  # samples all count; one beam


def test_bench_refuses_a_peer_with_beams(engine):
    res = runner.invoke(app, ["bench", "--engine_dir", str(engine), "--device", "cpu",
                                 "--beam_width", "2", "--peer", "hf"])  # fmt: skip
    assert res.exit_code != 0 and "--n or --beam_width" in res.stderr.replace("\n", " ")


def test_build_max_beam_width_is_checked_against_the_batch(tiny_llama_dir):
    res = runner.invoke(app, ["build", "--dry_run", "--checkpoint_dir", str(tiny_llama_dir),
                                 "--max_batch_size", "4", "--max_beam_width", "8"])  # fmt: skip
    assert res.exit_code != 0
    assert "--max_batch_size 4 is smaller than --max_beam_width 8" in res.stderr
