"""The Python API (llmc/__init__.py, llmc/api.py, llmc/profiler_api.py) on tiny CPU engines."""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import json
import shutil
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

import llmc
from helpers.engines import tiny_build_config
from llmc import LLM, BuildConfig, Profiler, Request, SamplingParams
from llmc.base.errors import ConfigError, EngineError, RequestError

API_LIMITS = dict(max_batch_size=4, max_seq_len=128, max_num_tokens=64, tokens_per_block=16)
"""Built for 4 sequences: the tests ask for 8 (refused) and 1, 2 (lowered)."""


@pytest.fixture(scope="module")
def engine_dir(tiny_engine, tiny_llama_dir) -> Path:
    return tiny_engine(tiny_llama_dir, **API_LIMITS)


@pytest.fixture(scope="module")
def llm(engine_dir):
    with LLM(engine_dir, device="cpu") as model:
        yield model


def test_public_names_are_lazy_and_are_the_cli_objects():
    code = (
        "import sys, llmc; assert 'torch' not in sys.modules and 'llmc.api' not in sys.modules; "
        "from llmc import LLM, SamplingParams, BuildConfig, build, Profiler; "
        "print(llmc.__version__, llmc.ENGINE_FORMAT_VERSION)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [llmc.__version__, str(llmc.ENGINE_FORMAT_VERSION)]
    from llmc.compiler import build_config, builder
    from llmc.runtime import engine_runtime, types

    assert llmc.build is builder.build and llmc.BuildConfig is build_config.BuildConfig
    assert llmc.SamplingParams is types.SamplingParams and llmc.Request is types.Request
    assert llmc.RuntimeConfig is engine_runtime.RuntimeConfig
    assert set(llmc.__all__) <= set(dir(llmc))
    for name in llmc.__all__:
        obj = getattr(llmc, name)
        assert isinstance(obj, (str, int)) or inspect.getdoc(obj), f"{name} has no docstring"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        llmc.nope  # noqa: B018


def test_every_build_config_field_has_a_docstring():
    src = Path(inspect.getsourcefile(BuildConfig)).read_text()
    cls = next(
        n
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.ClassDef) and n.name == "BuildConfig"
    )
    body = cls.body
    documented = {
        stmt.target.id
        for stmt, nxt in zip(body, body[1:], strict=False)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(nxt, ast.Expr)
        and isinstance(nxt.value, ast.Constant)
        and isinstance(nxt.value.value, str)
    }
    assert set(BuildConfig.field_names()) == documented


def test_generate_matches_transformers_greedy(llm, tiny_llama_dir):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    prompt = [1, 17, 42, 99, 5, 230]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
            pad_token_id=0, min_new_tokens=8,
        )[0, len(prompt):].tolist()  # fmt: skip
    (out,) = llm.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert out.token_ids == ref
    assert out.prompt_token_ids == prompt and out.finish_reason.value == "length"


def test_generate_outputs_in_order_with_timings(llm):
    outs = llm.generate(
        ["hello world", "abc", [5, 6, 7]],
        [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 5, 7)],
    )
    assert [len(o.token_ids) for o in outs] == [3, 5, 7]
    assert outs[0].prompt == "hello world" and outs[2].prompt_token_ids == [5, 6, 7]
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)
    for o in outs:
        t = o.timings
        assert o.ok and 0 <= t.queue_s <= t.ttft_s <= t.e2e_s
        assert t.num_output_tokens == len(o.token_ids) and t.tpot_s > 0
    (single,) = llm.generate("hello world", SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert single.token_ids == outs[0].token_ids  # greedy: batching does not change tokens
    with pytest.raises(ConfigError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(RequestError, match="priority=1.5: must be an integer"):
        llm.generate("a", priority=1.5)
    (bad,) = llm.generate([[999]])  # outside the vocabulary: an error output, not an exception
    assert not bad.ok and "outside the vocabulary" in bad.error


def test_runtime_limits_can_be_lowered_never_raised(engine_dir):
    with pytest.raises(
        ConfigError, match=r"max_batch_size=8 exceeds the engine's max_batch_size=4"
    ):
        LLM(engine_dir, device="cpu", max_batch_size=8)
    with pytest.raises(ConfigError, match=r"max_num_tokens=128 exceeds .*max_num_tokens=64"):
        LLM(engine_dir, device="cpu", max_num_tokens=128)
    with pytest.raises(ConfigError, match="always batches in flight"):
        LLM(engine_dir, enable_inflight_batching=False)
    with pytest.raises(ConfigError, match="needs model .*engine_dir .* or checkpoint_dir"):
        LLM()
    with pytest.raises(ConfigError, match="pass one or the other"):
        LLM(engine_dir, checkpoint_dir=engine_dir)
    with pytest.raises(ConfigError, match="scheduler_policy"):
        LLM(engine_dir, scheduler_policy="fifo")
    with pytest.raises(ConfigError, match="decode_steps_per_iteration"):
        LLM(engine_dir, device="cpu", decode_steps_per_iteration=0)
    sp = SamplingParams(max_new_tokens=9, ignore_eos=True)
    with LLM(engine_dir, device="cpu", decode_steps_per_iteration=4) as multi:
        assert multi.config.decode_steps_per_iteration == 4
        windowed = [o.token_ids for o in multi.generate(["hi", "a longer prompt"], sp)]
        assert max(r.num_steps for r in multi.step_records) == 4  # windows ran
    with LLM(engine_dir, device="cpu") as single:
        assert [o.token_ids for o in single.generate(["hi", "a longer prompt"], sp)] == windowed
    with LLM(
        engine_dir, device="cpu", max_batch_size=2, max_num_tokens=32, max_kv_tokens=256
    ) as small:
        s = small.summary()
        assert (s["max_batch_size"], s["max_num_tokens"], s["kv_tokens"]) == (2, 32, 256)
        assert small.generate("hi", SamplingParams(max_new_tokens=2))[0].ok


def test_streaming_deltas_concatenate_to_the_final_text(llm):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)

    async def collect(**kw):
        return [r async for r in llm.generate_async("hello world", sp, **kw)]

    deltas = asyncio.run(collect())
    final = deltas[-1]
    assert final.is_final and sum(r.is_final for r in deltas) == 1 and len(deltas) > 2
    assert "".join(r.new_text for r in deltas) == final.text
    assert [t for r in deltas for t in r.new_token_ids] == final.token_ids
    (blocking,) = llm.generate("hello world", sp)
    assert final.text == blocking.text and final.token_ids == blocking.token_ids
    (only,) = asyncio.run(collect(streaming=False))
    assert only.is_final and only.text == final.text

    async def two_at_once():  # concurrent streams share the running batch
        a, b = collect(), collect()
        return await asyncio.gather(a, b)

    for stream in asyncio.run(two_at_once()):
        assert stream[-1].token_ids == final.token_ids

    async def bad():
        async for _ in llm.generate_async([999], sp):
            pass

    with pytest.raises(RequestError, match="outside the vocabulary"):
        asyncio.run(bad())


def test_leaving_a_stream_early_cancels_the_request(llm):
    async def first_delta():
        agen = llm.generate_async("hello", SamplingParams(max_new_tokens=100, ignore_eos=True))
        async for r in agen:
            await agen.aclose()
            return r

    r = asyncio.run(first_delta())
    ex = llm.executor
    for _ in range(200):
        rec = next(x for x in ex.request_records if x.request_id == r.request_id)
        if rec.finish_reason is not None:
            break
        ex.await_responses(r.request_id, timeout=0.05)
    assert rec.finish_reason == "cancelled" and rec.num_output_tokens < 100
    assert ex.kv_stats().free_blocks == ex.kv_stats().total_blocks


def test_late_high_priority_request_overtakes_queued_low_priority_ones(engine_dir):
    with LLM(engine_dir, device="cpu", max_batch_size=1) as one:
        ex = one.executor

        def req(priority: int, n: int, streaming: bool = False) -> Request:
            sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
            ids = [3, 4, 5]
            return Request(
                prompt_token_ids=ids, sampling=sp, priority=priority, streaming=streaming
            )

        first = ex.enqueue_request(req(0, 40, streaming=True))  # the only batch slot
        got = ex.await_responses(first)  # it is running: its first token came
        assert got and not got[-1].is_final
        low = [ex.enqueue_request(req(0, 2)) for _ in range(2)]
        high = ex.enqueue_request(req(5, 2))  # arrives last
        finals = {}
        while len(finals) < 4:
            for r in ex.await_responses([first, *low, high]):
                if r.is_final:
                    finals[r.request_id] = r
        recs = {r.request_id: r for r in ex.request_records}
        order = sorted(finals, key=lambda i: recs[i].scheduled_time)
        assert order == [first, high, *low]
        assert all(finals[i].finish_reason.value == "length" for i in finals)
        # cancel a queued request through the executor
        blocker = ex.enqueue_request(req(0, 40))
        queued = ex.enqueue_request(req(0, 2))
        assert ex.cancel_request(queued)
        got = []
        while not any(r.request_id == queued and r.is_final for r in got):
            got += ex.await_responses(queued)
        assert got[-1].finish_reason.value == "cancelled" and got[-1].token_ids == []
        ex.cancel_request(blocker)


def test_on_the_fly_build_reuses_its_cache(tiny_llama_dir, tmp_path, monkeypatch):
    from llmc.compiler import builder

    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    ckpt = shutil.copytree(tiny_llama_dir, tmp_path / "ckpt")
    calls = []
    real = builder.build

    def spy(config, *a, **k):
        calls.append(config)
        return real(config, *a, **k)

    monkeypatch.setattr(builder, "build", spy)
    cfg = tiny_build_config(**API_LIMITS)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(checkpoint_dir=ckpt, build_config=cfg, device="cpu") as a:
        first = a.generate([3, 4, 5], sp)[0].token_ids
        dir_a = a.engine_dir
    assert len(calls) == 1 and dir_a.parent == tmp_path / "cache" / "engines"
    assert calls[0].checkpoint_dir == str(ckpt) and calls[0].output_dir == str(dir_a)
    with LLM(checkpoint_dir=ckpt, build_config=cfg, device="cpu") as b:  # cache hit
        assert b.engine_dir == dir_a and b.generate([3, 4, 5], sp)[0].token_ids == first
    assert len(calls) == 1
    with LLM(build_config=cfg.replace(checkpoint_dir=str(ckpt), max_batch_size=2)) as c:
        assert c.engine_dir != dir_a  # another build config: another engine
    assert len(calls) == 2
    (dir_a / "plan.json").write_text("{}")  # a damaged cache entry is rebuilt, once
    with pytest.raises(EngineError, match="plan.json"):
        LLM(dir_a)
    with LLM(checkpoint_dir=ckpt, build_config=cfg) as d:
        assert d.engine_dir == dir_a and d.generate([3, 4, 5], sp)[0].token_ids == first
    assert len(calls) == 3 and calls[-1].force
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text() + "\n")
    with LLM(checkpoint_dir=ckpt, build_config=cfg) as e:  # the checkpoint changed
        assert e.engine_dir != dir_a
    assert len(calls) == 4


def test_context_manager_releases_the_engine(engine_dir):
    with LLM(engine_dir, device="cpu") as tmp:
        runner = weakref.ref(tmp.runtime.runner)
        ex = tmp.executor
        rid = ex.enqueue_request(
            Request(
                prompt_token_ids=[3], sampling=SamplingParams(max_new_tokens=100, ignore_eos=True)
            )
        )
        del ex
    gc.collect()
    assert runner() is None, "weights and KV cache are still referenced after exit"
    assert tmp.closed and "shut down" in repr(tmp)
    with pytest.raises(EngineError, match="shut down"):
        tmp.generate("hi")
    tmp.shutdown()  # idempotent
    assert rid == 0


def test_profiler_reads_the_window_of_one_generate(llm, tmp_path):
    from rich.console import Console

    llm.generate("warm up", SamplingParams(max_new_tokens=2))  # outside the window
    p = Profiler()
    with pytest.raises(ConfigError, match="not started"):
        p.stop()
    with pytest.raises(ConfigError, match="nothing recorded"):
        p.summary()
    n_steps = len(llm.executor.step_records)
    p.start()
    outs = llm.generate(["hello", "abc"], SamplingParams(max_new_tokens=5, ignore_eos=True))
    p.stop()
    s = p.summary()
    agg = s["aggregates"]
    assert agg["num_requests"] == 2 and agg["total_output_tokens"] == 10
    assert agg["num_steps"] == len(llm.executor.step_records) - n_steps > 0
    assert {r["name"] for r in s["phases"]} >= {"schedule", "forward", "update"}
    assert {r["name"] for r in s["op_families"]} >= {"matmul", "attention"}
    assert s["op_source"].startswith("wall-clock") and s["runtime"]["device"] == "cpu"
    assert json.dumps(s)  # a plain dict
    assert outs[0].timings.ttft_s <= s["window_s"]
    con = Console(record=True, width=140)
    p.print(con)
    text = con.export_text()
    for title in ("Throughput", "Latency", "Time per phase", "Time per op family", "KV cache"):
        assert title in text
    trace = json.loads(p.export_chrome_trace(tmp_path / "t.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) == agg["num_steps"]
    assert any(e.get("cat") == "op" for e in trace["traceEvents"])
    assert not hasattr(llm.runtime.runner.backend.__dict__.get("linear"), "__wrapped__")
    assert "linear" not in llm.runtime.runner.backend.__dict__  # op hooks detached


def test_profiler_without_an_llm_is_an_error(engine_dir):
    from llmc.api import live_llms

    if live_llms():
        with LLM(engine_dir, device="cpu"), pytest.raises(ConfigError, match="running LLMs"):
            Profiler().start()
    else:
        with pytest.raises(ConfigError, match="found 0 running LLMs"):
            Profiler().start()


def test_cli_build_goes_through_the_build_function(tiny_llama_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from llmc.cli.main import app
    from llmc.compiler import builder

    seen = []
    real = builder.build

    def spy(config, *a, **k):
        seen.append((config, k))
        return real(config, *a, **k)

    monkeypatch.setattr(builder, "build", spy)
    out = tmp_path / "e"
    res = CliRunner().invoke(
        app,
        ["build", "--checkpoint_dir", str(tiny_llama_dir), "--output_dir", str(out),
         "--dtype", "float32", "--max_seq_len", "128", "--target", "cpu"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert len(seen) == 1 and isinstance(seen[0][0], BuildConfig)
    assert seen[0][0].max_seq_len == 128 and (out / "manifest.json").is_file()
    with LLM(out, device="cpu") as built:  # what the CLI wrote, the API serves
        assert built.generate([3, 4], SamplingParams(max_new_tokens=2))[0].ok


def test_cli_run_goes_through_the_llm_class(engine_dir, monkeypatch):
    from typer.testing import CliRunner

    from llmc import api
    from llmc.cli.main import app

    seen = []
    real_init = api.LLM.__init__

    def spy(self, *a, **k):
        seen.append(k.get("runtime_config"))
        real_init(self, *a, **k)

    monkeypatch.setattr(api.LLM, "__init__", spy)
    res = CliRunner().invoke(
        app,
        ["run", "--engine_dir", str(engine_dir), "--prompt", "ab", "--max_new_tokens", "3",
         "--device", "cpu", "--max_batch_size", "4", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert len(seen) == 1 and seen[0].max_batch_size == 4 and seen[0].device == "cpu"


def test_request_verbs_records_and_caller_thread_stepping(engine_dir):
    """The front door's verbs: enqueue/await/cancel, records, KV stats; in_caller_thread
    pauses the background loop (every request enqueued first joins the first step)."""
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM(engine_dir, device="cpu") as llm:
        with llm.in_caller_thread():
            n0 = len(llm.step_records)
            ids = [llm.enqueue_request(Request(prompt_token_ids=[3, 4, 5], sampling=sp))
                   for _ in range(3)]  # fmt: skip
            finals = {}
            while len(finals) < 3:
                finals.update({r.request_id: r for r in llm.await_responses(ids) if r.is_final})
            assert llm.step_records[n0].batch_size == 3
        assert all(len(finals[i].token_ids) == 4 for i in ids)
        recs = {r.request_id: r for r in llm.request_records}
        assert all(recs[i].num_output_tokens == 4 for i in ids)
        long = SamplingParams(max_new_tokens=100, ignore_eos=True)
        rid = llm.enqueue_request(Request(prompt_token_ids=[3], sampling=long))
        for _ in range(500):  # the background loop runs again: no await needed to make steps
            if recs_now := [
                r for r in llm.request_records if r.request_id == rid and r.token_times
            ]:
                break
            time.sleep(0.01)
        assert recs_now
        assert llm.cancel_request(rid)
        got = []
        while not any(r.is_final for r in got):
            got += llm.await_responses(rid, timeout=5)
        assert got[-1].finish_reason.value == "cancelled"
        assert llm.kv_stats().free_blocks == llm.kv_stats().total_blocks
    with LLM(engine_dir, device="cpu") as paused, paused.in_caller_thread():
        paused.enqueue_request(Request(prompt_token_ids=[3], sampling=long))
        t0 = time.monotonic()
        paused.shutdown()  # cancels and stops even while the loop is paused
        assert time.monotonic() - t0 < 5 and paused.closed
