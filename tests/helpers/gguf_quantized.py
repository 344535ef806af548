"""Small GGUF files with quantized tensors, written with the ``gguf`` package.

- ``random_blocks``: the raw bytes of an [N, K] tensor of one ggml type: Q8_0 / Q4_0 / Q4_1
  quantized from random floats by ``gguf.quants.quantize``; the K-quants (which gguf's numpy
  code cannot quantize) as random blocks with finite float16 scales (every byte pattern of
  the rest is a valid block), so every code and sub-scale value occurs;
- ``write_tiny_gguf``: a complete llama GGUF (hidden 256, so K-quant rows are whole blocks)
  whose tensors have the given types, with the byte-level BPE tokenizer of the hostile
  suite's tiny file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}
F16_FIELDS.update(Q6_K=(208,), Q8_1=(0, 2))

TOKENS = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "ab", "cd", "ef", "gh"]
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, len(TOKENS)


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, bytes per row] of ``qtype`` (module docstring)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    t = GGMLQuantizationType[qtype]
    if qtype in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return np.asarray(quantize(w, t)).view(np.uint8).reshape(n, -1)
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:  # d (and dmin): finite, of both signs for Q6_K
        d = (rng.standard_normal(len(raw)) * 0.002).astype(np.float16)
        raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def tiny_shapes(layers: int = 1, tied: bool = False) -> dict[str, tuple[int, int] | tuple[int]]:
    h, f, kv = HIDDEN, FFN, KV_HEADS * HIDDEN // HEADS
    shapes: dict = {"token_embd.weight": (VOCAB, h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (VOCAB, h)
    for i in range(layers):
        for name, shape in {
            "attn_norm.weight": (h,), "attn_q.weight": (h, h), "attn_k.weight": (kv, h),
            "attn_v.weight": (kv, h), "attn_output.weight": (h, h), "ffn_norm.weight": (h,),
            "ffn_gate.weight": (f, h), "ffn_up.weight": (f, h), "ffn_down.weight": (h, f),
        }.items():  # fmt: skip
            shapes[f"blk.{i}.{name}"] = shape
    return shapes


def write_tiny_gguf(
    path: Path, types: dict[str, str], *, layers: int = 1, tied: bool = False, seed: int = 0
) -> Path:
    """A llama GGUF; ``types``: tensor-name suffix (``attn_v.weight``, ``token_embd.weight``)
    → ggml type name; unnamed matrices are Q8_0, vectors F32."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, *[1] * (VOCAB - 2)])
    w.add_token_merges(["a b", "c d", "e f", "g h"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, shape in tiny_shapes(layers, tied).items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), "Q8_0")
        raw = random_blocks(qtype, *shape, rng)
        if qtype in ("F32", "F16"):
            w.add_tensor(name, raw.view(np.float32 if qtype == "F32" else np.float16))
        else:
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
