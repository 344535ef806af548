"""Shared fixtures: tiny random HF checkpoints written by transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def _write_tokenizer(path: Path, vocab_size: int) -> None:
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
    _write_tokenizer(path, cfg_kwargs["vocab_size"])
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from llmc.compiler.model_cache import smollm2_gguf as fetch

    return fetch()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 imported from its GGUF into a HF checkpoint directory (float32 safetensors)."""
    from llmc.compiler.gguf_reader import import_gguf

    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2_hf") / "model")
