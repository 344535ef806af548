"""Tensor parallelism on CPU (gloo, 2 processes): a tiny Llama and a tiny Qwen2 built with
tp_size 2 give the tp_size-1 engine's greedy tokens (the real scheduler, with chunked
prefill and preemption by recompute) and its logits within 1e-5 (float32); a rank killed
mid-run ends the run with an error naming it within the timeout; torchrun's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from typer.testing import CliRunner

import llmc
from helpers.runner import drive, new_seq
from llmc.base.errors import ConfigError
from llmc.cli.main import app
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.tp_launch import torchrun_rank


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tiny_qwen2_dir, tmp_path_factory):
    """{(arch, tp): engine dir}: float32 CPU engines, 8-token blocks, 96-token sequences."""
    root = tmp_path_factory.mktemp("tp_engines")
    out = {}
    for arch, ckpt in (("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir)):
        for tp in (1, 2):
            cfg = BuildConfig(
                checkpoint_dir=str(ckpt), output_dir=str(root / f"{arch}{tp}"), tp_size=tp,
                dtype="float32", target="cpu", max_seq_len=96, max_input_len=48,
                max_num_tokens=64, tokens_per_block=8, max_batch_size=8,
            )  # fmt: skip
            out[arch, tp] = builder.build(cfg).output_dir
    return out


PROMPTS = [[3 + (7 * i + 5 * j) % 200 for j in range(n)] for i, n in enumerate((41, 5, 30, 19))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_gives_tp1_tokens_with_chunked_prefill_and_preemption(engines, arch):
    # a 16-token step budget chunks the prompts; a 96-token pool holds about half of the
    # ~190 tokens the four requests reach, so max_utilization preempts (recompute)
    config = RuntimeConfig(
        device="cpu", max_num_tokens=16, max_kv_tokens=96, scheduler_policy="max_utilization"
    )
    sp = llmc.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        llm = llmc.LLM(engines[arch, tp], runtime_config=config)
        try:
            outs = llm.generate(PROMPTS, sp)
            assert all(o.ok for o in outs), [o.error for o in outs]
            got[tp] = [o.outputs[0].token_ids for o in outs]
            assert llm.scheduler_stats().num_preemptions > 0
            assert llm.runtime.summary()["tp_size"] == tp
        finally:
            llm.shutdown()
    assert got[2] == got[1]
    assert all(len(ids) == 24 for ids in got[2])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_logits_are_tp1_logits(engines, arch):
    runs = {}
    for tp in (1, 2):
        rt = EngineRuntime.load(engines[arch, tp], RuntimeConfig(device="cpu"))
        try:
            seqs = [new_seq(i, p, 6) for i, p in enumerate(PROMPTS)]
            runs[tp] = drive(rt.runner, seqs, chunk=12, budget=28, record_logits=True)
        finally:
            rt.close()
    one, two = runs[1], runs[2]
    assert two.outputs == one.outputs
    assert two.mixed_steps > 0 and one.logits.keys() == two.logits.keys()
    for key, logits in one.logits.items():
        torch.testing.assert_close(two.logits[key], logits, rtol=0, atol=1e-5)


def test_a_killed_rank_ends_the_run_with_an_error_naming_it(engines):
    timeout = 20.0
    config = RuntimeConfig(device="cpu", tp_timeout_s=timeout)
    llm = llmc.LLM(engines["llama", 2], runtime_config=config)
    try:
        follower = llm.runtime.tp.procs[0]
        sp = llmc.SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
        rid = llm.enqueue_request(
            llmc.Request(prompt_token_ids=PROMPTS[1], sampling=sp, streaming=True)
        )
        first = llm.await_responses(rid, timeout=30)
        assert first and first[0].error is None
        follower.kill()
        t0 = time.monotonic()
        final = None
        while final is None and time.monotonic() - t0 < timeout + 10:
            for r in llm.await_responses(rid, timeout=1):
                final = r if r.is_final else final
        elapsed = time.monotonic() - t0
        assert final is not None and final.error is not None, final
        assert "tensor-parallel rank 0" in final.error and "rank 1" in final.error
        assert "exited with code -9" in final.error and final.error_code == 7
        assert elapsed < timeout
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < timeout  # never a hang


def test_llmc_run_on_a_tp2_engine_prints_the_tp1_text(engines):
    outs = []
    for tp in (1, 2):
        r = CliRunner().invoke(
            app,
            ["run", "--engine_dir", str(engines["qwen2", tp]), "--device", "cpu", "--prompt",
             "hello there", "--max_new_tokens", "12", "--ignore_eos", "--json"],
        )  # fmt: skip
        assert r.exit_code == 0, r.stderr
        outs.append(json.loads(r.stdout))
    texts = [[o["text"] for o in out["outputs"]] for out in outs]
    assert texts[0] == texts[1] and texts[0][0]


def test_multi_step_decoding_is_refused_before_any_rank_starts(engines):
    with pytest.raises(ConfigError, match="decode_steps_per_iteration 4 .* tp_size 2"):
        llmc.LLM(engines["llama", 2], device="cpu", decode_steps_per_iteration=4)


def test_torchrun_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert torchrun_rank(env, 2) == (1, 2, "10.0.0.1", 29500)
    assert torchrun_rank({}, 2) is None
    with pytest.raises(ConfigError, match=r"WORLD_SIZE\) but the engine has tp_size 4"):
        torchrun_rank(env, 4)
    with pytest.raises(ConfigError, match="MASTER_PORT not set"):
        torchrun_rank({**env, "MASTER_PORT": ""}, 2)
    with pytest.raises(ConfigError, match="must be integers"):
        torchrun_rank({**env, "RANK": "one"}, 2)
    with pytest.raises(ConfigError, match="RANK 2 is outside 0..1"):
        torchrun_rank({**env, "RANK": "2"}, 2)


_TORCHRUN_RANK = """
import json, sys
import llmc
llm = llmc.LLM(sys.argv[1], device="cpu")  # rank 1 follows rank 0 in here, then exits 0
sp = llmc.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
out = llm.generate([[5, 6, 7, 8, 9]], sp)
print(json.dumps(out[0].outputs[0].token_ids))
llm.shutdown()
"""


def test_ranks_started_as_torchrun_starts_them(engines):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-P", "-c", _TORCHRUN_RANK, str(engines["llama", 2])]
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in (0, 1)
    ]  # fmt: skip
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    with llmc.LLM(engines["llama", 1], device="cpu") as llm:
        sp = llmc.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        want = llm.generate([[5, 6, 7, 8, 9]], sp)[0].outputs[0].token_ids
    assert json.loads(results[0][0]) == want
    assert results[1][0] == ""  # rank 1 printed nothing: it left inside LLM()


def test_forked_samples_copy_their_kv_blocks_on_every_rank(engines):
    # n=3 samples of one prompt share its blocks; each fork's first own token copies the
    # shared last block (copy-on-write), which every rank must make in its own KV shard
    sp = llmc.SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=7, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        with llmc.LLM(engines["qwen2", tp], device="cpu") as llm:
            runner, copies = llm.runtime.runner, []
            made = runner._copy_blocks
            runner._copy_blocks = lambda pairs, c=copies, m=made: (c.append(pairs), m(pairs))[1]
            out = llm.generate([PROMPTS[3]], sp)[0]
            got[tp] = [c.token_ids for c in out.outputs]
        assert copies
    assert got[2] == got[1] and len(got[1]) == 3


def test_a_hung_rank_ends_the_run_after_the_timeout(engines):
    import signal

    timeout = 3.0
    config = RuntimeConfig(device="cpu", tp_timeout_s=timeout)
    llm = llmc.LLM(engines["llama", 2], runtime_config=config)
    follower = llm.runtime.tp.procs[0]
    try:
        follower.send_signal(signal.SIGSTOP)  # alive, never answering
        sp = llmc.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        out = llm.generate([PROMPTS[1]], sp)[0]
        elapsed = time.monotonic() - t0
        assert not out.ok and "rank 1 stopped answering (timeout 3 s)" in out.error
        assert timeout <= elapsed < timeout + 10
    finally:
        llm.shutdown()  # kills the stopped rank after the timeout
        assert follower.poll() is not None
