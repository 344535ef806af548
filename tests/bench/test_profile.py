"""`llmc profile`: Chrome trace validity and nesting, breakdowns, recommendations."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers.engines import SMALL_LIMITS, make_limits, pop_limits
from llmc.base.errors import UsageError
from llmc.cli.main import app
from llmc.runtime.bench.metrics import aggregate
from llmc.runtime.bench.recommend import TuningInputs, recommend
from llmc.runtime.bench.timers import (
    OpEvent,
    OpTimer,
    chrome_trace,
    kernel_family,
    op_breakdown,
    phase_breakdown,
)
from llmc.runtime.records import StepRecord

pytestmark = pytest.mark.usefixtures("small_ceilings")

runner = CliRunner()


def _steps() -> list[StepRecord]:
    ph = {"schedule": 0.1, "prepare": 0.1, "forward": 0.5, "sample": 0.1, "update": 0.1}
    return [
        StepRecord(0, 0.0, 1.0, 64, 64, 0, 2, 4, 10, phase_times=ph),
        StepRecord(1, 1.0, 2.0, 2, 0, 2, 2, 6, 10, phase_times=ph),
    ]


def test_phase_and_op_breakdown() -> None:
    rows = {r.name: r for r in phase_breakdown(_steps())}
    assert rows["forward"].total_s == pytest.approx(1.0) and rows["forward"].share == 0.5
    assert rows["other"].total_s == pytest.approx(0.2)  # time the phases do not cover
    assert phase_breakdown([]) == []
    ev = [OpEvent("linear", 0.0, 0.5, flops=1e12, bytes=1e9), OpEvent("attention", 0.5, 1.0)]
    fam = {r.name: r for r in op_breakdown(ev, "family")}
    assert fam["matmul"].tflops == pytest.approx(2.0) and fam["matmul"].gb_s == pytest.approx(2)
    assert fam["attention"].tflops is None  # no FLOP count: missing, not zero
    assert kernel_family("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kernel_family("paged_attention_decode_kernel") == "attention"
    assert kernel_family("rmsnorm_kernel") == "norm"
    # fused small-batch GEMVs count as matmuls (kernels and the CPU op names)
    for name in (
        "gemv_norm_m1",
        "gemv_norm_silu_m4",
        "gemv_add_m2_scalar",
        "norm_linear",
        "norm_gate_up_silu",
        "linear_residual_add",
    ):
        assert kernel_family(name) == "matmul", name


def test_op_timer_hooks_and_restores() -> None:
    class B:
        def linear(self, x, w, bias=None, out=None):
            return x

    b = B()
    t = OpTimer().attach(b)
    b.linear(1, 2)
    t.detach()
    b.linear(1, 2)
    assert [e.name for e in t.events] == ["linear"] and "linear" not in b.__dict__


def test_trace_nests_ops_inside_steps() -> None:
    ops = [OpEvent("linear", 0.2, 0.3), OpEvent("attention", 1.2, 1.4), OpEvent("x", 5.0, 6.0)]
    tr = chrome_trace(_steps(), ops, [OpEvent("gemm_kernel", 0.25, 0.28, family="matmul")])
    ev = tr["traceEvents"]
    steps = [e for e in ev if e.get("cat") == "step"]
    nested = [e for e in ev if e.get("cat") == "op"]
    assert len(steps) == 2 and [e["name"] for e in nested] == ["linear", "attention"]
    for op in nested:  # each op inside the step it names, on the same thread
        st = next(s for s in steps if s["name"] == f"step {op['args']['step']}")
        assert st["tid"] == op["tid"] and st["ts"] <= op["ts"]
        assert op["ts"] + op["dur"] <= st["ts"] + st["dur"]
    phases = [e for e in ev if e.get("cat") == "phase"]
    assert [p["name"] for p in phases[:5]] == ["schedule", "prepare", "forward", "sample", "update"]
    assert any(e.get("cat") == "kernel" and e["pid"] == 2 for e in ev)
    assert any(e["ph"] == "C" and e["name"] == "kv_utilization" for e in ev)


def _agg(peak_tokens: int, batch: int, used: int, total: int, preempted: int = 0):
    steps = [StepRecord(0, 0.0, 1.0, peak_tokens, peak_tokens, 0, batch, used, total, preempted)]
    return aggregate([], steps)


def _inputs(**kw) -> TuningInputs:
    """TuningInputs of an engine built for 8192 tokens per step and 256 sequences; ``kw``:
    TuningInputs fields or the run's limits (max_num_tokens, max_seq_len, ...)."""
    built = make_limits(
        max_batch_size=256, max_num_tokens=8192, max_seq_len=256, tokens_per_block=32
    )
    run = pop_limits(kw)
    base = dict(
        limits=dataclasses.replace(built, **run), build_limits=built, max_kv_tokens=None,
        kv_cache_free_gpu_mem_fraction=0.9, max_request_tokens=256, max_prompt_tokens=128,
        max_in_flight=1000, kv_bytes_per_token=131072, workspace_bytes=1 << 30,
    )  # fmt: skip
    return TuningInputs(**{**base, **kw})


def test_recommendations_from_observed_peaks() -> None:
    # budget never filled, KV mostly empty, batch cap reached with KV headroom
    recs = {r.setting: r for r in recommend(_agg(2000, 256, 1000, 10000), _inputs())}
    assert recs["max_num_tokens"].suggested == "2,048"
    assert "not the KV pool" in recs["max_num_tokens"].reason
    assert recs["KV pool"].suggested == "max_kv_tokens=38,400"  # 1000 blocks × 1.2 × 32
    assert recs["max_batch_size"].suggested == "1000"  # pool holds 1250 of 8 blocks each
    assert "rebuild" in recs["max_batch_size"].reason
    # KV pool full with preemptions: grow the pool, not the batch
    recs = {r.setting: r for r in recommend(_agg(300, 64, 500, 500, 3), _inputs())}
    assert recs["KV pool"].suggested == "max_kv_tokens=65,536"  # 256 requests × 8 blocks × 32
    assert "preemptions" in recs["KV pool"].reason
    assert recs["max_batch_size"].suggested == "64"
    # long prompts chunked by a small budget
    recs = {r.setting: r for r in recommend(_agg(512, 4, 10, 100), _inputs(max_num_tokens=512,
            max_prompt_tokens=2000))}  # fmt: skip
    assert recs["max_num_tokens"].suggested == "2,048" and "chunks" in recs["max_num_tokens"].reason
    assert recommend(aggregate([], []), _inputs()) == []  # no data, no advice


def test_kv_pool_advice_never_goes_below_one_max_seq_len_request() -> None:
    # peak 16 of 729 blocks, but the engine's max_seq_len is 8192: the runtime refuses a pool
    # that cannot hold one such request, so the advice stops at 8192 tokens
    recs = {r.setting: r for r in recommend(_agg(256, 8, 16, 729), _inputs(max_seq_len=8192))}
    assert recs["KV pool"].suggested == "max_kv_tokens=8,192"
    assert "max_seq_len=8,192" in recs["KV pool"].reason
    # a pool already at that floor is kept
    recs = {r.setting: r for r in recommend(_agg(256, 8, 16, 256), _inputs(max_seq_len=8192))}
    assert recs["KV pool"].suggested == "keep"


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir) -> Path:
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)


def test_profile_cli_trace_and_report(engine, tmp_path) -> None:
    trace, out = tmp_path / "trace.json", tmp_path / "p.json"
    res = runner.invoke(app, [
        "profile", "--engine_dir", str(engine), "--device", "cpu", "--num_requests", "4",
        "--isl", "40", "--osl", "4", "--trace", str(trace), "--json", str(out), "--kernels",
    ])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    for title in ("Time per phase", "Time per op family", "Memory: plan vs measured",
                  "Recommendations", "KV utilization", "per-step token budget"):  # fmt: skip
        assert title in res.stdout
    tr = json.loads(trace.read_text())  # valid JSON in Chrome's trace-event form
    ev = tr["traceEvents"]
    assert all({"ph", "name", "pid"} <= set(e) for e in ev)
    steps = [e for e in ev if e.get("cat") == "step"]
    ops = [e for e in ev if e.get("cat") == "op"]
    assert steps and len(ops) > 10 * len(steps) // 2
    by_name = {s["name"]: s for s in steps}
    for op in ops:
        st = by_name[f"step {op['args']['step']}"]
        assert st["ts"] <= op["ts"] and op["ts"] + op["dur"] <= st["ts"] + st["dur"] + 1e-3
    assert {"linear", "attention", "sample"} <= {o["name"] for o in ops}
    r = json.loads(out.read_text())
    assert r["profile"]["phases"] and r["profile"]["op_families"]
    assert {x["setting"] for x in r["profile"]["recommendations"]} == {
        "max_num_tokens", "KV pool", "max_batch_size"
    }  # fmt: skip
    png = str(tmp_path / "x.png")
    res = runner.invoke(app, ["profile", "--engine_dir", str(engine), "--device", "cpu",
                              "--num_requests", "1", "--plot", png])  # fmt: skip
    try:
        import matplotlib  # noqa: F401

        assert res.exit_code == 0
    except ImportError:
        assert res.exit_code == UsageError.exit_code and "matplotlib" in res.stderr


def test_profile_json_on_stdout_is_the_only_output(engine) -> None:
    res = runner.invoke(app, [
        "profile", "--engine_dir", str(engine), "--device", "cpu", "--num_requests", "2",
        "--isl", "8", "--osl", "2", "--json", "-",
    ])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)  # nothing but the JSON document
    assert data["profile"]["recommendations"] and data["schema"] == "llmc.bench"


def test_gpu_idle_merges_overlaps_and_measures_the_decode_stretch() -> None:
    from llmc.runtime.bench.gpu_idle import gpu_idle

    # steps: a prefill step [0, 10), then three decode-only steps [10, 14), [14, 18), [18, 22)
    steps = [StepRecord(0, 0.0, 10.0, 64, 64, 0, 1, 4, 10)] + [
        StepRecord(i, 10.0 + 4 * (i - 1), 14.0 + 4 * (i - 1), 2, 0, 2, 2, 4, 10) for i in (1, 2, 3)
    ]
    kernels = [
        OpEvent("prefill_gemm", 0.0, 8.0),
        OpEvent("overlapping", 6.0, 9.0),  # merged with the one above: busy [0, 9)
        OpEvent("decode_a", 10.0, 13.0),
        OpEvent("decode_b", 14.0, 17.0),
        OpEvent("decode_c", 18.0, 22.0),
        OpEvent("empty", 5.0, 5.0),  # zero length: ignored
    ]
    idle = gpu_idle(kernels, steps)
    assert idle is not None
    assert idle.window_s == pytest.approx(22.0)
    assert idle.idle_share == pytest.approx(1 - (9 + 3 + 3 + 4) / 22)
    assert idle.decode_window_s == pytest.approx(12.0)  # first to last decode-only step
    assert idle.decode_idle_share == pytest.approx(1 - 10 / 12)
    assert gpu_idle([], steps) is None
    assert gpu_idle(kernels, steps[:3]).decode_idle_share is None  # < 3 decode-only steps


def test_gpu_idle_line_names_both_shares() -> None:
    from llmc.runtime.bench.gpu_idle import GpuIdle
    from llmc.runtime.bench.profile_report import gpu_idle_line

    text = gpu_idle_line(GpuIdle(2.0, 0.025, 1.5, 0.008))
    assert "2.5% of the run" in text and "0.8% of the decode-only stretch" in text
    assert "decode-only" not in gpu_idle_line(GpuIdle(2.0, 0.025))


def test_host_overlap_advice_from_gpu_idle() -> None:
    key = "cuda_graphs / async_scheduling"
    agg = _agg(1000, 960, 100, 1000)

    def advice(**kw):
        recs = {r.setting: r for r in recommend(agg, _inputs(**kw))}
        return recs.get(key)

    assert advice() is None  # no kernel events (CPU): nothing said
    both = dict(cuda_graphs=True, async_scheduling=True)
    assert advice(gpu_decode_idle_share=0.01, **both).suggested == "keep"
    assert (
        advice(gpu_decode_idle_share=0.3, cuda_graphs=False, async_scheduling=True).suggested
        == "--cuda_graphs"
    )
    assert (
        advice(gpu_decode_idle_share=0.3, cuda_graphs=True, async_scheduling=False).suggested
        == "--async_scheduling"
    )
    bound = advice(gpu_decode_idle_share=0.4, **both)
    assert bound.suggested == "keep (host-bound)"
    assert "960" in bound.reason and "max_batch_size" in bound.reason
    assert "40.0%" in bound.observed


def test_profiler_and_profile_cli_report_the_same_keys(engine, tmp_path) -> None:
    """One profiler: `llmc profile`'s `profile` section and `Profiler.summary()` come from
    the same ProfileSession, so they have the same keys, row fields and advice."""
    from llmc import LLM, Profiler, SamplingParams
    from llmc.runtime.bench.profile_report import PROFILE_KEYS

    out = tmp_path / "p.json"
    res = runner.invoke(app, [
        "profile", "--engine_dir", str(engine), "--device", "cpu", "--num_requests", "3",
        "--isl", "8", "--osl", "3", "--warmup", "0", "--json", str(out),
    ])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    cli = json.loads(out.read_text())["profile"]
    with LLM(engine, device="cpu") as llm, Profiler(llm) as prof:
        llm.generate([[3, 4, 5]] * 3, SamplingParams(max_new_tokens=3, ignore_eos=True))
    lib = prof.summary()
    assert list(cli) == list(PROFILE_KEYS)
    assert set(lib) - set(PROFILE_KEYS) == {"window_s", "runtime", "aggregates"}
    assert cli["op_source"] == lib["op_source"] == "wall-clock op hooks (CPU)"
    for key in ("phases", "op_families", "ops", "recommendations"):
        assert cli[key] and lib[key], key
        assert set(cli[key][0]) == set(lib[key][0]), key
    settings = {r["setting"] for r in cli["recommendations"]}
    assert settings == {r["setting"] for r in lib["recommendations"]}
    assert cli["peak_memory"]["kind"] == lib["peak_memory"]["kind"]
    assert cli["gpu_idle"] is None and lib["gpu_idle"] is None  # no kernel timing on CPU


def test_profile_times_only_the_measured_requests(engine, tmp_path) -> None:
    """Warm-up requests are excluded from the op events as from the steps: every CPU op
    of the trace falls inside a measured step."""
    trace = tmp_path / "t.json"
    res = runner.invoke(app, [
        "profile", "--engine_dir", str(engine), "--device", "cpu", "--num_requests", "2",
        "--isl", "8", "--osl", "2", "--warmup", "2", "--trace", str(trace), "--json", "-",
    ])  # fmt: skip
    assert res.exit_code == 0, res.stderr
    prof = json.loads(res.stdout)["profile"]
    ev = json.loads(trace.read_text())["traceEvents"]
    nested = [e for e in ev if e.get("cat") == "op"]
    calls = sum(r["count"] for r in prof["ops"])
    assert nested and len(nested) == calls  # none dropped as "outside every step"
