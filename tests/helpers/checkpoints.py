"""Tiny random HF checkpoints written by transformers itself (the conftest fixtures
``tiny_llama_dir`` / ``tiny_qwen2_dir`` call these once per session)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries (no merges needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        if len(vocab) >= vocab_size:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", '
        "\"chat_template\": \"{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\\n"
        '{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"}'
    )


def make_hf_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random LlamaForCausalLM / Qwen2ForCausalLM checkpoint to ``path``."""
    import transformers

    torch.manual_seed(seed)
    cfg_kwargs = {**TINY_LLAMA, **overrides}
    if arch == "llama":
        cfg = transformers.LlamaConfig(**cfg_kwargs)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**cfg_kwargs)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # non-trivial norms and biases so that a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, cfg_kwargs["vocab_size"])
    return path


def truncate_checkpoint(src: Path, dst: Path, num_layers: int) -> Path:
    """A copy of the HF checkpoint ``src`` keeping only its first ``num_layers`` layers: a
    small model with real weights (peaked logits, unlike a random one)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(dst / "model.safetensors"))
    keep = {
        k: v
        for k, v in tensors.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    save_file(keep, str(dst / "model.safetensors"))
    return dst
