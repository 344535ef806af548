"""The public home of llmc's error classes (``from llmc.errors import LlmcError``).

They are defined in ``llmc.base.errors`` so that every layer can import them without an
upward edge to the front door; this module only re-exports them."""

from llmc.base.errors import *  # noqa: F403
from llmc.base.errors import __all__  # noqa: F401
