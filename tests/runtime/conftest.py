"""Fixtures of the runtime tests: the tiny Llama's tokenizer and engine weights, loaded once per
module without a build (the ModelRunner / EngineRuntime tests wire the parts themselves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.checkpoints import TINY_LLAMA
from helpers.engines import load_engine_weights
from llmc.compiler.spec import ModelSpec
from llmc.runtime.tokenizer import Tokenizer

TINY_EOS = (TINY_LLAMA["eos_token_id"],)


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir: Path) -> Tokenizer:
    """The tiny Llama's byte-level tokenizer, EOS ``</s>`` (id 2)."""
    return Tokenizer.from_dir(tiny_llama_dir, TINY_EOS)


@pytest.fixture(scope="module")
def tiny_llama_weights(tiny_llama_dir: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(ModelSpec, float32 engine weights) of the tiny Llama, as a build would write them."""
    return load_engine_weights(tiny_llama_dir)
