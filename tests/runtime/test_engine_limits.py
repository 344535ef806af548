"""A loaded engine's limits and workspace: the manifest parsed once, the limits lowered once
and shared by every component, the arena at plan.json's offsets (or at the planner's for
lowered limits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.engines import SMALL_LIMITS
from llmc.base.errors import ConfigError
from llmc.compiler.limits import check_chunked_prefill
from llmc.compiler.memory_plan import plan_workspace
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig


@pytest.fixture(scope="module")
def engine_dir(tiny_engine, tiny_llama_dir) -> Path:
    # max_seq_len 128, max_input_len 64, max_num_tokens 64, max_batch_size 8, 16 per block
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)


def _load(engine_dir: Path, **config) -> EngineRuntime:
    return EngineRuntime.load(engine_dir, RuntimeConfig(device="cpu", **config))


def _offsets(rt: EngineRuntime) -> dict[str, tuple[int, tuple[int, ...]]]:
    ws = rt.runner.workspace
    base = ws.arena.data_ptr()
    return {n: (t.data_ptr() - base, tuple(t.shape)) for n, t in ws.buffers.items()}


def test_limits_lowered_once_and_shared(engine_dir):
    rt = _load(engine_dir, max_batch_size=4, max_num_tokens=48)
    lim = rt.limits
    assert (lim.max_batch_size, lim.max_num_tokens, lim.max_input_len) == (4, 48, 64)
    built = rt.built_limits
    assert (built.max_batch_size, built.max_num_tokens) == (8, 64)
    # one object for every component (no copies of the fields to drift apart)
    assert rt.scheduler.limits is lim and rt.runner.limits is lim
    assert rt.runner.inputs.limits is lim and rt.scheduler.config.limits is lim
    assert rt.summary()["max_num_tokens"] == 48


def test_raising_a_limit_is_refused_naming_both_values(engine_dir):
    with pytest.raises(
        ConfigError, match="max_num_tokens=65 exceeds the engine's max_num_tokens=64"
    ):
        _load(engine_dir, max_num_tokens=65)


def test_chunked_prefill_off_with_a_small_budget_is_the_one_rule(engine_dir):
    with pytest.raises(ConfigError) as want:
        check_chunked_prefill(32, 64, False)
    with pytest.raises(ConfigError) as got:
        _load(engine_dir, max_num_tokens=32, enable_chunked_prefill=False)
    assert str(got.value) == str(want.value)


def test_workspace_offsets_are_those_of_plan_json(engine_dir):
    plan = json.loads((engine_dir / "plan.json").read_text())
    rt = _load(engine_dir)
    want = {b["name"]: (b["offset"], tuple(b["shape"])) for b in plan["buffers"]}
    assert _offsets(rt) == want
    assert rt.runner.workspace.nbytes == plan["workspace_bytes"]


def test_lowered_budget_is_planned_by_the_same_planner(engine_dir):
    rt = _load(engine_dir, max_num_tokens=16)
    planned = plan_workspace(rt.spec, rt.limits)
    assert _offsets(rt) == {b.name: (b.offset, b.shape) for b in planned}
    assert rt.runner.workspace["input_ids"].shape == (16,)


def test_manifest_json_is_read_once(engine_dir, monkeypatch):
    reads = []
    real = Path.read_text

    def read_text(self, *a, **k):
        if self.name == "manifest.json":
            reads.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    _load(engine_dir)
    assert len(reads) == 1
    # on a GPU, "auto" picks the backend from the loaded engine (a cpu build: torch)
    import llmc.runtime.engine_runtime as er
    from llmc.compiler.engine_format import load_engine

    engine = load_engine(engine_dir)
    monkeypatch.setattr(er, "_gpu_arch", lambda: "sm_90")
    assert EngineRuntime._pick_backend("auto", "cuda", engine) == ("torch", None)
    assert EngineRuntime._pick_backend("cuda", "cuda", engine) == ("cuda", "sm_90")
    assert len(reads) == 2
