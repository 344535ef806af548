"""The measurement wing: workloads, metrics, the benchmark driver, the HF peer, device
ceilings, the one profiler (``profiling.ProfileSession``, behind ``llmc profile`` and
``llmc.Profiler``), tuning recommendations and the report tables that both the CLI and the
library print. It measures an engine served by the front door (``llmc.LLM``, read through
``served.Served``, so the wing never imports the front door) from the engine core's own
records; the engine core never imports it."""
