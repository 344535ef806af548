"""A HuggingFace ``tokenizer.json`` + ``tokenizer_config.json`` rebuilt from GGUF metadata.

A GGUF carries its tokenizer as metadata (``tokenizer.ggml.*``): the vocabulary, token types,
BPE merges, the pre-tokenizer's name, special token ids and the chat template. This module
turns a byte-level BPE one (``tokenizer.ggml.model == "gpt2"``) into a ``tokenizers``
Tokenizer that encodes and decodes like transformers' tokenizer loaded from the same GGUF:

- vocabulary entries are spelled in the GPT-2 byte alphabet (any that is not is respelled
  from its UTF-8 bytes), merges are the file's, in the file's order;
- the pre-tokenizer follows ``tokenizer.ggml.pre`` (llama.cpp's names); an unknown name is
  an UnsupportedError rather than a silent fallback to a wrong split;
- control tokens (type 3) become special added tokens, user-defined ones (type 4) plain
  added tokens, so ``<|im_start|>`` in a chat stays one token;
- BOS/EOS are added only where the file's ``add_bos_token``/``add_eos_token`` say so.

Any other GGUF tokenizer (a SentencePiece-style ``"llama"`` model: Llama 2, Mistral,
TinyLlama GGUFs; a byte-level one whose pre-tokenizer llmc does not know) goes through
transformers' own GGUF tokenizer converter (``AutoTokenizer.from_pretrained(gguf_file=...)``,
``transformers_tokenizer_files``), whose saved files are then the engine's: such a file encodes
exactly as transformers loads it. One the converter refuses too is an UnsupportedError naming
both refusals.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.gguf_header import GGUFHeader
from llmc.compiler.input_bounds import config_int

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's split expressions, by family (the pre-tokenizer regexes of llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre-tokenizer name → (kind, ignore_merges). "gpt2": GPT-2's regex inside ByteLevel;
# "digits": every digit its own piece, then GPT-2's regex; otherwise a split regex.
PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    **{name: ("gpt2", False) for name in ("default", "gpt2", "gpt-2", "olmo", "poro-chat")},
    **{
        name: ("digits", False)
        for name in ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b")
    },
    **{
        name: (_LLAMA3_SPLIT, True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")
    },
    **{name: (_QWEN2_SPLIT, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _spelled(token: str, alphabet: set[str]) -> str:
    if set(token) <= alphabet:
        return token
    spell = bytes_to_unicode()
    return "".join(spell[b] for b in token.encode("utf-8"))


def _pre_tokenizer(name: str, where: str) -> tuple[Any, bool]:
    from tokenizers import Regex, pre_tokenizers

    if name not in PRE_TOKENIZERS:
        raise UnsupportedError(
            f"{where}: GGUF pre-tokenizer {name!r} is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    kind, ignore_merges = PRE_TOKENIZERS[name]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "gpt2":
        return byte_level, ignore_merges
    if kind == "digits":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        ), ignore_merges
    split = pre_tokenizers.Split(Regex(kind), behavior="isolated")
    no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([split, no_regex]), ignore_merges


def gguf_tokenizer_files(header: GGUFHeader) -> dict[str, bytes]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ...}`` for a GGUF's tokenizer: llmc's
    own byte-level BPE rebuild when it applies, else transformers' converter.

    ``header`` must have been read with the vocabulary and merges kept (TOKENIZER_ARRAYS).
    """
    md = header.metadata
    _vocabulary(md, str(header.path))  # malformed metadata: CheckpointError, either path
    kind = md.get("tokenizer.ggml.model")
    pre = str(md.get("tokenizer.ggml.pre", "default"))
    if kind == "gpt2" and pre in PRE_TOKENIZERS:
        return _byte_level_files(header)
    why = (
        f"pre-tokenizer {pre!r} is not one llmc rebuilds ({', '.join(sorted(PRE_TOKENIZERS))})"
        if kind == "gpt2"
        else f"tokenizer model {kind!r} is not byte-level BPE ('gpt2')"
    )
    return transformers_tokenizer_files(header, why)


def transformers_tokenizer_files(header: GGUFHeader, why: str) -> dict[str, bytes]:
    """The tokenizer files transformers writes for the GGUF's tokenizer (its GGUF converter,
    local file only), the chat template folded into tokenizer_config.json. ``why``: why llmc's
    own rebuild does not apply (named if the converter refuses the file too)."""
    import tempfile
    from pathlib import Path

    path, where = Path(header.path), str(header.path)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
        with tempfile.TemporaryDirectory(prefix="llmc-gguf-tok-") as tmp:
            tok.save_pretrained(tmp)
            out = Path(tmp)
            config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
            template = out / "chat_template.jinja"
            if "chat_template" not in config and template.is_file():
                config["chat_template"] = template.read_text(encoding="utf-8")
            tokenizer_json = (out / "tokenizer.json").read_bytes()
    except Exception as e:  # transformers raises ValueError, KeyError, OSError ... on a file
        raise UnsupportedError(
            f"{where}: the GGUF {why}, and transformers' GGUF tokenizer converter failed "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from None
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode(),
    }


def _vocabulary(md: dict[str, Any], where: str) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the GGUF's tokenizer metadata, checked whichever
    path converts it (a malformed one is a CheckpointError naming the key)."""
    tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges", [])
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise CheckpointError(f"{where}: GGUF tokenizer vocabulary or merges missing")
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    for key, values, kind in (
        ("tokens", tokens, str),
        ("merges", merges, str),
        ("token_type", types, int),
    ):
        if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
            raise CheckpointError(
                f"{where}: GGUF tokenizer.ggml.{key} must be an array of {kind.__name__}s"
            )
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{where}: GGUF has {len(tokens)} tokens but {len(types)} token types"
        )
    return tokens, types, merges


def _byte_level_files(header: GGUFHeader) -> dict[str, bytes]:
    """llmc's rebuild of a byte-level BPE GGUF tokenizer (the module docstring's rules)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    md, where = header.metadata, str(header.path)
    tokens, types, merges = _vocabulary(md, where)
    alphabet = set(bytes_to_unicode().values())
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(_spelled(tok, alphabet), i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise CheckpointError(f"{where}: malformed GGUF merge {m!r}")
        pairs.append((a, b))
    pre, ignore_merges = _pre_tokenizer(str(md.get("tokenizer.ggml.pre", "default")), where)
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers raises a bare Exception for a merge out of vocab
        raise CheckpointError(f"{where}: invalid GGUF tokenizer ({e})") from None
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    control = [
        t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL and set(t) <= alphabet
    ]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        i = config_int(i, f"tokenizer.ggml.{key}", where)
        if not 0 <= i < len(tokens):
            raise CheckpointError(f"{where}: tokenizer.ggml.{key} = {i} is out of the vocabulary")
        return tokens[i]

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
        pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
        specials = [(t, vocab[_spelled(t, alphabet)]) for t in {bos, eos} if t is not None]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config_int(header.get("context_length", 2048), "context_length", where),
    }
    if md.get("tokenizer.chat_template"):
        config["chat_template"] = str(md["tokenizer.chat_template"])
    return {
        "tokenizer.json": tok.to_str(pretty=False).encode(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False).encode(),
    }
