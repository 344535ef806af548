"""Memory planner: packing invariants (property test), buffer contract, capacity rules."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.engines import make_limits, pop_limits
from llmc.base.errors import CapacityError, EngineError
from llmc.compiler.limits import EngineLimits
from llmc.compiler.memory_plan import (
    ALIGNMENT,
    OPS,
    BufferSpec,
    MemoryPlan,
    kv_cache_blocks,
    pack_buffers,
    plan_memory,
    plan_mismatch,
    plan_workspace,
    run_workspace,
)
from llmc.compiler.spec import ModelSpec

LLAMA3_8B = ModelSpec(
    architecture="LlamaForCausalLM",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
GIB = 1 << 30


@st.composite
def buffer_sets(draw):
    n = draw(st.integers(1, 24))
    out = []
    for k in range(n):
        first = draw(st.integers(0, 14))
        last = draw(st.integers(first, 14))
        shape = tuple(draw(st.lists(st.integers(1, 700), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64", "int32"]))
        out.append(BufferSpec(f"b{k}", shape, dtype, first, last))
    return out


@settings(max_examples=200, deadline=None)
@given(buffer_sets())
def test_packing_never_overlaps_live_buffers(buffers):
    placed, packed, naive = pack_buffers(buffers)
    assert [p.name for p in placed] == [b.name for b in buffers]
    for p in placed:
        assert p.offset % ALIGNMENT == 0
        assert p.offset + p.nbytes <= packed
    for i, a in enumerate(placed):
        for b in placed[i + 1 :]:
            live_together = a.first <= b.last and b.first <= a.last
            disjoint = a.offset + a.nbytes <= b.offset or b.offset + b.nbytes <= a.offset
            assert not live_together or disjoint, (a, b)
    assert packed <= naive
    assert naive == sum(-(-b.nbytes // ALIGNMENT) * ALIGNMENT for b in buffers)


def test_disjoint_lifetimes_share_memory():
    a = BufferSpec("a", (1000,), "float32", 0, 1)
    b = BufferSpec("b", (1000,), "float32", 2, 3)
    c = BufferSpec("c", (1000,), "float32", 1, 2)
    placed, packed, naive = pack_buffers([a, b, c])
    off = {p.name: p.offset for p in placed}
    assert off["a"] == off["b"] and off["c"] != off["a"]
    assert packed == 4096 + 4000 and naive == 3 * 4096


def _limits(**kw) -> EngineLimits:
    args = dict(dtype="bfloat16", max_batch_size=256, max_num_tokens=8192, max_seq_len=4096)
    return make_limits(tokens_per_block=32, **{**args, **kw})


def _plan(**kw):
    """plan_memory for LLAMA3_8B; ``kw``: its arguments or EngineLimits fields."""
    return plan_memory(LLAMA3_8B, _limits(**pop_limits(kw)), **kw)


def test_llama3_8b_buffers_and_sizes():
    plan = _plan()
    t, b = 8192, 256
    shapes = {p.name: p.shape for p in plan.buffers}
    assert shapes["residual"] == (t, 4096)
    assert shapes["qkv"] == (t, (32 + 16) * 128)
    assert shapes["gate_up"] == (t, 2 * 14336)
    assert shapes["act"] == (t, 14336)
    assert shapes["logits"] == (b, 128256) and plan.buffer("logits").dtype == "float32"
    assert shapes["attn_partial_out"] == (b, 32, 32, 128)
    assert shapes["block_tables"] == (b, 4096 // 32)
    assert shapes["cu_seqlens_q"] == (b + 1,)
    assert plan.buffer("input_ids").dtype == "int64"
    # the peak is at silu_mul: residual + normed + proj_out + gate_up + act
    peak = (3 * 4096 + 2 * 14336 + 14336) * t * 2
    assert peak <= plan.workspace_bytes < peak + 2 * 2**20
    assert plan.workspace_bytes < plan.naive_workspace_bytes
    assert plan.weight_bytes_total == LLAMA3_8B.num_parameters() * 2
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert plan.kv_bytes_per_block == plan.kv_bytes_per_token * 32
    assert plan.ops == OPS and plan.capacity is None


def test_capacity_follows_free_memory_fraction():
    plan = _plan(device_memory_bytes=80 * GIB, memory_source="test")
    cap = plan.capacity
    free = 80 * GIB - plan.weight_bytes_total - plan.workspace_bytes
    assert cap.free_after_weights_bytes == free
    assert cap.kv_blocks == int(free * 0.9) // plan.kv_bytes_per_block
    assert cap.kv_tokens == cap.kv_blocks * 32
    assert cap.max_concurrent_requests == cap.kv_blocks // (4096 // 32)


def test_one_request_must_fit_with_suggestion():
    with pytest.raises(CapacityError) as e:
        _plan(device_memory_bytes=16 * GIB, memory_source="--gpu_memory_gb", max_seq_len=8192)
    msg = str(e.value)
    assert "max_seq_len=8192" in msg and "--max_seq_len" in msg and "--gpu_memory_gb" in msg
    suggested = int(msg.split("--max_seq_len ")[1].split()[0])
    ok = _plan(device_memory_bytes=16 * GIB, memory_source="x", max_seq_len=suggested)
    assert ok.capacity.max_concurrent_requests == 1
    # weights alone do not fit: only the memory suggestion
    with pytest.raises(CapacityError, match="--gpu_memory_gb 1[67]"):
        _plan(device_memory_bytes=8 * GIB, memory_source="x")


def test_runtime_kv_cache_blocks():
    plan = _plan()
    per_block = plan.kv_bytes_per_block
    assert kv_cache_blocks(plan, 1000 * per_block, 0.5) == 500
    assert kv_cache_blocks(plan, 1000 * per_block, 0.5, max_kv_tokens=200 * 32 - 5) == 200
    with pytest.raises(CapacityError, match="max_seq_len=4096"):
        kv_cache_blocks(plan, 100 * per_block, 0.9)


def test_plan_json_round_trip():
    plan = _plan(device_memory_bytes=80 * GIB, memory_source="test")
    assert MemoryPlan.from_json(plan.to_json()) == plan


def test_run_workspace_is_the_plan_or_the_same_planner_for_lowered_limits():
    plan = _plan(max_num_tokens=2048, max_batch_size=64)
    assert run_workspace(LLAMA3_8B, plan.limits, plan) is plan.buffers
    assert plan_workspace(LLAMA3_8B, plan.limits) == plan.buffers
    low = plan.limits.lowered(max_num_tokens=512)
    got = run_workspace(LLAMA3_8B, low, plan)
    assert got == plan_workspace(LLAMA3_8B, low) and got != plan.buffers
    assert {b.name: b.shape for b in got}["residual"] == (512, 4096)
    assert run_workspace(LLAMA3_8B, low, None) == got


def test_plan_mismatch_names_what_differs():
    plan = _plan(max_num_tokens=2048, max_batch_size=64)
    assert plan_mismatch(plan, LLAMA3_8B) is None
    moved = tuple(dataclasses.replace(b, offset=0) if b.name == "act" else b for b in plan.buffers)
    msg = plan_mismatch(dataclasses.replace(plan, buffers=moved), LLAMA3_8B)
    assert msg is not None and "'act'" in msg
    msg = plan_mismatch(dataclasses.replace(plan, kv_bytes_per_token=1), LLAMA3_8B)
    assert msg is not None and "kv_bytes_per_token" in msg
    # the build's capacity report is not part of the comparison
    with_cap = _plan(max_num_tokens=2048, max_batch_size=64, device_memory_bytes=80 * GIB)
    assert plan_mismatch(with_cap, LLAMA3_8B) is None


def test_plan_of_another_format_version_is_refused():
    d = json.loads(_plan().to_json())
    assert d["limits"]["max_num_tokens"] == 8192 and "nbytes" in d["buffers"][0]
    d["version"] = 1
    with pytest.raises(EngineError, match="format version 1.*rebuild"):
        MemoryPlan.from_dict(d)
