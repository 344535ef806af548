"""The endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``.

A generation request: body parsed (``schema.parse_body``), a replica picked for its
``model`` (``EnginePool.pick``), the body planned against that replica's tokenizer and
limits (``translate``; tokenizing text and rendering chat turns run in a worker thread, off
the event loop), room checked (``EnginePool.admit``), and the ``GenerationResponse``
submitted. Every refusal is an APIError, counted under its outcome before it is answered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from llmc.base.errors import EngineError
from llmc.serve.api_errors import APIError, unavailable
from llmc.serve.formatting import Shape
from llmc.serve.generation import GenerationResponse
from llmc.serve.metrics import CONTENT_TYPE, outcome_of
from llmc.serve.schema import ChatCompletionRequest, CompletionRequest, parse_body
from llmc.serve.translate import chat_plan, completion_plan


def make_router(state: Any) -> APIRouter:
    """The routes over a ``ServerState`` (its pool, metrics, phase and config)."""
    router = APIRouter()
    pool, metrics = state.pool, state.metrics

    @router.get("/health")
    async def health() -> Response:
        if state.phase == "ready":
            return JSONResponse({"status": "ok"})
        retry = str(state.config.retry_after_s)
        headers = {"Retry-After": retry}
        return JSONResponse({"status": state.phase}, status_code=503, headers=headers)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        group = pool.models[name]
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": state.started,
            "owned_by": "llmc",
            "replicas": len(group),
        }
        if group[0].limits:
            card["max_model_len"] = group[0].max_seq_len
        return card

    @router.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card(m) for m in pool.models]})

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model not in pool.models:
            raise APIError(404, f"the model {model!r} does not exist", code="model_not_found")
        return JSONResponse(model_card(model))

    async def generate(request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        name = ""
        try:
            if state.phase != "ready":
                raise unavailable(f"the server is {state.phase}", state.config.retry_after_s)
            raw = await request.body()
            schema = ChatCompletionRequest if chat else CompletionRequest
            body = parse_body(schema, raw)
            replica = pool.pick(body.model)
            name = replica.model
            planner = chat_plan if chat else completion_plan
            args = (body, replica.tokenizer, replica.max_seq_len)
            if chat or _has_text(body.prompt):
                plan = await asyncio.to_thread(planner, *args)  # type: ignore[arg-type]
            else:
                plan = planner(*args)  # type: ignore[arg-type]
            pool.admit(replica, len(plan.prompts) * plan.n)
            shape = Shape(replica.model, chat, plan.include_usage)
            try:
                response = GenerationResponse(
                    replica, plan, shape, metrics, arrival, state.request_done
                )
            except EngineError as e:
                raise APIError(500, f"the engine failed: {e}", code="engine_failed") from None
        except APIError as e:
            metrics.outcome(name, outcome_of(e.status))
            raise
        metrics.routed.labels(replica.model, str(replica.index)).inc()
        state.request_started()
        return response

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return router


def _has_text(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str)
