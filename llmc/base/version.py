"""Version numbers: the llmc release and the engine directory format it writes and reads."""

__version__ = "0.1.0"
ENGINE_FORMAT_VERSION = 1
"""Bumped when an engine directory written by one llmc cannot be read by the other."""
