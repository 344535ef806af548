"""``llmc eval`` on the tiny Llama engine: the table, ``--json -`` and ``--json FILE`` (equal
to the library's result), both flag spellings, the ``eval:`` profile section, and every bad
input with its exit code (typer's CliRunner; a few in a child process, where the promises
of tests/helpers/hostile.py are checked: no traceback, nothing on stdout)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from helpers.engines import SMALL_LIMITS
from helpers.hostile import Case, run_case
from llmc.cli.main import app

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "We hold these truths to be self-evident, that all men are created equal.\n" * 4


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)  # max_input_len 64


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_cli") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def llmc_eval(*args: str):
    return CliRunner().invoke(app, ["eval", *map(str, args)])


def test_table_on_stdout_logs_on_stderr(engine, text):
    res = llmc_eval("--engine_dir", engine, "--text_file", text, "--window", "32")
    assert res.exit_code == 0, res.stderr
    for row in ("perplexity", "mean NLL", "tokens scored", "windows", "window / stride"):
        assert row in res.stdout
    assert "loading engine" in res.stderr and "loading engine" not in res.stdout


def test_json_on_stdout_equals_the_library_result(engine, text):
    from llmc import LLM
    from llmc.runtime.bench.perplexity import EvalSettings, evaluate

    res = llmc_eval(
        "--engine-dir", engine, "--text-file", text, "--max-windows", "3", "--json", "-"
    )
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)  # stdout holds exactly the JSON document
    assert (d["schema"], d["schema_version"]) == ("llmc.eval", 1)
    keys = "perplexity nll_mean nll_sum tokens_scored windows seconds text_tokens window stride"
    for key in (*keys.split(), "runtime", "environment", "tokens_per_s"):
        assert d[key] is not None, key
    assert (d["windows"], d["window"], d["stride"]) == (3, 64, 64)
    assert d["tokens_scored"] == 3 * 63
    with LLM(engine, device="cpu") as llm:
        lib = evaluate(llm, EvalSettings(str(text), max_windows=3))
    assert d["perplexity"] == pytest.approx(lib.perplexity, rel=1e-6)
    assert d["nll_mean"] == pytest.approx(d["nll_sum"] / d["tokens_scored"])


def test_json_file_and_the_profile_eval_section(engine, text, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(f"eval:\n  text_file: {text}\n  window: 20\n  stride: 10\n  max-windows: 2\n")
    out = tmp_path / "r" / "eval.json"
    res = llmc_eval("--engine_dir", engine, "--profile", prof, "--window", "24", "--json", out)
    assert res.exit_code == 0, res.stderr
    assert "perplexity" in res.stdout  # the table still prints
    d = json.loads(out.read_text())
    assert (d["window"], d["stride"], d["windows"]) == (24, 10, 2)  # CLI > profile
    assert d["tokens_scored"] == 23 + 10  # the second window scores what the first did not


BAD = [  # (name, extra args, exit code, fragments of the error)
    ("no text_file", [], 2, ["--text_file is required"]),
    ("missing text file", ["--text_file", "{tmp}/absent.txt"], 2, ["absent.txt", "cannot be read"]),
    ("a directory", ["--text_file", "{tmp}"], 2, ["not a regular file"]),
    ("empty text", ["--text_file", "{tmp}/empty.txt"], 2, ["empty.txt", "empty"]),
    ("binary text", ["--text_file", "{tmp}/bin.txt"], 2, ["bin.txt", "binary", "NUL byte"]),
    ("latin-1 text", ["--text_file", "{tmp}/latin1.txt"], 2, ["not UTF-8"]),
    ("one token", ["--text_file", "{tmp}/one.txt"], 2, ["1 token", "at least 2"]),
    ("window too large", ["--text_file", "{text}", "--window", "65"], 3,
     ["--window 65", "max_input_len=64"]),
    ("window 1", ["--text_file", "{text}", "--window", "1"], 3, ["--window 1"]),
    ("stride 0", ["--text_file", "{text}", "--stride", "0"], 3, ["--stride 0"]),
    ("stride > window", ["--text_file", "{text}", "--window", "8", "--stride", "9"], 3,
     ["--stride 9", "at most the window"]),
    ("max_windows 0", ["--text_file", "{text}", "--max_windows", "0"], 3, ["--max_windows 0"]),
    ("window not an int", ["--text_file", "{text}", "--window", "abc"], 2, ["--window"]),
]  # fmt: skip


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "bin.txt").write_bytes(b"\x7fELF\0\0\0")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "one.txt").write_text("a")
    return tmp_path


@pytest.mark.parametrize("name, args, code, says", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_exit_with_their_code(engine, text, bad_files, name, args, code, says):
    filled = [a.format(tmp=bad_files, text=text) for a in args]
    res = llmc_eval("--engine_dir", engine, *filled)
    assert res.exit_code == code, (res.stdout, res.stderr)
    err = " ".join(res.stderr.split())
    for fragment in says:
        assert fragment.format(tmp=bad_files) in err, err
    assert "Traceback" not in res.stderr and res.stdout.strip() == ""


def test_unknown_profile_key_is_a_usage_error(engine, tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("eval:\n  windw: 20\n")
    res = llmc_eval("--engine_dir", engine, "--profile", prof)
    assert res.exit_code == 2 and "windw" in res.stderr and "window" in res.stderr


CHILD = [
    Case("binary text file", ["eval", "--engine_dir", "{engine}", "--text_file", "{tmp}/bin.txt",
         "--json", "-"], 2, ["bin.txt", "binary"]),
    Case("window beyond the engine", ["eval", "--engine_dir", "{engine}", "--text_file", "{text}",
         "--window", "1000", "--json", "-"], 3, ["--window 1000", "max_input_len=64"]),
]  # fmt: skip


@pytest.mark.parametrize("case", CHILD, ids=str)
def test_bad_inputs_fail_cleanly_in_a_child_process(case, engine, text, bad_files):
    run_case(case, engine=engine, text=text, tmp=bad_files)
