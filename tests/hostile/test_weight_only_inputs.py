"""Hostile inputs of weight-only builds: ``--group_size`` that is not a power of two or does
not divide K, ``--quantization int4_wo`` on a GGUF that is already quantized, a GGUF tensor
type llmc can neither keep nor dequantize, and truncated quantized blocks. Each must fail
in a child process with its exit code and a message naming the input, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.checkpoints import make_hf_checkpoint
from helpers.gguf_quantized import write_tiny_gguf
from helpers.hostile import Case, run_case

Setup = Callable[[Path], Path]
DRY = ["build", "--checkpoint_dir", "{ckpt}", "--dry_run", "--target", "cpu"]
BUILD = ["build", "--checkpoint_dir", "{ckpt}", "--output_dir", "{tmp}/e", "--target", "cpu"]


def hf(tmp: Path) -> Path:
    return make_hf_checkpoint(tmp / "ckpt", "llama")  # hidden 64, MLP 160


def gguf(types: dict[str, str]) -> Setup:
    return lambda tmp: write_tiny_gguf(tmp / "m.gguf", types)


def cut(keep_bytes_from_end: int) -> Setup:
    """A Q4_K model file whose last tensor's blocks are cut short."""

    def make(tmp: Path) -> Path:
        path = write_tiny_gguf(tmp / "m.gguf", {"ffn_down.weight": "Q4_K"})
        data = path.read_bytes()
        path.write_bytes(data[:-keep_bytes_from_end])
        return path

    return make


CASES: list[tuple[Case, Setup]] = [
    (
        Case(
            "group_size not a power of two",
            [*DRY, "--quantization", "int4_wo", "--group_size", "48"],
            3,
            ["--group_size 48", "power of two"],
        ),
        hf,
    ),  # fmt: skip
    (
        Case(
            "group_size not dividing K",
            [*DRY, "--quantization", "int4_wo", "--group-size", "64"],
            3,
            ["does not divide K=160", "down_proj", "--group_size 32"],
        ),
        hf,
    ),  # fmt: skip
    (
        Case(
            "group_size negative",
            [*DRY, "--quantization", "int4_wo", "--group_size", "-8"],
            3,
            ["--group_size", "-8"],
        ),
        hf,
    ),  # fmt: skip
    (
        Case(
            "int4_wo on a quantized GGUF",
            [*DRY, "--quantization", "int4_wo"],
            5,
            ["already quantized", "Q8_0", "--quantization none"],
        ),
        gguf({}),
    ),  # fmt: skip
    (
        Case(
            "int8_wo on a quantized GGUF",
            [*BUILD, "--quantization", "int8_wo"],
            5,
            ["already quantized", "Q4_K"],
        ),
        gguf({"attn_q.weight": "Q4_K"}),
    ),  # fmt: skip
    (
        Case("GGUF type llmc cannot read", DRY, 5, ["attn_v.weight", "Q8_1", "Q4_K", "Q6_K"]),
        gguf({"attn_v.weight": "Q8_1"}),
    ),
    (
        Case("GGUF type llmc cannot read, full build", BUILD, 5, ["Q8_1", "supported"]),
        gguf({"ffn_up.weight": "Q8_1"}),
    ),
    (Case("truncated quantized blocks", BUILD, 4, ["truncated GGUF", "ffn_down"]), cut(100)),
]


@pytest.mark.parametrize("case,setup", [pytest.param(c, s, id=c.name) for c, s in CASES])
def test_hostile_weight_only(case: Case, setup: Setup, tmp_path: Path) -> None:
    run_case(case, tmp=tmp_path, ckpt=setup(tmp_path))


def test_the_base_files_build(tmp_path: Path) -> None:
    """The GGUF every case edits builds cleanly, kept native (so each case fails for its edit)."""
    from helpers.hostile import run_llmc

    path = write_tiny_gguf(tmp_path / "m.gguf", {"ffn_down.weight": "Q4_K"})
    out = run_llmc(["build", "--checkpoint_dir", str(path), "--output_dir", str(tmp_path / "e"),
                    "--target", "cpu"])  # fmt: skip
    assert out.exit_code == 0, out.stderr
