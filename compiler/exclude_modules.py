"""``--exclude_modules``: the projections a quantized engine keeps in the activation dtype.

The ecosystem's way: TensorRT-LLM's ``QuantConfig.exclude_modules`` and ModelOpt's
``hf_quant_config.json`` ``exclude_modules`` are module-name patterns skipped in
quantization (fnmatch wildcards); compressed-tensors checkpoints say ``ignore``, AutoFP8 /
HF ``ignored_layers`` / ``modules_to_not_convert`` (vLLM reads them all). Here a pattern is
matched, with ``fnmatch.fnmatchcase``, against the module names of every layer projection:

- the HF names (``model.layers.29.mlp.down_proj``, ``model.layers.0.self_attn.q_proj``);
- vLLM's fused names (``model.layers.0.self_attn.qkv_proj``, ``model.layers.0.mlp.gate_up_proj``);
- llmc's engine names (``layers.0.qkv_proj``, ``layers.29.gate_up_proj``);

and a pattern naming a module names everything in it (``model.layers.29``, ``layers.29``,
``model.layers.29.mlp``: vLLM's prefixes).

A pattern resolves to the engine projections (``layers.{i}.<FP8_PROJECTIONS>``) it names. An
engine projection fuses several HF linears (q | k | v, gate | up) and has one dtype, so the
patterns together must cover each fused family whole or not at all (vLLM refuses a fused
layer whose shards differ in precision the same way): a family covered in part is a
ConfigError naming the patterns and the members they leave out. A pattern that matches no
module is a ConfigError (with a did-you-mean); one that matches only modules every engine
keeps in the activation dtype anyway (``lm_head``, ``model.embed_tokens``, the norms) is
accepted with a note (ModelOpt checkpoints list ``lm_head``).

``checkpoint_float_projections``: the same for a pre-quantized FP8 checkpoint, whose float
linears are the ones its ignore list left out.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from llmc.base.errors import CheckpointError, ConfigError, did_you_mean
from llmc.compiler.spec import ModelSpec

MEMBERS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}
"""Engine projection → its HF linears (``model.layers.{i}.`` + member), in fusion order."""
FUSED_HF = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
"""vLLM's module names of the fused projections."""
FLOAT_MODULES = ("lm_head", "model.embed_tokens", "model.norm")
FLOAT_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm")
"""Modules every engine keeps in the activation dtype (a pattern matching only these is a
no-op), and per layer its norms."""


def member_modules(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Engine projection ``layers.{i}.<proj>`` → its HF module names (no ``.weight``)."""
    return {
        f"layers.{i}.{proj}": tuple(f"model.layers.{i}.{m}" for m in members)
        for i in range(spec.num_layers)
        for proj, members in MEMBERS.items()
    }


def _aliases(engine_name: str) -> tuple[str, ...]:
    """The whole-family names of one engine projection: llmc's and vLLM's fused one."""
    layer, proj = engine_name.rsplit(".", 1)
    i = layer.split(".", 1)[1]
    fused = FUSED_HF.get(proj)
    return (engine_name,) + ((f"model.layers.{i}.{fused}",) if fused else ())


def _float_modules(spec: ModelSpec) -> list[str]:
    per_layer = (
        f"model.layers.{i}.{m}" for i in range(spec.num_layers) for m in FLOAT_LAYER_MODULES
    )
    return [*FLOAT_MODULES, *per_layer]


def _matches(module: str, pattern: str) -> bool:
    """``pattern`` names ``module`` or a module it sits in (``model.layers.29`` and
    ``model.layers.29.mlp`` name ``model.layers.29.mlp.down_proj``: vLLM's prefixes)."""
    parts = module.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:n]), pattern) for n in range(1, len(parts) + 1))


def resolve_exclude_modules(
    spec: ModelSpec, patterns: Iterable[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the engine projections ``patterns`` exclude, sorted by layer then kind; notes).
    ConfigError for a pattern that matches nothing, or for patterns that split a fused
    family (see the module docstring)."""
    patterns = tuple(patterns)
    members = member_modules(spec)
    floats = _float_modules(spec)
    matched: dict[str, set[str]] = {}  # engine projection → members matched
    by: dict[str, list[str]] = {}  # engine projection → the patterns that matched it
    notes = []
    for pat in patterns:
        if not isinstance(pat, str) or not pat.strip():
            raise ConfigError(
                f"--exclude_modules: a pattern must be a non-empty string, got {pat!r}"
            )
        hit = False
        for name, hf in members.items():
            whole = any(_matches(a, pat) for a in _aliases(name))
            got = set(hf) if whole else {m for m in hf if _matches(m, pat)}
            if got:
                hit = True
                matched.setdefault(name, set()).update(got)
                by.setdefault(name, []).append(pat)
        if hit:
            continue
        if any(fnmatch.fnmatchcase(m, pat) for m in floats):
            notes.append(
                f"--exclude_modules {pat!r} matches only modules that stay in the activation "
                "dtype anyway (lm_head, embeddings, norms): nothing to exclude"
            )
            continue
        names = [*(m for hf in members.values() for m in hf), *members, *FLOAT_MODULES]
        hint = did_you_mean(pat, names)
        raise ConfigError(
            f"--exclude_modules {pat!r} matches no module of this model ({spec.num_layers} "
            f"layers; e.g. model.layers.{spec.num_layers - 1}.mlp.down_proj, "
            f"'model.layers.{spec.num_layers - 1}.*', '*.down_proj'){hint}"
        )
    for name, got in matched.items():
        left = [m for m in members[name] if m not in got]
        if left:
            pats = ", ".join(repr(p) for p in dict.fromkeys(by[name]))
            raise ConfigError(
                f"--exclude_modules {pats} matches only part of the fused projection {name} "
                f"({', '.join(sorted(got))} but not {', '.join(left)}): its members share one "
                f"dtype; exclude all of them (e.g. {_aliases(name)[-1]!r}) or none"
            )
    order = list(members)
    return tuple(sorted(matched, key=order.index)), tuple(notes)


def checkpoint_float_projections(
    spec: ModelSpec, float_members: Iterable[str], source: str
) -> tuple[str, ...]:
    """The engine projections a pre-quantized FP8 checkpoint leaves in a float dtype
    (``float_members``: its HF weight names, ``...weight``, that are not e4m3). A fused
    family with some members in e4m3 and some not is a CheckpointError (vLLM's rule)."""
    floats = {m.removesuffix(".weight") for m in float_members}
    out = []
    for name, hf in member_modules(spec).items():
        left = [m for m in hf if m in floats]
        if not left:
            continue
        if len(left) != len(hf):
            q = [m for m in hf if m not in floats]
            raise CheckpointError(
                f"{source}: the fused projection {name} has {', '.join(q)} in float8_e4m3fn "
                f"but {', '.join(left)} unquantized; llmc fuses them into one tensor of one "
                "dtype, so all of them must be quantized or none"
            )
        out.append(name)
    return tuple(out)


def excluded_summary(spec: ModelSpec, excluded: Iterable[str]) -> Mapping[str, list[str]]:
    """Engine projection kind → the layers it is excluded in (the build report's line)."""
    out: dict[str, list[str]] = {}
    for name in excluded:
        layer, proj = name.rsplit(".", 1)
        out.setdefault(proj, []).append(layer.split(".", 1)[1])
    return out
