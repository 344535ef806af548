"""``llmc build``: flags and profile → BuildConfig → ``llmc.compiler.builder.build`` → tables.

Flags mirror trtllm-build. Precedence: command line > the profile's ``build:`` section >
BuildConfig defaults. A dummy-weights build takes its model from ``--model_config``, else
from the profile's ``model:`` section, else from the checkpoint's config.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from llmc.base.errors import UsageError
from llmc.cli.options import (
    JSON_OPTION,
    PROFILE_OPTION,
    err_console,
    handle_errors,
    load_profile,
    merge_settings,
    option,
    out_console,
    print_json,
    progress_reporter,
)


def build_command(
    checkpoint_dir: Annotated[
        str | None,
        option(
            "checkpoint_dir",
            "HuggingFace checkpoint directory (config.json, *.safetensors, tokenizer) or a "
            ".gguf file. Default: none (required, except with --load_format dummy and "
            "--model_config).",
            metavar="PATH",
        ),
    ] = None,
    output_dir: Annotated[
        str | None,
        option(
            "output_dir",
            "Engine directory to write; refused if it exists unless --force. Default: engine.",
            metavar="DIR",
        ),
    ] = None,
    max_batch_size: Annotated[
        int | None,
        option("max_batch_size", "Most sequences in one step, in sequences. Default: 256."),
    ] = None,
    max_input_len: Annotated[
        int | None,
        option("max_input_len", "Longest prompt, in tokens. Default: max_seq_len."),
    ] = None,
    max_beam_width: Annotated[
        int | None,
        option(
            "max_beam_width",
            "Widest beam search a request may ask for, in beams (each beam is a row of a "
            "step). Default: 1.",
        ),
    ] = None,
    max_seq_len: Annotated[
        int | None,
        option(
            "max_seq_len",
            "Longest prompt plus generated tokens, in tokens. Default: the model's "
            "max_position_embeddings.",
        ),
    ] = None,
    max_num_tokens: Annotated[
        int | None,
        option(
            "max_num_tokens",
            "Per-step token budget (prefill chunk plus decode tokens), in tokens; it sizes "
            "the activation workspace. Default: 8192.",
        ),
    ] = None,
    tokens_per_block: Annotated[
        int | None,
        option("tokens_per_block", "KV-cache page size, in tokens. Default: 32."),
    ] = None,
    dtype: Annotated[
        str | None,
        option(
            "dtype",
            "Activation dtype, and the weights' where not quantized: float32, float16 or "
            "bfloat16. Default: bfloat16.",
            metavar="DTYPE",
        ),
    ] = None,
    quantization: Annotated[
        str | None,
        option(
            "quantization",
            "Weight quantization: auto, none, fp8, int8_wo or int4_wo. auto: a GGUF's "
            "quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are kept as they are, "
            "bit-exact (other types are dequantized and the report names them); anything else "
            "is none. none: every weight in --dtype (a GGUF is dequantized). fp8: W8A8, the "
            "qkv, o, gate_up and down projections in float8_e4m3fn with one scale per output "
            "channel (sm_89 or newer, or cpu). int8_wo / int4_wo: weight-only, those "
            "projections rounded to nearest at build (int8: one scale per output channel; "
            "int4: a scale and offset per --group_size elements), activations in --dtype; "
            "refused on a GGUF that is already quantized. Default: auto.",
            metavar="METHOD",
        ),
    ] = None,
    exclude_modules: Annotated[
        list[str] | None,
        option(
            "exclude_modules",
            "Module-name pattern whose layer projections stay in --dtype in a quantized "
            "engine (fp8, int8_wo, int4_wo), as TensorRT-LLM's exclude_modules: fnmatch "
            "wildcards over HF names (model.layers.29.mlp.down_proj, 'model.layers.29.*', "
            "'*.29.mlp.*'; a module names what is in it: model.layers.29) or llmc's "
            "(layers.29.gate_up_proj). Repeat the flag or separate patterns by commas. q, k "
            "and v (and gate and up) are one fused tensor: exclude all of them or none. A "
            "pattern matching nothing is an error. Default: none.",
            metavar="PATTERN",
        ),
    ] = None,
    group_size: Annotated[
        int | None,
        option(
            "group_size",
            "int4_wo: elements along K (the input dimension) sharing one scale and offset, in "
            "elements; a power of two dividing every projection's K. Default: 128.",
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        str | None,
        option(
            "kv_cache_dtype",
            "KV-cache element type: auto (--dtype) or fp8 (float8_e4m3fn, 1 byte per "
            "element with a k/v scale per layer: the pool holds twice the tokens of "
            "bfloat16). Default: auto.",
            metavar="DTYPE",
        ),
    ] = None,
    tp_size: Annotated[
        int | None,
        option(
            "tp_size",
            "Tensor-parallel ranks, one GPU each: a power of two dividing the model's "
            "attention heads and MLP size; the engine holds one weight file and one memory "
            "plan per rank (unquantized weights only). Default: 1.",
        ),
    ] = None,
    target: Annotated[
        str | None,
        option(
            "target",
            "What the engine runs on: auto (the detected GPU's arch, else cpu), cpu, or a "
            "CUDA arch sm_80 or newer, such as sm_90 (kernels are compiled for it). Default: auto.",
            metavar="TARGET",
        ),
    ] = None,
    load_format: Annotated[
        str | None,
        option(
            "load_format",
            "auto (convert the checkpoint's weights) or dummy (random weights from "
            "--dummy_seed; the engine stores only the seed). Default: auto.",
            metavar="FORMAT",
        ),
    ] = None,
    dummy_seed: Annotated[
        int | None, option("dummy_seed", "Seed of the dummy weights (integer). Default: 0.")
    ] = None,
    model_config: Annotated[
        str | None,
        option(
            "model_config",
            "Model for --load_format dummy: an HF config.json, or YAML (a config, or a "
            "profile with a model: section). Default: the profile's model: section, else the "
            "checkpoint's config.",
            metavar="PATH",
        ),
    ] = None,
    profile: Annotated[str | None, PROFILE_OPTION] = None,
    gpu_memory_gb: Annotated[
        float | None,
        option(
            "gpu_memory_gb",
            "Device memory to plan the KV capacity for when no GPU is detected, in GiB. "
            "Default: none (capacity not computed).",
        ),
    ] = None,
    kv_cache_free_gpu_mem_fraction: Annotated[
        float | None,
        option(
            "kv_cache_free_gpu_mem_fraction",
            "Fraction in (0, 1] of the memory left free after weights and workspace that the "
            "KV cache gets. Default: 0.9.",
        ),
    ] = None,
    no_chunked_prefill: Annotated[
        bool | None,
        option(
            "no_chunked_prefill",
            "Turn chunked prefill off: every prompt must then fit in one step "
            "(max_num_tokens >= max_input_len). Default: chunked prefill on.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        option(
            "dry_run",
            "Read only the model config, plan and print the plan; write nothing. Default: off.",
        ),
    ] = False,
    force: Annotated[
        bool | None,
        option(
            "force",
            "Replace an existing --output_dir that is an llmc engine (or empty). Default: off.",
        ),
    ] = None,
    json_out: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Compile a checkpoint (HF directory or .gguf) into an engine directory."""
    from llmc.compiler.build_config import BuildConfig
    from llmc.compiler.builder import build

    cli: dict[str, Any] = {
        "checkpoint_dir": checkpoint_dir,
        "output_dir": output_dir,
        "max_batch_size": max_batch_size,
        "max_input_len": max_input_len,
        "max_beam_width": max_beam_width,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max_num_tokens,
        "tokens_per_block": tokens_per_block,
        "dtype": dtype,
        "quantization": quantization,
        "exclude_modules": _patterns(exclude_modules),
        "group_size": group_size,
        "kv_cache_dtype": kv_cache_dtype,
        "tp_size": tp_size,
        "target": target,
        "load_format": load_format,
        "dummy_seed": dummy_seed,
        "gpu_memory_gb": gpu_memory_gb,
        "kv_cache_free_gpu_mem_fraction": kv_cache_free_gpu_mem_fraction,
        "enable_chunked_prefill": None if no_chunked_prefill is None else not no_chunked_prefill,
        "force": force,
    }
    prof = load_profile(profile) if profile is not None else None
    yaml_build = prof.section("build") if prof else {}
    source = f"profile {prof.path} (build:)" if prof else "settings"
    settings = merge_settings(cli, yaml_build)
    _check_types(settings, source)
    config = BuildConfig.from_dict(settings, source=source)

    model: Any = model_config
    if model is None and prof and prof.section("model") and config.load_format == "dummy":
        if config.checkpoint_dir is None:
            model = str(prof.path)

    with progress_reporter("llmc build") as progress:  # on stderr, also with --json
        result = build(config, progress, model_config=model, dry_run=dry_run)
    if json_out:
        print_json(result.to_dict())
        return
    from llmc.cli.build_report import print_report

    print_report(out_console(), result)
    if not dry_run:
        err_console().print(f"engine written to {result.output_dir}", markup=False)


_TYPES = {
    "max_batch_size": int,
    "max_beam_width": int,
    "max_input_len": int,
    "max_seq_len": int,
    "max_num_tokens": int,
    "tokens_per_block": int,
    "dummy_seed": int,
    "group_size": int,
    "tp_size": int,
    "gpu_memory_gb": (int, float),
    "kv_cache_free_gpu_mem_fraction": (int, float),
    "enable_chunked_prefill": bool,
    "force": bool,
    "dtype": str,
    "quantization": str,
    "exclude_modules": (list, str),
    "kv_cache_dtype": str,
    "target": str,
    "load_format": str,
    "checkpoint_dir": str,
    "output_dir": str,
}


def _patterns(given: list[str] | None) -> list[str] | None:
    """``--exclude_modules`` values, each split at commas (None: not given)."""
    if not given:
        return None
    return [p.strip() for value in given for p in value.split(",") if p.strip()]


_KIND = {"exclude_modules": "list of patterns"}


def _check_types(settings: dict[str, Any], source: str) -> None:
    """YAML values of the wrong type are a UsageError naming the key (not a traceback)."""
    for key, value in settings.items():
        want = _TYPES.get(key)
        if want is None or value is None:
            continue
        wrong_bool = isinstance(value, bool) and want is not bool
        if wrong_bool or not isinstance(value, want):
            name = want.__name__ if isinstance(want, type) else _KIND.get(key, "number")
            raise UsageError(f"{source}: {key} must be a {name}, got {value!r}")


def register(app: typer.Typer) -> None:
    app.command("build", no_args_is_help=False)(handle_errors(build_command))
