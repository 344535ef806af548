"""Version numbers: the llmc release and the engine directory format it writes and reads."""

__version__ = "0.1.0"
ENGINE_FORMAT_VERSION = 2
"""Bumped when an engine directory written by one llmc cannot be read by the other (2: the
build section records quantization and kv_cache_dtype; fp8 tensors and scales)."""
