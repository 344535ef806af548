"""Engine variants of one checkpoint built and run through the CLI, for the quantization
end-to-end suites (tests/cli/test_fp8_e2e.py, tests/runtime/test_weight_only_cli.py):

- ``CPU_LIMITS``: the small CPU build flags both use;
- ``cli``: ``llmc`` invoked in-process (typer's CliRunner), arguments str()-ed;
- ``build_variants``: ``llmc build`` of each variant's flags → name: (engine dir, report);
- ``run_tokens``: greedy tokens of ``llmc run --json``, checked equal to the Python API's;
- ``agreement``: the share of positions where two token lists agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from llmc import LLM, SamplingParams
from llmc.cli.main import app

CPU_LIMITS = [
    "--target", "cpu", "--dtype", "float32", "--max_seq_len", "256", "--max_batch_size", "8",
    "--max_num_tokens", "256", "--tokens_per_block", "16", "--gpu_memory_gb", "1",
]  # fmt: skip


def cli(*args: Any) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def build_variants(
    checkpoint: Path, root: Path, variants: dict[str, list[str]]
) -> dict[str, tuple[Path, str]]:
    out = {}
    for name, flags in variants.items():
        d = root / name
        res = cli("build", "--checkpoint_dir", checkpoint, "--output_dir", d, *CPU_LIMITS, *flags)
        assert res.exit_code == 0, res.stderr
        out[name] = (d, res.stdout)
    return out


def run_tokens(engine: Path, prompts: list[str], new: int) -> list[list[int]]:
    args = [a for p in prompts for a in ("--prompt", p)]
    res = cli("run", "--engine_dir", engine, *args, "--max_new_tokens", new, "--ignore_eos",
              "--device", "cpu", "--json")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    outs = json.loads(res.stdout)["outputs"]
    assert all(o["error"] is None and len(o["token_ids"]) == new for o in outs)
    assert all(o["text"] for o in outs)
    tokens = [o["token_ids"] for o in outs]
    with LLM(engine_dir=str(engine), device="cpu") as llm:  # the API: the same tokens
        api = llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert [o.token_ids for o in api] == tokens
    return tokens


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    same = sum(a == b for x, y in zip(ours, ref, strict=True) for a, b in zip(x, y, strict=True))
    return same / sum(map(len, ref))
