"""ModelSpec: the architecture-level description of a model, independent of any checkpoint.

A ModelSpec is built once from a HuggingFace ``config.json`` (or a GGUF header, or a YAML
profile for dummy weights), stored in the engine's manifest, and read back by the runtime.
It also names every tensor of the engine's *execution layout* and its shape, which is the
contract between the compiler's weight passes and the runtime's model code.

Engine tensor names (execution layout; torch ``nn.Linear`` convention ``[out, in]``):

    embed_tokens                    [vocab, hidden]
    layers.{i}.input_norm           [hidden]
    layers.{i}.qkv_proj             [(n_heads + 2 * n_kv_heads) * head_dim, hidden]  rows: q | k | v
    layers.{i}.qkv_bias             [(n_heads + 2 * n_kv_heads) * head_dim]          (qkv_bias only)
    layers.{i}.o_proj               [hidden, n_heads * head_dim]
    layers.{i}.post_attn_norm       [hidden]
    layers.{i}.gate_up_proj         [2 * intermediate, hidden]                 rows: gate | up
    layers.{i}.down_proj            [hidden, intermediate]
    final_norm                      [hidden]
    lm_head                         [vocab, hidden]      (absent when tie_word_embeddings)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmc.base.errors import CheckpointError, ConfigError, UnsupportedError, check_positive_ints

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``kind`` is 'llama3' or 'linear' (HF ``rope_type``)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and hyper-parameters of a decoder-only Llama-family model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        sizes += ("num_kv_heads", "head_dim", "max_position_embeddings")
        check_positive_ints({n: getattr(self, n) for n in sizes}, "model config", ConfigError)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    # ---- derived sizes -------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every engine tensor name → shape, in execution layout (see module docstring)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"layers.{n}."
            shapes[p + "input_norm"] = (h,)
            shapes[p + "qkv_proj"] = (self.qkv_size, h)
            if self.qkv_bias:
                shapes[p + "qkv_bias"] = (self.qkv_size,)
            shapes[p + "o_proj"] = (h, self.q_size)
            shapes[p + "post_attn_norm"] = (h,)
            shapes[p + "gate_up_proj"] = (2 * i, h)
            shapes[p + "down_proj"] = (h, i)
        shapes["final_norm"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, h)
        return shapes

    def num_parameters(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs of one token: 2 × matmul parameters + attention over ``context_len``."""
        h = self.hidden_size
        per_layer = h * self.qkv_size + self.q_size * h + 3 * h * self.intermediate_size
        matmul = 2.0 * (self.num_layers * per_layer + self.vocab_size * h)
        attn = 4.0 * self.num_layers * self.q_size * context_len
        return matmul + attn

    # ---- (de)serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"model spec: unknown keys {unknown}")
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelSpec:
        """Build from a HuggingFace ``config.json`` dictionary."""
        archs = cfg.get("architectures") or []
        if not archs:
            mt = cfg.get("model_type", "")
            archs = {
                "llama": ["LlamaForCausalLM"],
                "mistral": ["MistralForCausalLM"],
                "qwen2": ["Qwen2ForCausalLM"],
            }.get(mt, [mt or "<missing>"])
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedError(
                f"architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "MistralForCausalLM" and cfg.get("sliding_window") not in (None, 0):
            sw, mpe = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 0)
            if sw < mpe:
                raise UnsupportedError(
                    f"MistralForCausalLM with sliding_window={sw} is not supported "
                    "(sliding-window attention); only models without a sliding window are"
                )

        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"config.json: missing required key {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        scaling = None
        rs = cfg.get("rope_scaling")
        if not rs and isinstance(cfg.get("rope_parameters"), dict):
            rs = cfg["rope_parameters"]  # transformers >= 5 writes rope_parameters instead
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(
                    kind="llama3",
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(
                        rs.get("original_max_position_embeddings", 8192)
                    ),
                )
            elif kind == "linear":
                scaling = RopeScaling(kind="linear", factor=float(rs["factor"]))
            elif kind not in (None, "default"):
                raise UnsupportedError(
                    f"rope_scaling type {kind!r} is not supported (supported: llama3, linear)"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(
                cfg.get("rms_norm_eps", 1e-6 if arch == "Qwen2ForCausalLM" else 1e-5)
            ),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
