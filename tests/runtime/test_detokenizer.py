"""Incremental detokenization: deltas concatenate to the final text, no split-character U+FFFD,
stop strings cut and never leak; checked on the tiny byte-level tokenizer and SmolLM2's."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 done.",
    "中文测试：你好，世界！日本語もあります。",
    "mixed ascii/中文/😀 — dashes “quotes” ünïcödé\nnew line\ttab",
]


@pytest.fixture(scope="module")
def smol_tok(smollm2_hf_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_hf_dir, (2,))


def stream(tok, ids, stop=(), chunks=None) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, stop=stop)
    deltas, i = [], 0
    rng = random.Random(0)
    while i < len(ids):
        n = 1 if chunks is None else rng.randint(1, chunks)
        deltas.append(det.add_tokens(ids[i : i + n]))
        i += n
    deltas.append(det.finish())
    return deltas, det


@pytest.mark.parametrize("which", ["tiny", "smol"])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [None, 3])
def test_deltas_concatenate_to_text_without_replacement_chars(request, which, text, chunks):
    tok = request.getfixturevalue(f"{which}_tok")
    if which == "tiny":  # its 253 byte tokens miss bytes 0x9f, 0xa0, 0xad: drop such chars
        text = "".join(c for c in text if not {0x9F, 0xA0, 0xAD} & set(c.encode()))
        assert len(tok.encode(text, add_special_tokens=False)) == len(text.encode())
    ids = tok.encode(text, add_special_tokens=False)
    if which == "tiny":
        assert text.isascii() or len(ids) > len(text), "multi-byte characters are split"
    elif not text.isascii():
        pieces = [tok.decode([i]) for i in ids]
        assert any("\ufffd" in p for p in pieces), "SmolLM2 splits some character"
    deltas, det = stream(tok, ids, chunks=chunks)
    assert "".join(deltas) == det.text == text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held_until_completed(tiny_tok):
    ids = tiny_tok.encode("a𝄞", add_special_tokens=False)  # "a" + 4 byte tokens (F0 9D 84 9E)
    assert len(ids) == 5
    det = IncrementalDetokenizer(tiny_tok)
    assert det.add_tokens(ids[:1]) == "a"
    assert [det.add_tokens([i]) for i in ids[1:4]] == ["", "", ""]
    assert det.add_tokens(ids[4:]) == "𝄞"
    assert det.finish() == ""


def test_truncated_character_is_flushed_once_at_finish(tiny_tok):
    ids = tiny_tok.encode("ok𝄞", add_special_tokens=False)[
        :-1
    ]  # the last byte of 𝄞 (4 bytes) is lost
    deltas, det = stream(tiny_tok, ids)
    assert deltas[-1] == "\ufffd" and "".join(deltas) == "ok\ufffd" == det.text
    assert det.text == tiny_tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40), st.integers(1, 4))
def test_property_any_text_roundtrips(text, chunks):
    tok = _TINY[0]
    ids = tok.encode(text, add_special_tokens=False)
    assume(0 not in ids)  # a byte the tiny vocabulary lacks
    deltas, det = stream(tok, ids, chunks=chunks)
    assert "".join(deltas) == det.text == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(3, 255), min_size=1, max_size=30))
def test_property_random_ids_concatenate(ids):
    """Arbitrary byte tokens (often invalid UTF-8): the stream still equals the full decode."""
    tok = _TINY[0]
    deltas, det = stream(tok, ids)
    assert "".join(deltas) == det.text == tok.decode(ids)


_TINY: list[Tokenizer] = []


@pytest.fixture(autouse=True, scope="module")
def _tiny_for_hypothesis(tiny_tok):
    _TINY[:] = [tiny_tok]


def test_stop_string_cuts_text_and_never_leaks(smol_tok):
    text = "The answer is 42. END of story, more text"
    ids = smol_tok.encode(text, add_special_tokens=False)
    deltas, det = stream(smol_tok, ids, stop=["END"])
    assert det.stopped and det.stop_string == "END"
    assert "".join(deltas) == det.text == "The answer is 42. "
    assert not any("E" in d for d in deltas)


def test_stop_string_spanning_tokens_on_byte_tokenizer(tiny_tok):
    ids = tiny_tok.encode("abc<stop>def", add_special_tokens=False)
    deltas, det = stream(tiny_tok, ids, stop=["<stop>", "zzz"])
    assert det.stopped and "".join(deltas) == "abc" and det.text == "abc"
    assert all("<" not in d for d in deltas)


def test_possible_stop_prefix_is_held_then_released(tiny_tok):
    ids = tiny_tok.encode("a <sto and <st", add_special_tokens=False)
    det = IncrementalDetokenizer(tiny_tok, stop=["<stop>"])
    deltas = [det.add_tokens([i]) for i in ids]
    assert "".join(deltas) == "a <sto and "  # "<st" may still become "<stop>"
    assert det.finish() == "<st"
    assert not det.stopped and det.text == "a <sto and <st"


def test_first_stop_string_wins(tiny_tok):
    ids = tiny_tok.encode("xx BB yy AA", add_special_tokens=False)
    deltas, det = stream(tiny_tok, ids, stop=["AA", "BB"])
    assert det.stop_string == "BB" and det.text == "xx "


def test_special_tokens_are_skipped(smol_tok):
    ids = smol_tok.encode("Hi there", add_special_tokens=False) + [2]  # <|im_end|>
    deltas, det = stream(smol_tok, ids)
    assert det.text == "Hi there"


@pytest.fixture(scope="module")
def sentencepiece_tok() -> Tokenizer:
    """A SentencePiece-style tokenizer: ``▁`` word starts, byte fallback, a decoder that
    strips the first token's leading space (like Llama 2 / Mistral tokenizers)."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁": 3, "a": 4, "b": 5}
    vocab.update({f"<0x{b:02X}>": 6 + i for i, b in enumerate([0xF0, 0x9F, 0x98, 0x80])})
    tok = HfTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
    )
    return Tokenizer(tok)


@pytest.mark.parametrize(
    "ids",
    [[1, 2, 2], [2, 1], [1, 6, 7, 8, 9, 2], [6, 7, 8, 9, 3, 4, 5, 1], [3, 2, 6, 7, 8, 9]],
)
def test_sentencepiece_spacing_and_byte_fallback(sentencepiece_tok, ids):
    deltas, det = stream(sentencepiece_tok, ids)
    assert "".join(deltas) == det.text == sentencepiece_tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert det.text.count(" ") == sentencepiece_tok.decode(ids).count(" ")
