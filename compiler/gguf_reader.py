"""GGUF checkpoints (llama.cpp's format): dequantization and HF conversion.

The header (metadata and tensor table) is read by gguf_header.py and the tokenizer rebuilt by
gguf_tokenizer.py; this module joins them into a checkpoint. What it owns:
- ``gguf_hf_config``: a HuggingFace ``config.json`` dictionary rebuilt from the metadata.
- ``read_gguf_tensors``: every tensor dequantized to float32 (``gguf.quants``, vectorised in
  numpy) under its HuggingFace name, with llama.cpp's rotary row permutation of the Q and K
  projections undone for the ``llama`` architecture.
- ``import_gguf``: writes a complete HuggingFace checkpoint directory (atomically).
- Llama 3 RoPE scaling, which llama.cpp stores as a ``rope_freqs`` tensor of divisors, is
  recovered into the config's ``rope_scaling`` (and checked to reproduce that tensor).

Invariants: the HF tensors equal what transformers' own GGUF loader produces (tested on
SmolLM2 through logits); any malformed file raises CheckpointError naming the file.
"""

from __future__ import annotations

import json
import mmap
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmc.base.errors import CheckpointError, UnsupportedError, check_positive_ints
from llmc.compiler.gguf_header import (
    TOKENIZER_ARRAYS,
    GGUFHeader,
    GGUFTensorInfo,
    open_map,
    read_gguf_header,
    type_name,
)
from llmc.compiler.gguf_tokenizer import gguf_tokenizer_files
from llmc.compiler.input_bounds import HF_CONFIG_KEYS, check_model_sizes, config_float, config_int
from llmc.compiler.wo_layout import KEPT_TYPES

if TYPE_CHECKING:  # torch is imported where tensors are made: a dry run reads headers only
    import torch

ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling; folded into the config, not a weight
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _float32_repr(x: float) -> float:
    """GGUF stores float32; give back the shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def gguf_hf_config(header: GGUFHeader) -> dict[str, Any]:
    """A HuggingFace config.json dictionary for the model in ``header``."""
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedError(
            f"{header.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    names = {t.name for t in header.tensors}
    where, md = str(header.path), header.metadata

    def need(key: str) -> Any:
        value = header.get(key)
        if value is None:
            raise CheckpointError(f"{header.path}: GGUF metadata lacks {arch}.{key}")
        return value

    def size(key: str, hf_key: str, default: int | None = None) -> int:
        """A size from the metadata, typed and bounded before anything is derived from it."""
        value = need(key) if default is None else header.get(key, default)
        n = config_int(value, f"{arch}.{key}", where)
        check_positive_ints({f"{arch}.{key}": n}, where, CheckpointError)
        check_model_sizes({f"{arch}.{key}": n}, where, {f"{arch}.{key}": HF_CONFIG_KEYS[hf_key]})
        return n

    def token_id(key: str) -> int:
        return config_int(md[key], key, where)

    def real(key: str, default: float) -> float:
        return _float32_repr(config_float(header.get(key, default), f"{arch}.{key}", where))

    hidden, heads = (
        size("embedding_length", "hidden_size"),
        size("attention.head_count", "num_attention_heads"),
    )
    tokens = md.get("tokenizer.ggml.tokens")  # a list, or its length when skipped
    vocab = size("vocab_size", "vocab_size", len(tokens) if isinstance(tokens, list) else tokens)
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos = list(dict.fromkeys(token_id(k) for k in eos_keys if k in md))
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length", "intermediate_size"),
        "num_hidden_layers": size("block_count", "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": size("attention.head_count_kv", "num_key_value_heads", heads),
        "head_dim": size("attention.key_length", "head_dim", max(hidden // heads, 1)),
        "max_position_embeddings": size("context_length", "max_position_embeddings", 2048),
        "rms_norm_eps": real("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": real("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = header.get("rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise CheckpointError(f"{where}: {arch}.rope.scaling.type must be a string")
    rope_freqs = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if rope_freqs is not None:
        cfg["rope_scaling"] = _llama3_scaling(
            header, rope_freqs, cfg["head_dim"], cfg["rope_theta"]
        )
    elif scaling == "linear":
        factor = config_float(need("rope.scaling.factor"), f"{arch}.rope.scaling.factor", where)
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise UnsupportedError(
            f"{header.path}: GGUF rope scaling {str(scaling)[:60]!r} is not supported"
        )
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    if "tokenizer.ggml.bos_token_id" in md:
        cfg["bos_token_id"] = token_id("tokenizer.ggml.bos_token_id")
    if eos:
        cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "tokenizer.ggml.padding_token_id" in md:
        cfg["pad_token_id"] = token_id("tokenizer.ggml.padding_token_id")
    return cfg


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling, as convert_hf_to_gguf writes them."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * np.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid))


def _llama3_scaling(
    header: GGUFHeader, info: GGUFTensorInfo, head_dim: int, theta: float
) -> dict[str, Any]:
    """Recover HF ``rope_scaling`` from a ``rope_freqs`` tensor (llama.cpp stores no params).

    Llama 3.x always used low/high frequency factors 1 and 4 over an 8192-token original
    context; the factor is the largest divisor. Anything else is refused, not guessed.
    """
    factors = _dequantize(open_map(header.path), info).astype(np.float64)
    scaling = {
        "rope_type": "llama3",
        "factor": float(np.float32(factors.max())),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": config_int(
            header.get("rope.scaling.original_context_length", 8192),
            "rope.scaling.original_context_length",
            str(header.path),
        ),
    }
    expected = llama3_rope_factors(head_dim, theta, scaling)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-5):
        raise UnsupportedError(
            f"{header.path}: the rope_freqs tensor is not Llama 3 RoPE scaling with "
            "low_freq_factor=1, high_freq_factor=4; this GGUF's RoPE scaling is not supported"
        )
    return scaling


def hf_tensor_name(gguf_name: str, path: Path) -> str:
    """llama.cpp tensor name → HuggingFace name (CheckpointError for an unknown one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise CheckpointError(f"{path}: unexpected GGUF tensor {gguf_name!r}")


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert convert_hf_to_gguf's Q/K row permutation (interleaved → half-split rotary).

    llama.cpp writes ``w.reshape(h, 2, d // 2, ...).swapaxes(1, 2)``; this undoes it.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _dequantize(buf: mmap.mmap, info: GGUFTensorInfo) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    rows = info.shape[:-1] if len(info.shape) > 1 else ()
    qtype = GGMLQuantizationType(info.ggml_type)
    try:
        out = dequantize(raw.reshape(*rows, -1), qtype)
    except NotImplementedError as e:
        raise UnsupportedError(
            f"{info.name}: ggml type {qtype.name} is not supported (llmc keeps "
            f"{', '.join(KEPT_TYPES)} packed and dequantizes F32, F16, BF16 and the other types "
            "gguf.quants can dequantize)"
        ) from e
    out = np.asarray(out, dtype=np.float32).reshape(info.shape)
    return out if out.flags.writeable else out.copy()  # F32 is a view of the read-only map


def read_gguf_tensors(
    header: GGUFHeader, config: dict[str, Any], keep: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Every tensor as float32 under its HF name, Q/K un-permuted for ``llama``; the GGUF
    tensors named in ``keep`` as ``PackedWeight``s of their own blocks instead
    (``llmc.compiler.gguf_blocks``; the un-permutation moves whole rows, so it applies to
    codes, scales and offsets alike)."""
    import torch

    from llmc.compiler.gguf_blocks import blocks_to_packed
    from llmc.compiler.wo_weights import permute_rows

    buf = open_map(header.path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, Any] = {}
    for info in header.tensors:
        if info.name == ROPE_FREQS:
            continue
        name = hf_tensor_name(info.name, header.path)
        if info.name in keep:
            raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
            t: Any = blocks_to_packed(raw, info.shape, type_name(info.ggml_type), info.name)
        else:
            t = torch.from_numpy(_dequantize(buf, info))
        n = heads if ".attn_q." in info.name else kv_heads if ".attn_k." in info.name else 0
        if header.architecture == "llama" and n:
            t = (
                permute_rows(t, lambda x, n=n: unpermute_rotary(x, n))
                if info.name in keep
                else (unpermute_rotary(t, n))
            )
        out[name] = t
    return out


def gguf_hf_shapes(header: GGUFHeader) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape, from the tensor table only."""
    return {
        hf_tensor_name(t.name, header.path): t.shape for t in header.tensors if t.name != ROPE_FREQS
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if k in config}


def load_gguf(
    path: str | Path, keep: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """``(hf_config, hf_tensors (float32; PackedWeights for ``keep``), files)`` of a GGUF file.

    ``files`` are tokenizer.json, tokenizer_config.json and generation_config.json. The tensor
    table is validated against the config before any tensor is dequantized.
    """
    from llmc.compiler.spec import ModelSpec
    from llmc.compiler.weight_passes import validate_hf_tensors

    header = read_gguf_header(path, string_arrays=TOKENIZER_ARRAYS)
    config = gguf_hf_config(header)
    spec = ModelSpec.from_hf_config(config, str(path))
    validate_hf_tensors(spec, gguf_hf_shapes(header), str(path))
    files = gguf_tokenizer_files(header)
    files["generation_config.json"] = json.dumps(generation_config(config), indent=2).encode()
    return config, read_gguf_tensors(header, config, keep), files


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    force: bool = False,
    *,
    report: Callable[[str], None] | None = None,
) -> Path:
    """Write a HuggingFace checkpoint directory (float32 safetensors) for a GGUF file.

    ``out_dir`` must be absent or empty, or, with ``force``, a directory llmc import wrote
    (its ``llmc_import.json`` marker, written here); anything else is refused (ConfigError,
    compiler/output_dir.py). The directory appears whole or not at all (a temporary directory
    and a rename); the stale temp dirs of interrupted writes beside it are removed first, and
    each one is passed to ``report``.
    """
    from safetensors.torch import save_file

    from llmc.base import version
    from llmc.compiler.output_dir import (
        IMPORT_MARKER,
        check_output_dir,
        commit_output_dir,
        make_temp_dir,
        writing,
    )

    out = Path(out_dir)
    if not force and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: output directory exists and is not empty")
    check_output_dir(out, force, kind="import", inputs=[gguf_path], empty_ok=True)
    tmp, cleaned = make_temp_dir(out)  # before the long work: the output is writable
    for path in cleaned:
        if report is not None:
            report(f"removed the stale temp dir {path} of an interrupted write")
    try:
        config, tensors, tokenizer_files = load_gguf(gguf_path)
        marker = {"llmc_version": version.__version__, "gguf": str(gguf_path)}
        files = {
            **tokenizer_files,
            "config.json": json.dumps(config, indent=2).encode(),
            IMPORT_MARKER: json.dumps(marker, indent=2).encode(),
        }
        with writing(out):
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for f in tmp.iterdir():
                f.chmod(0o644)
            tmp.chmod(0o755)
            commit_output_dir(tmp, out, force, kind="import")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
