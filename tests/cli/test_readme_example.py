"""The README's Python API example runs, as written, on a tiny engine.

The example is read from README.md (its ```python block that constructs an ``LLM``), else
from docs/PYTHON_API.md, so the documented snippet cannot rot. It is pointed at a tiny
checkpoint through ``LLMC_CHECKPOINT`` and at a fresh engine path through ``LLMC_ENGINE``,
so it runs its own build step too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text()) if path.is_file() else []


def api_example() -> tuple[str, Path]:
    for doc in (ROOT / "README.md", ROOT / "docs" / "PYTHON_API.md"):
        blocks = [b for b in python_blocks(doc) if "LLM(" in b]
        if blocks:
            return blocks[0], doc
    raise AssertionError("no ```python block with LLM( in README.md or docs/PYTHON_API.md")


def test_python_api_doc_has_exactly_one_python_block():
    assert len(python_blocks(ROOT / "docs" / "PYTHON_API.md")) == 1


def test_readme_example_runs(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    code, doc = api_example()
    for name in ("LLM", "SamplingParams", "BuildConfig", "build", "Profiler"):
        assert re.search(rf"\b{name}\b", code), f"the example does not use {name}"
    engine = tmp_path / "engines" / "tiny"
    monkeypatch.setenv("LLMC_CHECKPOINT", str(tiny_llama_dir))
    monkeypatch.setenv("LLMC_ENGINE", str(engine))
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(doc), "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert (engine / "manifest.json").is_file(), "the example's build step did not run"
    assert "TTFT" in out and "Time per phase" in out and "output tokens/s" in out
    from llmc.api import live_llms

    assert not live_llms(), "the example's LLM was not shut down"
