"""``LLM``: the Python entry point of llmc — an engine loaded and served in-flight.

``LLM`` is glue over the one runtime code path the CLI uses as well: ``EngineRuntime.load``
(engine checks, device, KV pool sizing, limit lowering) and its ``Executor`` (in-flight
batching, streaming, cancellation, records). ``LLM(checkpoint_dir=...)`` first builds the
checkpoint with ``llmc.compiler.builder.build`` into a cache directory keyed by the checkpoint
(path, file sizes and mtimes) and the build config, and reuses that engine on later calls.

``LLM`` is the one front door: ``llmc run`` drives it with ``enqueue_request`` /
``await_responses`` and reads its records, ``llmc bench`` and ``llmc profile`` hand it to the
measurement wing (``llmc.runtime.bench``, which reads it through its ``Served`` protocol).

Invariants:
- The executor loop runs in its background thread from construction to ``shutdown()``
  (paused only inside ``in_caller_thread()``); ``generate``, ``generate_async``, the request
  verbs and ``llm.executor`` may be used from any thread.
- Runtime limits may be lowered below the engine's build limits, never raised: the runtime
  refuses that with a ConfigError naming both values (engine_runtime._lowered).
- ``shutdown()`` (also on leaving ``with LLM(...)``) cancels unfinished requests, stops the
  loop and drops every reference to weights and KV cache (then empties the CUDA cache), so
  device memory is released unless the caller still holds ``llm.executor`` / ``llm.runtime``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmc.api_inputs import (
    Prompt,
    checkpoint_arg,
    conversation_list,
    make_request,
    prompt_list,
    resolve_model,
    sampling_list,
)
from llmc.base.errors import ConfigError, EngineError, error_class
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.engine_cache import cached_build, rebuild
from llmc.runtime.admission import SchedulerStats
from llmc.runtime.branches import BeamSearchParams
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.executor import Executor
from llmc.runtime.kv_cache import KVCacheStats
from llmc.runtime.logprobs import with_texts
from llmc.runtime.records import RequestRecord, StepRecord
from llmc.runtime.responses import RequestOutput, Response
from llmc.runtime.types import Request, SamplingParams

_LIVE: weakref.WeakSet[LLM] = weakref.WeakSet()


def live_llms() -> list[LLM]:
    """Every LLM not yet shut down (what ``Profiler()`` without an argument attaches to)."""
    return [llm for llm in list(_LIVE) if not llm.closed]


class ResponseStream:
    """The async iterator ``LLM.generate_async`` returns: one request's Responses.

    The request is enqueued when iteration starts. ``async for`` gets a fresh inner async
    generator from ``__aiter__`` that only the loop holds, so leaving the loop (``break``,
    an exception, a return) drops it and its ``finally`` cancels the request at once, even
    while the caller keeps this stream object. Awaiting ``__anext__`` directly iterates one
    inner generator kept here; ``aclose()`` ends it and cancels the request.
    """

    def __init__(self, executor: Executor, request: Request, token_text: Any = None) -> None:
        self._executor, self._request = executor, request
        self._token_text = token_text  # attaches logprob entries' texts when given
        self._kept: AsyncIterator[Response] | None = None
        self._started = False
        self._open: int | None = None  # the request's id while it may still run

    def __aiter__(self) -> AsyncIterator[Response]:
        return self._iterate()

    async def __anext__(self) -> Response:
        if self._kept is None:
            self._kept = self._iterate()
        return await self._kept.__anext__()

    async def aclose(self) -> None:
        """End the stream; its request, when unfinished, is cancelled."""
        if self._kept is not None:
            await self._kept.aclose()  # type: ignore[attr-defined]
        if self._open is not None:
            self._executor.cancel_request(self._open)
            self._open = None

    async def _iterate(self) -> AsyncIterator[Response]:
        if self._started:
            raise RuntimeError("a generate_async stream can be iterated once")
        self._started = True
        ex = self._executor
        rid = self._open = ex.enqueue_request(self._request)
        done = False
        try:
            while not done:
                responses = await asyncio.to_thread(ex.await_responses, rid)
                if not responses:
                    return
                for r in responses:
                    done = done or r.is_final
                    if r.error is not None:
                        raise error_class(r.error_code)(r.error)
                    if self._token_text is not None:
                        r.logprobs = with_texts(r.logprobs, self._token_text)
                        r.prompt_logprobs = with_texts(r.prompt_logprobs, self._token_text)
                    yield r
        finally:
            self._open = None
            if not done:
                ex.cancel_request(rid)


# ---- LLM ---------------------------------------------------------------------------------
class LLM:
    """An engine loaded for generation (TensorRT-LLM's ``LLM`` API, on llmc's runtime).

    Give ``model`` (vLLM's and TensorRT-LLM's first argument: an engine directory, an HF
    checkpoint directory or a .gguf file, told apart by ``api_inputs.resolve_model``), or
    ``engine_dir`` (built by ``llmc build`` / ``llmc.build``) or ``checkpoint_dir`` (an HF
    directory or .gguf file). A checkpoint is built on the fly with ``build_config`` into the
    engine cache (``engine_cache_dir``). The other arguments are ``RuntimeConfig`` settings:
    ``max_batch_size`` and ``max_num_tokens`` (the per-step token budget, TensorRT-LLM
    semantics; the KV pool is ``max_kv_tokens`` or ``kv_cache_free_gpu_mem_fraction``) may
    lower the engine's build limits for this run, never raise them.
    ``decode_steps_per_iteration``: K decode steps per host iteration when every running
    row decodes (multi-step decoding, docs/RUNTIME.md; 1 = one step at a time).
    ``enable_inflight_batching`` is accepted for compatibility with TensorRT-LLM scripts:
    llmc always batches in flight, so False is an error. ``runtime_config``: a whole
    ``RuntimeConfig`` (every runtime setting, as ``llmc run`` builds it from its flags and
    profile) used instead of the individual arguments.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        engine_dir: str | Path | None = None,
        checkpoint_dir: str | Path | None = None,
        build_config: BuildConfig | None = None,
        device: str = "auto",
        backend: str = "auto",
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
        kv_cache_free_gpu_mem_fraction: float = 0.9,
        max_kv_tokens: int | None = None,
        enable_block_reuse: bool = True,
        scheduler_policy: str = "guaranteed_no_evict",
        decode_steps_per_iteration: int = 1,
        enable_inflight_batching: bool = True,
        runtime_config: RuntimeConfig | None = None,
    ) -> None:
        if enable_inflight_batching is not True:
            raise ConfigError(
                f"enable_inflight_batching={enable_inflight_batching!r}: llmc always batches "
                "in flight (requests join and leave the running batch at every step); there is "
                "no static-batching mode. Leave it True, or use max_batch_size=1 to run one "
                "request at a time"
            )
        config = runtime_config or RuntimeConfig(
            device=device,
            backend=backend,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
            max_kv_tokens=max_kv_tokens,
            enable_block_reuse=enable_block_reuse,
            scheduler_policy=scheduler_policy,
            decode_steps_per_iteration=decode_steps_per_iteration,
        )
        if model is not None:
            engine, ckpt = resolve_model(model)
            if (engine_dir if engine is not None else checkpoint_dir) is not None:
                raise ConfigError(
                    f"model={str(model)!r} and {'engine_dir' if engine else 'checkpoint_dir'} "
                    "both name what to load: give one"
                )
            engine_dir, checkpoint_dir = engine or engine_dir, ckpt or checkpoint_dir
        checkpoint = checkpoint_arg(engine_dir, checkpoint_dir, build_config)
        if checkpoint is not None:
            engine_dir = cached_build(checkpoint, build_config)
            try:
                runtime = EngineRuntime.load(engine_dir, config)
            except EngineError:  # a stale or damaged cache entry: build it again, once
                engine_dir = rebuild(checkpoint, build_config)
                runtime = EngineRuntime.load(engine_dir, config)
        else:
            assert engine_dir is not None
            runtime = EngineRuntime.load(engine_dir, config)
        self.engine_dir = Path(engine_dir)
        """The engine directory served (the cache entry for ``checkpoint_dir``)."""
        self.config = config
        """The RuntimeConfig this LLM was loaded with."""
        self._runtime: EngineRuntime | None = runtime
        self._executor: Executor | None = runtime.executor().start()
        self._finalizer = weakref.finalize(self, _stop, self._executor, runtime)
        _LIVE.add(self)

    # ---- state ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._executor is None

    @property
    def executor(self) -> Executor:
        """The Executor: ``enqueue_request(Request) -> id``, ``await_responses(ids, timeout)``,
        ``cancel_request(id)`` (its loop already runs in the background). The LLM's own
        methods of the same names are the front door; this stays for existing users."""
        return self._live()

    @property
    def runtime(self) -> EngineRuntime:
        """The loaded EngineRuntime (spec, limits, tokenizer, runner, scheduler, KV manager)."""
        if self._runtime is None:
            raise EngineError(f"the LLM for {str(self.engine_dir)!r} has been shut down")
        return self._runtime

    @property
    def tokenizer(self) -> Any:
        return self.runtime.tokenizer

    def summary(self) -> dict[str, Any]:
        """Device, backend, limits in use and KV capacity (``EngineRuntime.summary``)."""
        return self.runtime.summary()

    # ---- requests: the verbs llmc run, bench and profile use -------------------------------
    def _live(self) -> Executor:
        if self._executor is None:
            raise EngineError(f"the LLM for {str(self.engine_dir)!r} has been shut down")
        return self._executor

    def enqueue_request(self, request: Request) -> int:
        """Queue a ``Request``; returns its id. A request that cannot be served (bad sampling
        values, too long, ...) is not an exception: its final Response carries the error."""
        return self._live().enqueue_request(request)

    def await_responses(
        self,
        request_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
        max_steps: int | None = None,
    ) -> list[Response]:
        """The Responses ready for ``request_ids`` (every request when None), waiting up to
        ``timeout`` seconds for at least one; [] on timeout or when the requests have nothing
        more to say. A streaming request gets its deltas, the others only their final one.
        In the caller's thread (``in_caller_thread``) the call runs engine steps, at most
        ``max_steps`` (None: until a Response is ready); [] after them with none ready."""
        return self._live().await_responses(request_ids, timeout, max_steps)

    def cancel_request(self, request_id: int) -> bool:
        """Cancel a queued or running request (applied at the next step, its KV blocks freed;
        its final Response says ``cancelled``). False when it is unknown or already over."""
        return self._live().cancel_request(request_id)

    @property
    def request_records(self) -> list[RequestRecord]:
        """One RequestRecord per request so far (arrival, first-token, per-token and finish
        times, token counts): what ``llmc run`` reports and bench/profile aggregate."""
        return self._live().request_records

    @property
    def step_records(self) -> list[StepRecord]:
        """One StepRecord per engine step so far (tokens, batch, KV blocks, phase times)."""
        return self._live().step_records

    def kv_stats(self) -> KVCacheStats:
        """The KV pool now: total, used and free blocks, peak use, prefix-reuse hits."""
        return self._live().kv_stats()

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's counters now: running and waiting requests, steps, preemptions."""
        return self._live().scheduler_stats()

    @contextlib.contextmanager
    def in_caller_thread(self) -> Iterator[LLM]:
        """Pause the background engine loop for the block: inside it, ``await_responses``
        runs the engine steps in the calling thread, as ``llmc bench`` measures offline and
        closed-loop runs (no second thread competes for the GIL, and every request enqueued
        before the first wait joins the first step). The loop resumes when the block ends."""
        ex = self._live()
        ex.shutdown()  # stops the loop thread only; queued and running requests stay
        try:
            yield self
        finally:
            if self._executor is ex:
                ex.start()

    # ---- generation ----------------------------------------------------------------------
    def _token_text(self) -> Any:
        """The tokenizer's ``token_text`` (logprob entries' texts), None without one."""
        tok = self.runtime.tokenizer
        return None if tok is None else tok.token_text

    def _run(self, requests: list[Request]) -> list[RequestOutput]:
        """Run ``requests`` to completion; their outputs, logprob entries with their texts."""
        outputs = self.executor.generate(requests)
        token_text = self._token_text()
        if token_text is not None:
            for out in outputs:
                out.attach_token_texts(token_text)
        return outputs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int = 0,
        apply_chat_template: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one ``RequestOutput`` per prompt, in order. A prompt is
        text or token ids: one string, one list of ints, or a list of those (vLLM's
        ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dicts too; a chat conversation
        goes to ``chat``). ``sampling_params``: one for all, or one per prompt. A request that
        cannot be served gets an output with ``error`` set; the others run. ``use_tqdm`` is
        accepted for vLLM scripts: llmc draws no progress bar."""
        items = prompt_list(prompts, apply_chat_template)
        params = sampling_list(sampling_params, len(items))
        reqs = [
            make_request(p, sp, priority, apply_chat_template, False)
            for p, sp in zip(items, params, strict=True)
        ]
        return self._run(reqs)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        priority: int = 0,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: run conversations (one list of ``{"role", "content"}``
        messages — system, user, assistant turns — or a list of them) through the engine's
        chat template; one ``RequestOutput`` per conversation, in order. ``tools`` and
        ``chat_template_kwargs`` (``enable_thinking`` ...) are passed to the template;
        ``use_tqdm`` as in ``generate``."""
        conversations = conversation_list(messages)
        params = sampling_list(sampling_params, len(conversations))
        kwargs = {"add_generation_prompt": add_generation_prompt, **(chat_template_kwargs or {})}
        if tools is not None:
            kwargs["tools"] = tools
        reqs = [
            Request(
                prompt=conv,  # type: ignore[arg-type]
                sampling=sp,
                priority=priority,
                apply_chat_template=True,
                chat_template_kwargs=kwargs,
            )
            for conv, sp in zip(conversations, params, strict=True)
        ]
        return self._run(reqs)

    def generate_async(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        streaming: bool = True,
        priority: int = 0,
        apply_chat_template: bool = False,
    ) -> ResponseStream:
        """Yield the request's ``Response`` deltas as steps produce them (``new_text``,
        ``new_token_ids``; the last has ``is_final``, ``finish_reason`` and the whole
        ``text``). With ``streaming=False`` only the final Response comes.

        Waiting happens in a worker thread blocked on the executor's condition variable (no
        polling). Leaving an ``async for`` loop early cancels the request, even while the
        caller keeps the returned stream (see ``ResponseStream``); a request that fails
        raises its llmc.base.errors class. A bad argument raises RequestError here.
        """
        req = make_request(
            prompt, sampling_params or SamplingParams(), priority, apply_chat_template, streaming
        )
        return ResponseStream(self.executor, req, self._token_text())

    # ---- lifetime ------------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel unfinished requests, stop the executor loop and release the engine's
        memory (weights, KV cache, workspace). Idempotent."""
        ex, rt = self._executor, self._runtime
        if ex is None:
            return
        for rec in ex.request_records:
            if rec.finish_time is None:
                ex.cancel_request(rec.request_id)
        ex.start()  # a loop paused by in_caller_thread applies the cancels as well
        deadline = time.monotonic() + timeout
        while ex.has_work() and not ex.failed and time.monotonic() < deadline:  # next step
            time.sleep(0.002)
        ex.shutdown()
        if rt is not None:
            rt.close()  # a tensor-parallel run's other ranks
        self._finalizer.detach()
        device = rt.device if rt is not None else "cpu"
        self._executor = self._runtime = None
        del ex, rt
        gc.collect()
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self.closed else f"{self.runtime.device}/{self.runtime.backend}"
        return f"LLM(engine_dir={str(self.engine_dir)!r}, {state})"

    # ---- vLLM aliases (beam search) -----------------------------------------------------
    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.beam_search``: ``generate`` with ``params.sampling_params()`` (every
        beam returned best first, in each output's ``completions``)."""
        if not isinstance(params, BeamSearchParams):
            raise ConfigError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}")
        return self.generate(prompts, params.sampling_params())


def _stop(executor: Executor, runtime: EngineRuntime) -> None:
    """An LLM collected without ``shutdown``: its loop stopped, its other ranks too."""
    executor.shutdown()
    runtime.close()
