"""The measurement wing: workloads, metrics, the benchmark driver, the HF peer, device
ceilings, the profiler, tuning recommendations and the report tables that both the CLI and
the library print. It reads the engine core's records; the engine core never imports it."""
