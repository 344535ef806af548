"""GGUF tokenizers beyond llmc's byte-level fast path (compiler/gguf_tokenizer.py): a
SentencePiece-style ("llama" tokenizer model) GGUF written with the ``gguf`` package goes
through transformers' own GGUF converter and encodes, decodes and renders its chat template
exactly as transformers loads it; an engine built from it serves; a tokenizer model neither
llmc nor transformers knows is an UnsupportedError naming both refusals."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from helpers.engines import tiny_build_config
from helpers.gguf_files import sentencepiece_tokenizer, write_gguf
from llmc.base.errors import UnsupportedError
from llmc.compiler.checkpoint import load_checkpoint
from llmc.runtime.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")  # a dependency of llmc; absent on the GPU image (cuda-only runs)

TEXTS = ["hello world", "the thing", " Hello, World!", "in the inn", "a\nb  c", "x1 2?"]


@pytest.fixture(scope="module")
def sp_gguf(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "sp.gguf"
    return write_gguf(tiny_llama_dir, path, tokenizer=sentencepiece_tokenizer())


def _ours(files: dict[str, bytes], tmp_path) -> Tokenizer:
    d = tmp_path / "tok"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    return Tokenizer.from_dir(d)


def test_sentencepiece_gguf_encodes_like_transformers(sp_gguf, tmp_path):
    from transformers import AutoTokenizer

    ours = _ours(load_checkpoint(sp_gguf).tokenizer_files, tmp_path)
    ref = AutoTokenizer.from_pretrained(sp_gguf.parent, gguf_file=sp_gguf.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == 1  # the file says add_bos_token
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    conv = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]
    want = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if isinstance(want, Mapping) else want)
    assert ours.apply_chat_template(conv) == want
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1


def test_unknown_byte_level_pre_tokenizer_goes_through_transformers(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    def edit(w, tensors):  # the default fixture tokenizer, under a pre-tokenizer llmc lacks
        w.kv_data[0]["tokenizer.ggml.pre"].value = "some-new-model"

    path = write_gguf(tiny_llama_dir, tmp_path / "bpe.gguf", edit=edit)
    ours = _ours(load_checkpoint(path).tokenizer_files, tmp_path)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="bpe.gguf")
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text


def test_a_tokenizer_model_nobody_converts_is_unsupported(tiny_llama_dir, tmp_path):
    path = write_gguf(tiny_llama_dir, tmp_path / "odd.gguf",
                      tokenizer=sentencepiece_tokenizer(model="no-such-model"))  # fmt: skip
    refused = "tokenizer model 'no-such-model' is not byte-level BPE .* transformers' GGUF"
    with pytest.raises(UnsupportedError, match=refused + " tokenizer converter failed"):
        load_checkpoint(path)


def test_engine_from_a_sentencepiece_gguf_serves(sp_gguf, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from llmc import LLM, SamplingParams

    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    cfg = tiny_build_config(max_batch_size=2, max_seq_len=64, max_num_tokens=64,
                            tokens_per_block=16)  # fmt: skip
    ref = AutoTokenizer.from_pretrained(sp_gguf.parent, gguf_file=sp_gguf.name)
    with LLM(model=sp_gguf, build_config=cfg, device="cpu") as llm:
        (out,) = llm.generate("hello world", SamplingParams(max_tokens=4, ignore_eos=True))
        assert out.ok and out.prompt_token_ids == ref.encode("hello world")
        assert out.outputs[0].text == ref.decode(out.token_ids, skip_special_tokens=True)
        config = json.loads((llm.engine_dir / "tokenizer_config.json").read_text())
        assert "chat_template" in config


def test_malformed_sentencepiece_metadata_is_a_checkpoint_error(tiny_llama_dir, tmp_path):
    from llmc.base.errors import CheckpointError

    def edit(w, tensors):  # token types that are not integers: llmc's check, before either path
        w.kv_data[0]["tokenizer.ggml.token_type"].value = ["x"] * 256
        w.kv_data[0]["tokenizer.ggml.token_type"].type = gguf.GGUFValueType.ARRAY
        w.kv_data[0]["tokenizer.ggml.token_type"].sub_type = gguf.GGUFValueType.STRING

    path = write_gguf(tiny_llama_dir, tmp_path / "bad.gguf", edit=edit,
                      tokenizer=sentencepiece_tokenizer())  # fmt: skip
    with pytest.raises(CheckpointError, match="tokenizer.ggml.token_type must be an array of ints"):
        load_checkpoint(path)
