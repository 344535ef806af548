"""Version numbers: the llmc release and the engine directory format it writes and reads."""

__version__ = "0.1.0"
ENGINE_FORMAT_VERSION = 3
"""Bumped when an engine directory written by one llmc cannot be read by the other (2: the
build section records quantization and kv_cache_dtype; fp8 tensors and scales; 3: an fp8
KV cache's per-layer ``k_mean``, smooth K)."""
