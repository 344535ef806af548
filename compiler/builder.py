"""``build``: checkpoint (or model config + seed) → engine directory. The Python API of
``llmc build``; the CLI is a thin wrapper around it.

Phases, reported through the ``progress`` callback as ``BuildEvent``s:

- ``read``    the model config only (HF config.json, GGUF header, or a YAML/JSON model
              config for dummy weights) → ModelSpec; limits resolved (compiler/resolve.py).
- ``plan``    the memory plan; a configuration in which one ``max_seq_len`` request cannot
              fit raises CapacityError here, before any weight is read.
- ``convert`` the checkpoint's tensors are read and turned into engine tensors (fused, cast);
              nothing for ``load_format='dummy'`` (the manifest stores the seed).
- ``compile`` cubins for a CUDA target (``llmc.cuda.build``: nvcc where it is on the PATH,
              else CuPy's NVRTC, else UnsupportedError); none for ``target='cpu'``.
- ``write``   the engine files, manifest last (engine_format.py); after its ``done`` event,
              the atomic rename (output_dir.py).

``dry_run`` stops after ``plan`` and writes nothing. Before ``convert``, the output location
is checked (compiler/output_dir.py: the --force rules, a parent that is not a directory, a
read-only or full filesystem, an output overlapping an input; ConfigError, exit 3) and the
stale temp dirs of interrupted builds in the output's parent are removed (``cleaned``).

The progress callback: an exception from it propagates and aborts the build. Every event,
the last ``write done`` included, is sent before the engine directory is committed, so a
callback that raises never leaves ``build()`` raising over a complete engine: ``build()``
returns exactly when the engine is written.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.base import version
from llmc.base.errors import CheckpointError, ConfigError, UsageError
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.build_quant import (
    gguf_native_plan,
    quantization_notes,
    scaled_weights,
    weight_layouts,
    with_checkpoint_floats,
    wo_section,
)
from llmc.compiler.engine_format import KERNELS_DIR, write_engine_files
from llmc.compiler.gguf_native import resolve_gguf_quantization
from llmc.compiler.hf_reader import TOKENIZER_FILES, read_json
from llmc.compiler.limits import EngineLimits
from llmc.compiler.memory_plan import MemoryPlan, plan_memory
from llmc.compiler.output_dir import (
    check_free_space,
    check_output_dir,
    commit_output_dir,
    make_temp_dir,
    writing,
)
from llmc.compiler.resolve import ResolvedBuild, detect_gpu, device_memory, resolve_build
from llmc.compiler.spec import ModelSpec
from llmc.compiler.tp_layout import rank_spec, tp_section
from llmc.cuda.build import check_target, compile_engine_kernels
from llmc.cuda.kernel_cache import kernel_cache_dir

PHASES = ("read", "plan", "convert", "compile", "write")


@dataclass(frozen=True)
class BuildEvent:
    """One progress report: a phase starting or done (with its duration)."""

    phase: str
    status: str  # 'start' | 'done'
    detail: str = ""
    elapsed_s: float = 0.0


ProgressFn = Callable[[BuildEvent], None]


@dataclass(frozen=True)
class BuildResult:
    """What a build (or dry run) produced; ``output_dir`` is None for a dry run."""

    spec: ModelSpec
    build: ResolvedBuild
    plan: MemoryPlan
    notes: tuple[str, ...]
    """Where derived defaults came from (printed by the CLI)."""
    timings_s: dict[str, float]
    output_dir: Path | None = None
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    cleaned: tuple[str, ...] = ()
    """Stale temp dirs of interrupted builds removed from the output's parent."""
    quantization: dict[str, Any] = field(default_factory=dict, repr=False)
    """The manifest's ``quantization`` section (also for a dry run)."""
    rank_plans: tuple[MemoryPlan, ...] = ()
    """One memory plan per tensor-parallel rank (``plan`` is rank 0's); empty: ``(plan,)``."""

    @property
    def dry_run(self) -> bool:
        return self.output_dir is None

    @property
    def plans(self) -> tuple[MemoryPlan, ...]:
        """The memory plan of each rank, rank 0 first."""
        return self.rank_plans or (self.plan,)

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_dir": None if self.output_dir is None else str(self.output_dir),
            "dry_run": self.dry_run,
            "model": self.spec.to_dict(),
            "build": self.build.to_dict(),
            "notes": list(self.notes),
            "cleaned_temp_dirs": list(self.cleaned),
            "timings_s": self.timings_s,
            "plan": self.plan.to_dict(),
            "quantization": self.quantization,
            "tensor_parallel": tp_section(
                self.spec, self.build.tp_size, self.build.load_format != "dummy"
            ),
            "rank_plans": [p.to_dict() for p in self.plans] if self.build.tp_size > 1 else [],
        }


# ---- model config sources ----------------------------------------------------------------
def read_model_config(path: str | Path) -> dict[str, Any]:
    """An HF-style model config from config.json, or from YAML (either the config itself or a
    profile whose ``model:`` section holds it)."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"model config {str(p)!r} does not exist")
    d = _read_yaml_model(p) if p.suffix in (".yaml", ".yml") else read_json(p)
    if not isinstance(d, dict):
        raise UsageError(f"{p}: the model config must be a mapping, got {type(d).__name__}")
    return d


def _read_yaml_model(p: Path) -> Any:
    from llmc.compiler.input_bounds import load_yaml

    d = load_yaml(p, str(p))  # bounded: size, UTF-8, alias expansion
    return d["model"] if isinstance(d, dict) and isinstance(d.get("model"), dict) else d


def _read_spec(
    config: BuildConfig, model_config: str | Path | Mapping[str, Any] | None
) -> tuple[ModelSpec, dict[str, Any], str]:
    """(spec, HF config dict, description of the source) without reading any weight."""
    if model_config is not None:
        if config.load_format != "dummy":
            raise ConfigError(
                "--model_config describes a model for random weights; it needs "
                "--load_format dummy (to build real weights, pass --checkpoint_dir only)"
            )
        if isinstance(model_config, Mapping):
            hf, where = dict(model_config), "model config (profile)"
        else:
            hf, where = read_model_config(model_config), str(model_config)
        return ModelSpec.from_hf_config(hf), hf, where
    if config.checkpoint_dir is None:
        raise ConfigError(
            "no model given: pass --checkpoint_dir (an HF checkpoint directory or a .gguf "
            "file), or --load_format dummy with --model_config (config.json or YAML)"
        )
    from llmc.compiler.checkpoint import read_model_spec

    spec, hf = read_model_spec(config.checkpoint_dir)
    return spec, hf, str(config.checkpoint_dir)


def _dummy_tokenizer_files(checkpoint_dir: str | None) -> dict[str, bytes]:
    """Tokenizer files next to a dummy build's config, when it came from an HF directory."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return {}
    d = Path(checkpoint_dir)
    return {n: (d / n).read_bytes() for n in TOKENIZER_FILES if (d / n).is_file()}


def _compile_kernels(
    spec: ModelSpec, limits: EngineLimits, target: str, out_dir: Path
) -> list[str]:
    """Cubins for a CUDA target (relative names under kernels/); none for cpu. Families
    only some quantizations run (fp8 or weight-only GEMVs) are built for those engines."""
    out_dir.mkdir(exist_ok=True)
    if not target.startswith("sm_"):
        return []
    paths = compile_engine_kernels(
        spec, limits.dtype, target, out_dir, limits.quantization, cache=kernel_cache_dir()
    )
    return sorted(Path(p).resolve().relative_to(out_dir.resolve()).as_posix() for p in paths)


class _Phases:
    def __init__(self, progress: ProgressFn | None) -> None:
        self.progress = progress
        self.timings: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str, detail: str = "") -> Iterator[None]:
        t0 = time.perf_counter()
        if self.progress:
            self.progress(BuildEvent(phase, "start", detail))
        yield
        self.timings[phase] = round(time.perf_counter() - t0, 4)
        if self.progress:
            self.progress(BuildEvent(phase, "done", detail, self.timings[phase]))


def build(
    config: BuildConfig,
    progress: ProgressFn | None = None,
    *,
    model_config: str | Path | Mapping[str, Any] | None = None,
    dry_run: bool = False,
) -> BuildResult:
    """Build an engine directory (or, with ``dry_run``, only plan it).

    ``model_config``: for ``load_format='dummy'``, the model to generate weights for (a path
    to config.json / YAML, or an HF-style mapping); otherwise the spec comes from
    ``config.checkpoint_dir``.
    """
    out = Path(config.output_dir)
    inputs = (config.checkpoint_dir, None if isinstance(model_config, Mapping) else model_config)
    if not dry_run:
        check_output_dir(out, config.force, inputs=inputs)
    phase = _Phases(progress)
    gpu = detect_gpu()
    with phase("read", "model config"):
        spec, hf_config, source = _read_spec(config, model_config)
        native = gguf_native_plan(config, spec, model_config)
        asked = resolve_gguf_quantization(config.quantization, native, source)
        resolved, notes = resolve_build(config, spec, gpu, asked)
        if resolved.target != "cpu":
            check_target(resolved.target)  # an arch the kernels cannot be built for
        scaled = scaled_weights(config, hf_config, model_config)
        resolved, notes = with_checkpoint_floats(resolved, notes, spec, scaled, source)
        layouts = weight_layouts(spec, resolved.limits, config.group_size, native)
    tp = resolved.tp_size

    def plan_all(limits: EngineLimits) -> tuple[MemoryPlan, tuple[MemoryPlan, ...]]:
        plan = plan_memory(
            rank_spec(spec, tp),  # each rank's shard, on a device of this memory
            limits,
            device_memory_bytes=mem,
            memory_source=mem_source,
            kv_cache_free_gpu_mem_fraction=config.kv_cache_free_gpu_mem_fraction,
            layouts=layouts,
        )
        if mem is None:
            plan = _with_note(plan, f"KV capacity not computed: {mem_source}")
        return plan, (plan,) * tp  # the ranks' shards are the same shape: one plan each

    with phase("plan", "memory plan" if tp == 1 else f"memory plans of {tp} ranks"):
        mem, mem_source = device_memory(config, gpu)
        plan, plans = plan_all(resolved.limits)
    dummy = resolved.load_format == "dummy"
    wo = wo_section(spec, layouts, native if asked == "gguf" else None, plan)
    fmt = "dummy" if dummy else "gguf" if native is not None else "hf"
    quant = quantization_notes(spec, resolved.limits, None, fmt, wo, layouts)
    if dry_run:
        return BuildResult(
            spec,
            resolved,
            plan,
            notes,
            phase.timings,
            quantization=quant["section"],
            rank_plans=plans,
        )

    # Before the long work: the output location is usable (a read-only or missing parent,
    # too little space) and the stale temp dirs of interrupted builds are gone.
    tmp, cleaned = make_temp_dir(out)
    try:
        check_free_space(out, 0 if dummy else plan.weight_bytes_total)
        with phase("convert", "dummy weights (seed only)" if dummy else source):
            if dummy:
                weights, tok_files = None, _dummy_tokenizer_files(config.checkpoint_dir)
                fmt = "dummy"
            else:
                from llmc.compiler.checkpoint import load_checkpoint
                from llmc.compiler.weight_passes import to_engine_weights

                keep = native.keep if resolved.limits.quantization == "gguf" else frozenset()
                ckpt = load_checkpoint(config.checkpoint_dir, keep)
                if ckpt.spec != spec:
                    raise CheckpointError(f"{source}: the model config changed while building")
                if ckpt.fp8 is not None and set(ckpt.fp8.weight_scales) != scaled:
                    raise CheckpointError(f"{source}: the checkpoint changed while building")
                lim = resolved.limits
                weights = to_engine_weights(
                    spec,
                    ckpt.tensors,
                    lim.dtype,
                    source,
                    quantization=lim.quantization,
                    kv_cache_dtype=lim.kv_cache_dtype,
                    prequantized=ckpt.fp8,
                    layouts=layouts,
                    member_layouts=native.member_layouts if native is not None else None,
                    float_projections=lim.float_projections,
                )
                tok_files, fmt = dict(ckpt.tokenizer_files), ckpt.source_format
                quant = quantization_notes(spec, lim, ckpt.fp8, fmt, wo, layouts)
                notes = (*notes, *quant["notes"])
                del ckpt  # the HF tensors are no longer needed
        with phase("compile", f"kernels for {resolved.target}"):
            kernels = _compile_kernels(spec, resolved.limits, resolved.target, tmp / KERNELS_DIR)
        with phase("write", str(out)), writing(out):
            manifest = _manifest(
                config, model_config, spec, hf_config, resolved, kernels, sorted(tok_files), fmt
            )
            manifest["quantization"] = quant["section"]
            manifest["tensor_parallel"] = tp_section(spec, tp, weights is not None)
            per_rank = None if weights is None else _rank_weights(spec, weights, tp)
            manifest = write_engine_files(tmp, manifest, plans, per_rank, tok_files)
        # After the last progress event: a callback that raises aborts the build before the
        # engine exists, so build() returns exactly when the engine is written.
        with writing(out):
            commit_output_dir(tmp, out, config.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(
        spec, resolved, plan, notes, phase.timings, out, manifest, cleaned, quant["section"], plans
    )


def _rank_weights(
    spec: ModelSpec, weights: Mapping[str, Any], tp_size: int
) -> Callable[[int], Mapping[str, Any]]:
    """A rank → its engine tensors (the whole model's at tp_size 1)."""
    if tp_size == 1:
        return lambda rank: weights
    from llmc.compiler.tp_shard import rank_tensors

    return lambda rank: rank_tensors(spec, weights, tp_size, rank)


def _manifest(
    config: BuildConfig,
    model_config: str | Path | Mapping[str, Any] | None,
    spec: ModelSpec,
    hf_config: dict[str, Any],
    resolved: ResolvedBuild,
    kernels: list[str],
    tokenizer_files: list[str],
    fmt: str,
) -> dict[str, Any]:
    """manifest.json without its checksums (write_engine_files adds them)."""
    return {
        "format_version": version.ENGINE_FORMAT_VERSION,
        "llmc_version": version.__version__,
        "created_unix": int(time.time()),
        "architecture": spec.architecture,
        "model": spec.to_dict(),
        "hf_config": hf_config,
        "build_config": config.to_dict(),
        "build": resolved.to_dict(),
        "kernels": {
            "arch": resolved.target if resolved.target.startswith("sm_") else None,
            "files": kernels,
        },
        "tokenizer_files": tokenizer_files,
        "source": {
            "checkpoint": config.checkpoint_dir,
            "format": fmt,
            "model_config": None
            if model_config is None or isinstance(model_config, Mapping)
            else str(model_config),
        },
    }


def _with_note(plan: MemoryPlan, note: str) -> MemoryPlan:
    return dataclasses.replace(plan, notes=(*plan.notes, note))
