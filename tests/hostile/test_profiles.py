"""Hostile YAML profiles and model configs: alias bombs, deep nesting, files that are not
UTF-8 or too large, and values of the wrong type or NaN (in a profile or on the command line).

A profile is read before anything else a command does, so every case fails in the first
second: bounded YAML (compiler/input_bounds.load_yaml) is exit 2 naming the file; a value of
the wrong type is exit 2 (the build command's YAML type check) or 3 (the config's own check);
a model section with a bad size is the checkpoint's exit 4.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.hostile import Case, run_case
from llmc.compiler import input_bounds as B

MODEL = """\
model:
  architectures: [LlamaForCausalLM]
  vocab_size: 256
  hidden_size: 64
  intermediate_size: 160
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  max_position_embeddings: 512
  eos_token_id: 2
"""
BUILD = "build:\n  load_format: dummy\n  target: cpu\n"


def laughs(levels: int = 9, section: str = "model") -> str:
    """The "billion laughs": each level is a list of ten aliases of the one before."""
    lines = [f"{section}:", '  l0: &l0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


Setup = Callable[[Path], Path]


def text(content: str | bytes, name: str = "p.yaml") -> Setup:
    def setup(tmp: Path) -> Path:
        path = tmp / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    return setup


DRY = ["build", "--dry_run", "--profile", "{prof}"]
DUMMY = ["build", "--dry_run", "--load_format", "dummy", "--target", "cpu", "--model_config",
         "{prof}"]  # fmt: skip
RUN = ["run", "--engine_dir", "{tmp}/no_engine", "--prompt", "hi", "--profile", "{prof}"]
BENCH = ["bench", "--engine_dir", "{tmp}/no_engine", "--profile", "{prof}"]

CASES: list[tuple[Case, Setup]] = [
    # ---- unbounded expansion (issue item 5) ------------------------------------------------
    (
        Case(
            "billion laughs in model:",
            DRY,
            2,
            ["{prof}", "expands", str(B.MAX_YAML_VALUES)],
            timeout_s=30,
            memory_mb=3072,
        ),
        text(laughs() + BUILD),
    ),
    (
        Case("billion laughs in build:", DRY, 2, ["{prof}", "expands"], timeout_s=30),
        text(laughs(section="build")),
    ),
    (
        Case("billion laughs as --model_config", DUMMY, 2, ["{prof}", "expands"], timeout_s=30),
        text(laughs()),
    ),
    (
        Case("billion laughs in run:", RUN, 2, ["{prof}", "expands"], timeout_s=30),
        text(laughs(section="run")),
    ),
    (
        Case("self-referencing alias", DRY, 2, ["{prof}", "expands"], timeout_s=30),
        text("model: &a\n  x: *a\n" + BUILD),
    ),
    (
        Case("lists nested 100000 deep", DRY, 2, ["{prof}"], timeout_s=30),
        text("model: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ),
    (
        Case("profile over the size limit", DRY, 2, ["{prof}", str(B.MAX_YAML_BYTES)]),
        text("description: " + "x" * (B.MAX_YAML_BYTES + 1) + "\n"),
    ),
    # ---- files that are not profiles (issue item 6) -----------------------------------------
    (
        Case("profile not UTF-8", DRY, 2, ["{prof}", "UTF-8"]),
        text(b"description: caf\xe9\n" + BUILD.encode()),
    ),
    (
        Case("model config YAML not UTF-8", DUMMY, 2, ["{prof}", "UTF-8"]),
        text(MODEL.encode() + b"  name: \xff\n"),
    ),
    (Case("profile not YAML", DRY, 2, ["{prof}", "YAML"]), text("build: [unclosed\n")),
    (Case("profile a list", DRY, 2, ["{prof}", "mapping"]), text("- build\n")),
    (Case("build: a list", DRY, 2, ["{prof}", "build"]), text("build: [1, 2]\n")),
    # ---- values of the wrong type or NaN (issue item 6) ------------------------------------
    (
        Case("gpu_memory_gb: .nan in a profile", DRY, 3, ["gpu_memory_gb", "nan"]),
        text(MODEL + BUILD + "  gpu_memory_gb: .nan\n"),
    ),
    (
        Case("gpu_memory_gb: .inf in a profile", DRY, 3, ["gpu_memory_gb"]),
        text(MODEL + BUILD + "  gpu_memory_gb: .inf\n"),
    ),
    (
        Case("kv fraction: .nan in a profile", DRY, 3, ["kv_cache_free_gpu_mem_fraction"]),
        text(MODEL + BUILD + "  kv_cache_free_gpu_mem_fraction: .nan\n"),
    ),
    (
        Case("max_batch_size a list", DRY, 2, ["max_batch_size"]),
        text(MODEL + BUILD + "  max_batch_size: [1, 2]\n"),
    ),
    (Case("target a number", DRY, 2, ["target"]), text(MODEL + BUILD + "  target: 90\n")),
    (Case("force a string", DRY, 2, ["force"]), text(MODEL + BUILD + "  force: 'yes'\n")),
    (
        Case("model: num_hidden_layers a string", DRY, 4, ["num_hidden_layers"]),
        text(MODEL.replace("num_hidden_layers: 2", "num_hidden_layers: many") + BUILD),
    ),
    (
        Case(
            "model: num_hidden_layers 1e9 (YAML float)",
            DRY,
            4,
            ["num_hidden_layers", "1024"],
            timeout_s=30,
        ),
        text(MODEL.replace("num_hidden_layers: 2", "num_hidden_layers: 1.0e+9") + BUILD),
    ),
    (
        Case("model: rms_norm_eps .nan", DRY, 4, ["rms_norm_eps"]),
        text(MODEL + "  rms_norm_eps: .nan\n" + BUILD),
    ),
    (
        Case("run: max_batch_size a list", RUN, 3, ["max_batch_size"]),
        text("run:\n  max_batch_size: [4]\n"),
    ),
    (
        Case("run: kv fraction .nan", RUN, 3, ["kv_cache_free_gpu_mem_fraction"]),
        text("run:\n  kv_cache_free_gpu_mem_fraction: .nan\n"),
    ),
    (
        Case("run: cuda_graphs a string", RUN, 3, ["cuda_graphs"]),
        text("run:\n  cuda_graphs: 'off'\n"),
    ),
    (
        Case("workload: seed a string", BENCH, 3, ["seed"]),
        text("workload:\n  seed: x\n"),
    ),
    (
        Case("workload: num_requests a float", BENCH, 3, ["num_requests"]),
        text("workload:\n  num_requests: 2.5\n"),
    ),
    (
        Case("workload: burstiness .nan", BENCH, 3, ["burstiness"]),
        text("workload:\n  burstiness: .nan\n"),
    ),
]

FLAG_CASES: list[Case] = [
    Case("--gpu_memory_gb nan", [*DUMMY, "--gpu_memory_gb", "nan"], 3, ["gpu_memory_gb", "nan"]),
    Case("--gpu_memory_gb inf", [*DUMMY, "--gpu_memory_gb", "inf"], 3, ["gpu_memory_gb"]),
    Case("--gpu_memory_gb -1", [*DUMMY, "--gpu_memory_gb", "-1"], 3, ["gpu_memory_gb"]),
    Case(
        "--kv_cache_free_gpu_mem_fraction nan (build)",
        [*DUMMY, "--kv_cache_free_gpu_mem_fraction", "nan"],
        3,
        ["kv_cache_free_gpu_mem_fraction"],
    ),  # fmt: skip
    Case(
        "--kv_cache_free_gpu_mem_fraction nan (run)",
        [
            "run",
            "--engine_dir",
            "{tmp}/no_engine",
            "--prompt",
            "hi",
            "--kv_cache_free_gpu_mem_fraction",
            "nan",
        ],
        3,
        ["kv_cache_free_gpu_mem_fraction"],
    ),  # fmt: skip
]


@pytest.mark.parametrize("case,setup", [pytest.param(c, s, id=c.name) for c, s in CASES])
def test_hostile_profile(case: Case, setup: Setup, tmp_path: Path) -> None:
    run_case(case, tmp=tmp_path, prof=setup(tmp_path))


@pytest.mark.parametrize("case", FLAG_CASES, ids=str)
def test_hostile_flag_values(case: Case, tmp_path: Path) -> None:
    run_case(case, tmp=tmp_path, prof=text(MODEL)(tmp_path))


def test_aliases_within_the_bound_still_load(tmp_path: Path) -> None:
    """Bounded, not refused: a profile that reuses a mapping through an alias still works."""
    from llmc.compiler.input_bounds import load_yaml

    path = text("base: &b {a: 1}\nother: *b\n")(tmp_path)
    assert load_yaml(path, "p") == {"base": {"a": 1}, "other": {"a": 1}}
