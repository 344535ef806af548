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

These are in the activation dtype. An engine with fp8 weights stores the four projections in
float8_e4m3fn and adds ``layers.{i}.<proj>_scale`` float32 [out]; one with an fp8 KV cache
adds ``layers.{i}.kv_scale`` float32 [2] (``llmc.compiler.quantization.engine_tensors``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from llmc.base.errors import CheckpointError, ConfigError, UnsupportedError, check_positive_ints
from llmc.compiler.input_bounds import (
    HF_CONFIG_KEYS,
    MAX_PARAMETERS,
    MODEL_SIZE_LIMITS,
    check_model_sizes,
    config_float,
    config_int,
)

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
        sizes = {name: getattr(self, name) for name in MODEL_SIZE_LIMITS}
        check_positive_ints(sizes, "model config", ConfigError)
        # sizes first: everything below (and every user of the spec) may loop over them
        check_model_sizes(sizes, "model config", {})
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:  # RoPE rotates pairs of dimensions; the kernels need it even
            raise UnsupportedError(
                f"model config: head_dim {self.head_dim} is odd; RoPE and the kernels need "
                "an even head_dim"
            )
        check_model_values(self)
        if self.num_parameters() > MAX_PARAMETERS:
            raise CheckpointError(
                f"model config: {self.num_parameters()} parameters exceed llmc's limit of "
                f"{MAX_PARAMETERS}"
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
        try:
            if d.get("rope_scaling") is not None:
                d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
            d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
            return cls(**d)
        except TypeError as e:  # a missing key, a non-mapping rope_scaling, a non-list
            raise ConfigError(f"model spec: {e}") from None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], where: str = "model config") -> ModelSpec:
        """Build from a HuggingFace ``config.json`` dictionary. A value of the wrong type, past
        its limit (compiler/input_bounds.py) or out of range is a CheckpointError naming the
        config.json key (``where`` names the file); sizes are checked before anything is
        derived from them."""
        arch = _architecture(cfg, where)

        def num(key: str, default: Any = None, *, required: bool = True) -> int | None:
            value = cfg.get(key)
            if value is None:
                if default is None and required:
                    raise CheckpointError(f"{where}: missing required key {key!r}")
                return default
            return config_int(value, key, where)

        sizes = {
            key: num(key, required=key not in ("num_key_value_heads", "head_dim"))
            for key in HF_CONFIG_KEYS
            if key != "max_position_embeddings"
        }
        sizes["max_position_embeddings"] = num("max_position_embeddings", 2048)
        given = {k: v for k, v in sizes.items() if v is not None}
        check_positive_ints(given, where, CheckpointError)
        check_model_sizes(given, where, HF_CONFIG_KEYS)
        hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
        if sizes["head_dim"] is None and hidden % heads:
            raise CheckpointError(
                f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                f"({heads}) and no head_dim is given"
            )
        if arch == "MistralForCausalLM" and cfg.get("sliding_window") not in (None, 0):
            sw = config_int(cfg["sliding_window"], "sliding_window", where)
            if sw < sizes["max_position_embeddings"]:
                raise UnsupportedError(
                    f"MistralForCausalLM with sliding_window={sw} is not supported "
                    "(sliding-window attention); only models without a sliding window are"
                )
        rope = cfg.get("rope_parameters")
        rope = rope if isinstance(rope, dict) else {}  # transformers >= 5 writes these
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        eps = cfg.get("rms_norm_eps", 1e-6 if arch == "Qwen2ForCausalLM" else 1e-5)
        return cls(
            architecture=arch,
            vocab_size=sizes["vocab_size"],
            hidden_size=hidden,
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=sizes["num_key_value_heads"] or heads,
            head_dim=sizes["head_dim"] or hidden // heads,
            rms_norm_eps=config_float(eps, "rms_norm_eps", where),
            rope_theta=10000.0 if theta is None else config_float(theta, "rope_theta", where),
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or rope or None, where),
            max_position_embeddings=sizes["max_position_embeddings"],
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", where),
            qkv_bias=arch == "Qwen2ForCausalLM",
            bos_token_id=_token_ids(cfg.get("bos_token_id"), "bos_token_id", where, single=True),
            eos_token_ids=_token_ids(cfg.get("eos_token_id"), "eos_token_id", where),
        )


def check_model_values(spec: ModelSpec) -> None:
    """The values an engine built from ``spec`` would run on: finite positive epsilon and RoPE
    base, sane RoPE scaling, token ids inside the vocabulary (CheckpointError naming them)."""
    where = "model config"
    for name in ("rms_norm_eps", "rope_theta"):
        value = config_float(getattr(spec, name), name, where)
        if value <= 0:
            raise CheckpointError(f"{where}: {name} must be positive, got {value!r}")
    rs = spec.rope_scaling
    if rs is not None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if config_float(getattr(rs, name), f"rope_scaling.{name}", where) <= 0:
                raise CheckpointError(f"{where}: rope_scaling.{name} must be positive")
        if rs.kind == "llama3" and rs.high_freq_factor <= rs.low_freq_factor:
            raise CheckpointError(
                f"{where}: rope_scaling.high_freq_factor ({rs.high_freq_factor}) must be above "
                f"low_freq_factor ({rs.low_freq_factor})"
            )
        check_positive_ints(
            {"rope_scaling.original_max_position_embeddings": rs.original_max_position_embeddings},
            where,
            CheckpointError,
        )
    ids = [("bos_token_id", spec.bos_token_id)] if spec.bos_token_id is not None else []
    ids += [("eos_token_id", e) for e in spec.eos_token_ids]
    for name, token in ids:
        if isinstance(token, bool) or not isinstance(token, int):
            raise CheckpointError(f"{where}: {name} must be an integer, got {token!r}")
        if not 0 <= token < spec.vocab_size:
            raise CheckpointError(
                f"{where}: {name} {token} is outside the vocabulary (0..{spec.vocab_size - 1}); "
                "the engine could never stop on it"
            )


def _architecture(cfg: dict[str, Any], where: str) -> str:
    archs = cfg.get("architectures") or []
    if isinstance(archs, str) or not isinstance(archs, list):
        raise CheckpointError(f"{where}: architectures must be a list, got {archs!r:.60}")
    if not archs:
        mt = cfg.get("model_type", "")
        mt = mt if isinstance(mt, str) else repr(mt)
        archs = [_MODEL_TYPES.get(mt, mt or "<missing>")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedError(
            f"architecture {str(arch)[:60]!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def _rope_scaling(rs: Any, where: str) -> RopeScaling | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise CheckpointError(f"{where}: rope_scaling must be a mapping, got {rs!r:.60}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise UnsupportedError(
            f"rope_scaling type {str(kind)[:60]!r} is not supported (supported: llama3, linear)"
        )
    if "factor" not in rs:
        raise CheckpointError(f"{where}: rope_scaling ({kind}) lacks 'factor'")

    def get(key: str, default: float) -> float:
        return config_float(rs.get(key, default), f"rope_scaling.{key}", where)

    factor = get("factor", 1.0)
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    old = rs.get("original_max_position_embeddings", 8192)
    return RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=get("low_freq_factor", 1.0),
        high_freq_factor=get("high_freq_factor", 4.0),
        original_max_position_embeddings=config_int(
            old, "rope_scaling.original_max_position_embeddings", where
        ),
    )


def _flag(cfg: dict[str, Any], key: str, where: str) -> bool:
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {value!r:.60}")
    return bool(value)


@overload
def _token_ids(value: Any, key: str, where: str, *, single: Literal[True]) -> int | None: ...
@overload
def _token_ids(value: Any, key: str, where: str) -> tuple[int, ...]: ...
def _token_ids(value: Any, key: str, where: str, *, single: bool = False) -> Any:
    """A token id (``single``) or a list of them, as ints; the range is ModelSpec's check."""
    if value is None:
        return None if single else ()
    if single:
        return config_int(value, key, where)
    values = value if isinstance(value, list) else [value]
    return tuple(config_int(v, key, where) for v in values)
