"""Fault isolation in the step loop: one request whose processing raises inside a step
(its sampling columns, its detokenization, its logprobs) fails alone with its reason while
50 others run; they complete with the tokens they get without the faulty one, every KV
block is free at the end, and the engine keeps serving. A failure of the step itself (the
model forward) still fails the engine."""

from __future__ import annotations

import threading

import pytest

from llmc.base.errors import EngineError, RequestError
from llmc.runtime import detokenizer, sampling
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import FinishReason, Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAULT = "\x00fault"
"""The stop string that marks the request whose processing is made to raise."""


@pytest.fixture(scope="module")
def engine_dir(tiny_engine, tiny_llama_dir):
    # the load test's engine (built once a session): 128 sequences in flight
    return tiny_engine(
        tiny_llama_dir, max_seq_len=48, max_batch_size=128, max_num_tokens=512, tokens_per_block=8
    )


def _others() -> list[Request]:
    return [
        Request(
            prompt_token_ids=[3 + i % 200, 7, 9 + i % 50],
            sampling=SamplingParams(max_new_tokens=6 + i % 5, ignore_eos=True, stop=("zz",)),
            streaming=i % 2 == 0,
        )
        for i in range(50)
    ]


def _run(ex, faulty: Request) -> tuple[dict[int, object], int]:
    ids = [ex.enqueue_request(r) for r in _others()]
    bad = ex.enqueue_request(faulty)
    ids.insert(7, bad)
    finals = {}
    while len(finals) < len(ids):
        for r in ex.await_responses(ids):
            if r.is_final:
                finals[r.request_id] = r
    return finals, bad


@pytest.fixture(scope="module")
def reference(engine_dir):
    """The 50 requests' tokens when nothing fails."""
    ex = EngineRuntime.load(engine_dir, RuntimeConfig()).executor()
    return [o.token_ids for o in ex.generate(list(_others()))]


def _faulty_row(monkeypatch, where: str) -> SamplingParams:
    """The faulty request's params; ``where`` its processing raises (only for it)."""
    if where == "sampling columns":
        make_row = sampling._make_row

        def broken(p):
            if FAULT in p.stop:
                raise ValueError("injected sampling fault")
            return make_row(p)

        monkeypatch.setattr(sampling, "_make_row", broken)
    elif where == "detokenization":
        add_tokens = detokenizer.IncrementalDetokenizer.add_tokens

        def broken(self, token_ids):
            if FAULT in self._stop and len(self._ids) >= 3:  # mid-stream, blocks held
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected decode fault")
            return add_tokens(self, token_ids)

        monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add_tokens", broken)
    else:  # logprobs
        unpack = sampling.unpack_logprobs

        def broken(packed, seqs):
            for seq in seqs:
                if FAULT in seq.sampling.stop and len(seq.output_token_ids) >= 2:
                    raise sampling.RequestFault.caused(
                        seq.request_id, "unpacking its logprobs", ValueError("injected")
                    )
            return unpack(packed, seqs)

        monkeypatch.setattr(sampling, "unpack_logprobs", broken)
    return SamplingParams(
        max_new_tokens=20,
        ignore_eos=True,
        stop=(FAULT,),
        logprobs=1 if where == "logprobs" else None,
    )


@pytest.mark.parametrize("background", [False, True], ids=["caller_thread", "background"])
@pytest.mark.parametrize("where", ["sampling columns", "detokenization", "logprobs"])
def test_one_faulty_request_fails_alone_while_fifty_run(
    engine_dir, reference, monkeypatch, where, background
):
    rt = EngineRuntime.load(engine_dir, RuntimeConfig())
    ex = rt.executor()
    if background:
        ex.start()
    faulty = Request(prompt_token_ids=[5, 6, 7, 8], sampling=_faulty_row(monkeypatch, where))
    try:
        finals, bad = _run(ex, faulty)
        assert finals[bad].finish_reason is FinishReason.ERROR
        assert finals[bad].error.startswith(f"request {bad}: ")
        assert "injected" in finals[bad].error and finals[bad].error_code == RequestError.exit_code
        others = [finals[i] for i in sorted(finals) if i != bad]
        assert [r.finish_reason for r in others] == [FinishReason.LENGTH] * 50
        assert [r.token_ids for r in others] == reference
        monkeypatch.undo()  # the engine keeps serving, the fault gone or not
        [again] = ex.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert again.ok and len(again.token_ids) == 3
        kv = ex.kv_stats()
        assert kv.free_blocks == kv.total_blocks
    finally:
        ex.shutdown()


def test_a_model_failure_still_fails_the_engine(engine_dir, monkeypatch):
    rt = EngineRuntime.load(engine_dir, RuntimeConfig())
    ex = rt.executor().start()

    def forward(inp):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(rt.runner, "forward", forward)
    a = ex.enqueue_request(Request(prompt_token_ids=[5, 6]))
    b = ex.enqueue_request(Request(prompt_token_ids=[7, 8]))
    got = {r.request_id: r for r in ex.await_responses([a, b], timeout=30)}
    while len(got) < 2:
        got.update({r.request_id: r for r in ex.await_responses([a, b], timeout=30)})
    assert all("engine failure" in r.error for r in got.values())
    with pytest.raises(EngineError, match="engine loop failed"):
        ex.enqueue_request(Request(prompt_token_ids=[5]))
    ex.shutdown()


def test_a_prompt_the_tokenizer_rejects_is_not_leaked(engine_dir):
    """A lone surrogate: a final RequestError response, a harmless cancel, no stuck wait."""
    ex = EngineRuntime.load(engine_dir, RuntimeConfig()).executor().start()
    try:
        rid = ex.enqueue_request(Request(prompt="a\udcffb"))
        [r] = ex.await_responses(rid, timeout=10)
        assert r.is_final and r.error_code == RequestError.exit_code and "surrogate" in r.error
        assert ex.cancel_request(rid) is False and ex.await_responses(rid, timeout=0) == []
        [ok] = ex.generate("hello", SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert ok.ok
    finally:
        ex.shutdown()


def test_a_template_that_never_ends_fails_its_request_and_blocks_nobody(engine_dir):
    rt = EngineRuntime.load(engine_dir, RuntimeConfig())
    tok = rt.tokenizer
    tok.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    tok._template, tok.chat_timeout_s = None, 0.5
    ex = rt.executor().start()
    try:
        out: list = []
        slow = threading.Thread(
            target=lambda: out.append(
                ex.enqueue_request(Request(prompt="x", apply_chat_template=True))
            )
        )
        slow.start()
        # the render runs off the executor's lock: another request completes meanwhile
        [ok] = ex.generate([[5, 6]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert ok.ok
        slow.join(10)
        [r] = ex.await_responses(out[0], timeout=10)
        assert r.finish_reason is FinishReason.ERROR and "ran longer than 0.5 s" in r.error
    finally:
        ex.shutdown()


def test_the_async_step_fault_path_drops_only_the_faulty_request(engine_dir, monkeypatch):
    """With async scheduling (as on CUDA), a fault in the step launched ahead fails its
    request; the step is not run and the others go on."""
    rt = EngineRuntime.load(engine_dir, RuntimeConfig())
    ex = rt.executor()
    ex.async_scheduling = hasattr(ex.runner, "launch")
    launch = ex.runner.launch
    calls = {"n": 0}

    def flaky(batch, src_rows=None):
        if src_rows is not None:
            calls["n"] += 1
            if calls["n"] == 2:  # the second step launched ahead: its first row is at fault
                rid = batch.sequences[0].seq.request_id
                raise sampling.RequestFault(rid, "injected ahead fault")
        return launch(batch, src_rows)

    monkeypatch.setattr(ex.runner, "launch", flaky)
    outs = ex.generate([[3, 4, 5]] * 4, SamplingParams(max_new_tokens=8, ignore_eos=True))
    failed = [o for o in outs if not o.ok]
    assert len(failed) == 1 and "injected ahead fault" in failed[0].error
    assert all(len(o.token_ids) == 8 for o in outs if o.ok)
    kv = ex.kv_stats()
    assert kv.free_blocks == kv.total_blocks


def test_shutdown_after_an_engine_failure_does_not_wait(engine_dir, monkeypatch):
    import time

    from llmc import LLM

    llm = LLM(engine_dir, device="cpu")

    def forward(inp):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(llm.runtime.runner, "forward", forward)
    [out] = llm.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert not out.ok and "engine failure" in out.error
    t0 = time.perf_counter()
    llm.shutdown()
    assert time.perf_counter() - t0 < 5  # was the whole 30 s timeout
