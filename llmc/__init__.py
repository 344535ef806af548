"""llmc: compile LLM checkpoints into engine directories and serve them.

The package is split into subpackages mapped from the repository's top-level folders:
``llmc.cli`` (cli/), ``llmc.compiler`` (compiler/), ``llmc.runtime`` (runtime/),
``llmc.cuda`` (cuda/) and ``llmc.profiles`` (profiles/).
"""

__version__ = "0.1.0"
ENGINE_FORMAT_VERSION = 1

__all__ = ["__version__", "ENGINE_FORMAT_VERSION"]
