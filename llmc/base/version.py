"""Version numbers: the llmc release and the engine directory format it writes and reads."""

__version__ = "0.1.0"
ENGINE_FORMAT_VERSION = 3
"""Bumped when an engine directory written by one llmc cannot be read by the other (2: the
build section records quantization and kv_cache_dtype; fp8 tensors and scales; 3: an fp8
KV cache's per-layer ``k_mean``, smooth K)."""
READABLE_FORMAT_VERSIONS = (2, 3)
"""Formats this llmc reads: a format-2 engine is format 3 less the fp8 KV cache's ``k_mean``
tensors, so every format-2 engine without an fp8 KV cache loads as it is (one with it is
refused with its rebuild command: ``load_engine``)."""
