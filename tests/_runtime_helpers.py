"""Helpers shared by the runtime tests (tokenizer dirs, engines from tiny checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmc.runtime.tokenizer import Tokenizer


def smollm2_tokenizer_dir(request: pytest.FixtureRequest, tmp: Path) -> Path:
    """A directory with SmolLM2's tokenizer.json: conftest's ``smollm2_hf_dir`` when it exists,
    else converted here from the GGUF with transformers."""
    try:
        return Path(request.getfixturevalue("smollm2_hf_dir"))
    except pytest.FixtureLookupError:
        pass
    from transformers import AutoTokenizer

    gguf = Path(request.getfixturevalue("smollm2_gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(tmp))
    return tmp


def load_tokenizer(path: Path, eos: tuple[int, ...] = ()) -> Tokenizer:
    return Tokenizer.from_dir(path, eos)
