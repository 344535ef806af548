"""``llmc serve``: an OpenAI-compatible HTTP server over the Executor.

One process serves one or more engines (each replica its own ``llmc.LLM`` and Executor
loop thread) behind FastAPI + uvicorn. The package sits at the front-door floor: it drives
engines only through ``llmc.LLM``'s request verbs (``enqueue_request``, ``cancel_request``,
``kv_stats``, ``scheduler_stats``) and its Executor's ``set_response_sink`` and
``request_record``; there is no second scheduling path.

Files, one job each: ``config`` (ServeConfig, engine specs), ``routing`` (replica policies),
``bridge`` (the Executor's response sink: each step's Responses → asyncio), ``engines`` (the
pool of replicas by model name, loading and shutdown), ``schema`` (OpenAI request bodies),
``translate`` (OpenAI request → llmc Requests), ``formatting`` (llmc Responses → OpenAI JSON
and SSE chunks), ``generation`` (one HTTP request's generations: submit, stream, collect,
cancel), ``api_errors`` (OpenAI error objects), ``metrics`` (Prometheus), ``routes``
(endpoints), ``app`` (middleware, state, handlers), ``server`` (uvicorn, loading, drain).
"""
