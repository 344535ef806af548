"""Tiny GGUF files written with gguf-py from the HF fixtures, as llama.cpp's converter would
write them (``write_gguf``): the tensors renamed (and q/k permuted for llama), a byte-level
BPE tokenizer (``gpt2``) by default, or the caller's tokenizer metadata (``tokenizer``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_file

TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf in top or hf == "lm_head.weight":
        return top.get(hf, "output.weight")
    _, _, n, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{n}.{TO_GGUF[module]}.{kind}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (what the reader must undo)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    hf_dir: Path,
    path: Path,
    arch: str = "llama",
    qtype: Any = None,
    edit: Callable[[Any, dict[str, np.ndarray]], None] | None = None,
    tokenizer: Callable[[Any], None] | None = None,
) -> Path:
    """A GGUF as llama.cpp's converter would write it (F32, or ``qtype`` for the matrices).
    ``edit(writer, tensors)`` changes it before the tensors are written; ``tokenizer(writer)``
    writes the tokenizer metadata instead of the fixture's byte-level BPE."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens[-1] = "Ġt"  # one merge ("Ġ" + "t") in use, in place of a rare byte
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if tokenizer is not None:
        tokenizer(w)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t.startswith("<") and len(t) > 1 else 1 for t in tokens])
        w.add_token_merges(["Ġ t"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if edit:
        edit(w, tensors)
    for name, t in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            t = _llamacpp_permute(t, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            t = _llamacpp_permute(t, cfg["num_key_value_heads"])
        if qtype is not None and t.ndim == 2:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sentencepiece_tokens(vocab_size: int = 256) -> list[tuple[str, int, float]]:
    """A SentencePiece-style ("llama") vocabulary of ``vocab_size`` (token, type, score):
    <unk>/<s>/</s>, byte-fallback tokens <0x00>..<0x7F>, ``▁``-prefixed word pieces and
    letters (scores: earlier = merged first), padded with rare pieces."""
    toks = [("<unk>", 2, 0.0), ("<s>", 3, 0.0), ("</s>", 3, 0.0)]
    toks += [(f"<0x{b:02X}>", 6, 0.0) for b in range(128)]
    words = (
        "▁t he ▁the ▁h ll llo ▁hello ▁w or ▁wor ld ▁world ▁a in er ▁b en ▁s on at ▁i ing ▁in"
    ).split()
    letters = [chr(c) for c in (*range(ord("a"), ord("z") + 1), *range(ord("A"), ord("Z") + 1))]
    pieces = [*words, "▁", *letters, *".,!?'-0123456789"]
    toks += [(p, 1, -float(i)) for i, p in enumerate(pieces)]
    toks += [(f"▁x{i}", 1, -1000.0 - i) for i in range(vocab_size - len(toks))]
    return toks[:vocab_size]


def sentencepiece_tokenizer(model: str = "llama", pre: str = "default") -> Callable[[Any], None]:
    """A ``write_gguf(tokenizer=...)`` hook: the ``sentencepiece_tokens`` vocabulary under
    tokenizer model ``model`` (scores, types, BOS added, a chat template)."""

    def write(w: Any) -> None:
        toks = sentencepiece_tokens()
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.add_token_list([t for t, _, _ in toks])
        w.add_token_scores([s for _, _, s in toks])
        w.add_token_types([ty for _, ty, _ in toks])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                            "{% endfor %}")  # fmt: skip

    return write
