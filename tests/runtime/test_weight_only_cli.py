"""Weight-only engines end to end on the CPU through the CLI: the first 4 layers of SmolLM2
(real weights, its own tokenizer) built by ``llmc build`` as float32, int8_wo and int4_wo
(float32 activations, so only the weights differ), then run through ``llmc run``, ``llmc
bench``, ``llmc eval`` and the Python API; the flags' help, spellings and bad values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.variants import CPU_LIMITS, agreement, build_variants, cli, run_tokens

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread", "small_ceilings")]

VARIANTS = {
    "float32": [],
    "int8_wo": ["--quantization", "int8_wo"],
    "int4_wo": ["--quantization", "int4_wo", "--group-size", "64"],
}
PROMPTS = ["The capital of France is", "def reverse(s):", "Once upon a time"]
NEW = 16


@pytest.fixture(scope="module")
def built(smollm2_4l_dir, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    return build_variants(smollm2_4l_dir, tmp_path_factory.mktemp("wo_e2e"), VARIANTS)


def test_the_report_and_manifest_say_what_is_packed(built):
    flat = {k: " ".join(r.replace("│", " ").split()) for k, (_, r) in built.items()}
    assert (
        "int4_wo weight-only: qkv_proj, o_proj, gate_up_proj, down_proj packed" in flat["int4_wo"]
    )
    assert "int4_wo: 4-bit storage, group 64, float16 scales + offsets" in flat["int4_wo"]
    assert "int8_wo: 8-bit storage, group 576, float16 scales" in flat["int8_wo"]
    assert "of which weight-only" in flat["int8_wo"]
    manifest = json.loads((built["int4_wo"][0] / "manifest.json").read_text())
    q = manifest["quantization"]
    assert q["quantization"] == "int4_wo" and len(q["layouts"]) == 16
    assert q["families"]["embed_tokens"] == "float"
    sizes = {
        k: json.loads((d / "plan.json").read_text())["weight_bytes_total"]
        for k, (d, _) in built.items()
    }
    assert sizes["int4_wo"] < sizes["int8_wo"] < sizes["float32"]


def test_llmc_run_and_the_api_agree_with_the_float32_engine(built):
    tokens = {name: run_tokens(engine, PROMPTS, NEW) for name, (engine, _) in built.items()}
    for name in ("int8_wo", "int4_wo"):
        assert agreement(tokens[name], tokens["float32"]) >= 0.5, name


def test_llmc_bench_and_eval_run_the_engines(built, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(
        "We hold these truths to be self-evident, that all men are created equal, that they "
        "are endowed by their Creator with certain unalienable Rights, that among these are "
        "Life, Liberty and the pursuit of Happiness."
    )
    nll = {}
    for name, (engine, _) in built.items():
        out = tmp_path / f"{name}.json"
        res = cli("bench", "--engine_dir", engine, "--device", "cpu", "--num_requests", "4",
                  "--isl", "12", "--osl", "4", "--warmup", "0", "--json", out)  # fmt: skip
        assert res.exit_code == 0, res.stderr
        doc = json.loads(out.read_text())
        assert doc["aggregates"]["num_completed"] == 4
        assert doc["config"]["engine"]["quantization"] == ("none" if name == "float32" else name)
        res = cli("eval", "--engine_dir", engine, "--text_file", text, "--device", "cpu",
                  "--window", "64", "--json", "-")  # fmt: skip
        assert res.exit_code == 0, res.stderr
        nll[name] = json.loads(res.stdout)["nll_mean"]
    for name in ("int8_wo", "int4_wo"):
        assert abs(nll[name] / nll["float32"] - 1) < 0.05, nll


def test_flags_help_and_spellings(smollm2_4l_dir):
    helptext = " ".join(cli("build", "--help").stdout.split())
    for fragment in ("--group-size", "int8_wo", "int4_wo", "in elements", "Default: 128",
                     "kept as they are", "Default: auto"):  # fmt: skip
        assert fragment in helptext, fragment
    for spelling in ("--group_size", "--group-size"):
        res = cli("build", "--checkpoint_dir", smollm2_4l_dir, "--dry_run", "--json", *CPU_LIMITS,
                  "--quantization", "int4_wo", spelling, "32")  # fmt: skip
        assert res.exit_code == 0, res.stderr
        layouts = json.loads(res.stdout)["quantization"]["layouts"]
        assert {v["group_size"] for v in layouts.values()} == {32}


@pytest.mark.parametrize(
    ("flags", "code", "fragments"),
    [
        (["--group_size", "128"], 3, ["--group_size 128 does not divide K=576", "--group_size 64"]),
        (["--group_size", "48"], 3, ["48 is not a power of two"]),
        (["--group_size", "0"], 3, ["power of two"]),
        (["--quantization", "int3_wo"], 5, ["int3_wo", "int4_wo"]),
    ],
)
def test_bad_flags_fail_cleanly(smollm2_4l_dir, tmp_path, flags, code, fragments):
    base = ["--quantization", "int4_wo"] if "--quantization" not in flags else []
    res = cli("build", "--checkpoint_dir", smollm2_4l_dir, "--output_dir", tmp_path / "e",
              *CPU_LIMITS, *base, *flags)  # fmt: skip
    assert res.exit_code == code, (res.exit_code, res.stderr)
    assert "Traceback" not in res.stderr
    for f in fragments:
        assert f in res.stderr, (f, res.stderr)
    assert not (tmp_path / "e").exists()


def test_int4_wo_on_a_quantized_gguf_is_refused(smollm2_gguf, tmp_path):
    res = cli("build", "--checkpoint_dir", smollm2_gguf, "--output_dir", tmp_path / "e",
              "--quantization", "int4_wo", "--dry_run", "--target", "cpu")  # fmt: skip
    assert res.exit_code == 5, res.stderr
    for f in ("already quantized", "Q4_1", "Q8_0", "--quantization none"):
        assert f in res.stderr
