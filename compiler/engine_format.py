"""The engine directory: writing it atomically, and loading it back with every check.

Layout (the contract between ``llmc build`` and the runtime)::

    manifest.json        format_version, llmc_version, architecture, model (ModelSpec),
                         hf_config, build_config (as given), build (ResolvedBuild),
                         quantization (in words; per-tensor weight-only layouts),
                         kernels {arch, files}, tokenizer_files, source, files {name: sha256}
    weights.safetensors  engine tensors (compiler/spec.py names), fused and cast; a packed
                         weight-only tensor as <name> (uint8 codes), <name>_scale and
                         <name>_offset, its layout in quantization.layouts; absent for
                         load_format 'dummy' (build.dummy_seed regenerates them)
    plan.json            the MemoryPlan (compiler/memory_plan.py), for the build's EngineLimits
    weights.rank{r}.safetensors, plan.rank{r}.json
                         with tp_size > 1, instead of the two above: rank r's tensors and plan
                         (compiler/tp_layout.py); the manifest's tensor_parallel section names them
    tokenizer.json, tokenizer_config.json, generation_config.json   (when the source had them)
    kernels/             cubins for build.target when it is a CUDA arch

Invariants: ``manifest.json`` is written last, into a temporary sibling directory that is
renamed to the output directory only when complete (compiler/output_dir.py), so a failed
build is never loadable. ``load_engine`` refuses (EngineError, exit 7, naming the file or key,
or both values and the rebuild command) a manifest or plan that is not a UTF-8 JSON object of
the expected sections and types, a file name that leaves the directory or a file that is not
regular (never opened: compiler/engine_files.py), a missing file, a checksum mismatch (no
digest is printed), another format or llmc version, a plan.json that is not this llmc's plan
for the manifest's limits, or a target the caller cannot run. Every value from the manifest
in a message passes through ``llmc.base.text.printable`` (no control characters reach a
terminal). It parses manifest.json once; the runtime reads the ``LoadedEngine``, never the
file.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmc.base import version
from llmc.base.errors import ConfigError, EngineError, UnsupportedError
from llmc.base.text import printable
from llmc.compiler.engine_files import (
    check_files,
    checksum_table,
    confined,
    manifest_sections,
    sha256_file,
)
from llmc.compiler.limits import EXCLUDABLE_QUANTIZATIONS, EngineLimits
from llmc.compiler.memory_plan import MemoryPlan, plan_mismatch
from llmc.compiler.output_dir import TMP_MARKER
from llmc.compiler.quantization import check_float_layers
from llmc.compiler.resolve import ResolvedBuild
from llmc.compiler.spec import ModelSpec
from llmc.compiler.tp_layout import (
    PLAN_FILE,
    WEIGHTS_FILE,
    check_rank,
    check_tp,
    plan_file,
    rank_spec,
    tp_section,
    weights_file,
)
from llmc.compiler.wo_layout import (
    GGUF_NATIVE,
    WO_QUANTIZATIONS,
    WeightLayout,
    layouts_from_manifest,
)

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
WEIGHTS = WEIGHTS_FILE
"""The weight file of a tp_size-1 engine (``tp_layout.weights_file`` names each rank's)."""
PLAN = PLAN_FILE
KERNELS_DIR = "kernels"


# ---- writing ---------------------------------------------------------------------------
def write_engine_files(
    tmp_dir: Path,
    manifest: dict[str, Any],
    plans: Sequence[MemoryPlan],
    weights: Callable[[int], Mapping[str, torch.Tensor]] | None,
    tokenizer_files: Mapping[str, bytes],
) -> dict[str, Any]:
    """Write every file into ``tmp_dir`` (kernels/ already there), manifest last; returns it.
    ``plans`` has one memory plan per tensor-parallel rank; ``weights(rank)`` gives that
    rank's engine tensors (called once per rank, so one rank's copy exists at a time)."""
    (tmp_dir / KERNELS_DIR).mkdir(exist_ok=True)
    tp = len(plans)
    for rank, plan in enumerate(plans):
        if weights is not None:
            from safetensors.torch import save_file

            meta = {"format": "pt", "llmc_version": version.__version__}
            tensors = {k: v.contiguous() for k, v in weights(rank).items()}
            save_file(tensors, tmp_dir / weights_file(tp, rank), meta)
            del tensors
        (tmp_dir / plan_file(tp, rank)).write_text(plan.to_json())
    reserved = {MANIFEST, *(weights_file(tp, r) for r in range(tp))}
    reserved |= {plan_file(tp, r) for r in range(tp)}
    for name, data in tokenizer_files.items():
        if Path(name).name != name or name in reserved:
            raise ConfigError(f"tokenizer file name {name!r} is not allowed in an engine")
        (tmp_dir / name).write_bytes(data)
    files = {
        p.relative_to(tmp_dir).as_posix(): sha256_file(p)
        for p in sorted(tmp_dir.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, TMP_MARKER)
    }
    manifest = {**manifest, "files": files}
    (tmp_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _normal_permissions(tmp_dir)
    return manifest


def _normal_permissions(root: Path) -> None:
    """mkdtemp (and safetensors) create owner-only entries; give the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


# ---- loading ---------------------------------------------------------------------------
def rebuild_command(manifest: Mapping[str, Any], engine_dir: Path | str, **override: Any) -> str:
    """The ``llmc build`` command that rebuilds this engine (with ``override`` applied)."""
    from llmc.compiler.build_config import BuildConfig

    given = manifest.get("build_config")
    given = {**(given if isinstance(given, dict) else {}), **override}
    defaults = BuildConfig().to_dict()
    args = ["llmc", "build"]
    source = manifest.get("source")
    source = source if isinstance(source, dict) else {}
    if given.get("checkpoint_dir"):
        args += ["--checkpoint_dir", str(given["checkpoint_dir"])]
    if source.get("model_config"):
        args += ["--model_config", str(source["model_config"])]
    args += ["--output_dir", str(engine_dir)]
    for key, value in given.items():
        if key in ("checkpoint_dir", "output_dir", "force") or value == defaults.get(key):
            continue
        if key == "enable_chunked_prefill":
            args.append("--no_chunked_prefill" if not value else "")
            continue
        if key == "exclude_modules":  # a list, repeated; dropped with an unquantized override
            if given.get("quantization") in EXCLUDABLE_QUANTIZATIONS:
                args += [a for p in value or () for a in ("--exclude_modules", str(p))]
            continue
        args += [f"--{key}", str(value)]
    args.append("--force")
    return printable(" ".join(shlex.quote(a) for a in args if a))


@dataclass(frozen=True)
class LoadedEngine:
    """A verified engine directory. Weights are loaded on demand by ``load_weights``."""

    dir: Path
    manifest: dict[str, Any]
    spec: ModelSpec
    build: ResolvedBuild
    plan: MemoryPlan
    tokenizer_path: Path | None
    """tokenizer.json, or None for an engine built without one (dummy from a YAML config)."""
    kernels_dir: Path
    layouts: dict[str, WeightLayout] = field(default_factory=dict)
    """The weight-only packed engine tensors and their layouts (manifest
    ``quantization.layouts``; ``llmc.compiler.wo_layout``); empty for other engines."""
    rank: int = 0
    """The tensor-parallel rank loaded: ``plan`` and ``load_weights`` are this rank's."""

    @property
    def tp_size(self) -> int:
        return self.build.tp_size

    @property
    def rank_spec(self) -> ModelSpec:
        """The model this rank computes (its heads and MLP columns; ``spec`` at tp_size 1)."""
        return rank_spec(self.spec, self.tp_size)

    @property
    def weights_path(self) -> Path:
        """This rank's weight file (absent for dummy weights)."""
        return self.dir / weights_file(self.tp_size, self.rank)

    @property
    def limits(self) -> EngineLimits:
        """The engine's limits, as built (a run may lower them: ``EngineLimits.lowered``)."""
        return self.build.limits

    @property
    def kernel_files(self) -> tuple[Path, ...]:
        return tuple(self.kernels_dir / f for f in self.manifest["kernels"]["files"])

    def check_target(self, target: str) -> None:
        """Refuse a target this engine cannot run (see ``load_engine``'s ``target``)."""
        _check_target(self.manifest, self.dir, self.build.target, target)

    def load_weights(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """This rank's engine tensors on ``device``: read from its weight file, or
        regenerated from the dummy seed (each whole tensor cut for the rank as it comes;
        quantized there for an fp8 engine). Names, shapes and dtypes are checked against
        the rank's tensor table (``quantization.engine_tensors`` of ``rank_spec``)."""
        import torch

        from llmc.compiler.quantization import check_engine_tensors

        lim = self.limits
        if self.build.load_format == "dummy":
            from llmc.compiler.dummy import iter_dummy_weights
            from llmc.compiler.tp_shard import iter_rank_tensors
            from llmc.compiler.weight_passes import quantize_engine_weights

            made = iter_dummy_weights(self.spec, lim.dtype, self.build.dummy_seed, device)
            made = iter_rank_tensors(self.spec, made, self.tp_size, self.rank)
            tensors = quantize_engine_weights(
                self.rank_spec, made, lim.quantization, lim.kv_cache_dtype, "dummy weights",
                self.layouts, lim.float_projections,
            )  # fmt: skip
        else:
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                tensors = load_file(self.weights_path, device=str(torch.device(device)))
            except (SafetensorError, OSError) as e:
                raise EngineError(f"{self.weights_path}: cannot read weights: {e}") from e
        where = printable(self.weights_path)
        check_engine_tensors(tensors, self.rank_spec, lim, where, layouts=self.layouts)
        return tensors


def _read_json(path: Path, what: str) -> dict[str, Any]:
    where = printable(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineError(f"{where}: {what} is missing; the engine is incomplete") from None
    except UnicodeDecodeError as e:
        raise EngineError(f"{where}: {what} is not UTF-8 text (byte {e.start})") from None
    except ValueError as e:  # JSONDecodeError, or a number too long to convert
        raise EngineError(f"{where}: {what} is not valid JSON ({e})") from None
    except OSError as e:
        raise EngineError(f"{where}: {what} cannot be read ({e.strerror})") from None
    if not isinstance(d, dict):
        raise EngineError(f"{where}: {what} is not a JSON object")
    return d


def _check_target(manifest: dict[str, Any], engine_dir: Path, built: str, target: str) -> None:
    """A cpu engine runs anywhere through the torch backend (target None/'cpu'); the CUDA
    backend on an sm_XX GPU needs an engine built for exactly that arch (EngineError with
    the rebuild command)."""
    if target == "cpu" or built == target:
        return
    fix = rebuild_command(manifest, engine_dir, target=target)
    raise EngineError(
        f"engine {engine_dir} was built for target {built!r}, but this run needs {target!r} "
        f"(the CUDA backend needs kernels for the GPU's arch; the torch backend runs any "
        f"engine); rebuild it: {fix}"
    )


def load_engine(
    engine_dir: str | Path,
    *,
    target: str | None = None,
    verify_checksums: bool = True,
    rank: int = 0,
) -> LoadedEngine:
    """Open and verify an engine directory (see module docstring for what is refused).

    ``target``: None or 'cpu' for the torch backend (runs any engine on CPU or CUDA), or
    the GPU arch ('sm_90') the CUDA backend will run on (the engine must be built for it).
    ``rank``: the tensor-parallel rank whose plan (and weights) the LoadedEngine holds;
    every rank's files are checked.
    """
    d = Path(engine_dir)
    if not d.is_dir():
        raise EngineError(
            f"engine directory {printable(repr(str(d)))} does not exist; build one with "
            f"`llmc build --checkpoint_dir MODEL --output_dir {printable(d)}`"
        )
    where = printable(d / MANIFEST)
    path = confined(d, MANIFEST, where)
    if path.exists() and not path.is_file():
        raise EngineError(f"{where} is not a regular file; refused")
    manifest = _read_json(path, MANIFEST)
    fmt, ver = manifest.get("format_version"), manifest.get("llmc_version")
    if fmt not in version.READABLE_FORMAT_VERSIONS or ver != version.__version__:
        raise EngineError(
            f"engine {printable(d)} has format version {printable(repr(fmt))} (llmc "
            f"{printable(ver)}), this llmc {version.__version__} reads format versions "
            f"{', '.join(map(str, version.READABLE_FORMAT_VERSIONS))}; rebuild it: "
            f"{rebuild_command(manifest, d)}"
        )
    files = checksum_table(d, manifest)
    spec, build, kernel_names = manifest_sections(manifest, where)
    fix = f"rebuild it: {rebuild_command(manifest, d)}"
    if fmt != version.ENGINE_FORMAT_VERSION and build.limits.kv_cache_dtype == "fp8":
        raise EngineError(
            f"engine {printable(d)} has format version {fmt}: its fp8 KV cache has no smooth-K "
            f"k_mean tensors (format {version.ENGINE_FORMAT_VERSION}); {fix}"
        )
    tp = build.tp_size
    try:
        check_tp(spec, tp, build.limits.quantization, build.limits.kv_cache_dtype)
        check_rank(tp, rank)
    except (ConfigError, UnsupportedError) as e:
        raise EngineError(f"{where}: build.tp_size: {printable(e)}; {fix}") from None
    section = manifest.get("tensor_parallel")
    if (section is not None or tp > 1) and section != tp_section(
        spec, tp, build.load_format != "dummy"
    ):
        raise EngineError(
            f"{where}: the tensor_parallel section is not the one of tp_size {tp} for this "
            f"model; {fix}"
        )
    required = [plan_file(tp, r) for r in range(tp)]
    if build.load_format != "dummy":
        required += [weights_file(tp, r) for r in range(tp)]
    check_files(d, files, required, kernel_names, verify_checksums=verify_checksums, fix=fix)
    plan_path = d / plan_file(tp, rank)
    plan = MemoryPlan.from_json(plan_path.read_bytes().decode("utf-8"))
    if plan.limits != build.limits:
        raise EngineError(
            f"{printable(plan_path)} was planned for {plan.limits}, the manifest's build is "
            f"{build.limits}; {fix}"
        )
    rspec = rank_spec(spec, tp)
    layouts = layouts_from_manifest(manifest, rspec.tensor_shapes(), where)
    q = build.limits.quantization
    if (q in WO_QUANTIZATIONS and not layouts) or (
        q not in (*WO_QUANTIZATIONS, GGUF_NATIVE) and layouts
    ):
        raise EngineError(
            f"{where}: quantization {build.limits.quantization!r} with {len(layouts)} packed "
            f"weight layouts; {fix}"
        )
    check_float_layers(rspec, build.limits, layouts, where)
    mismatch = plan_mismatch(plan, rspec, layouts)
    if mismatch is not None:
        raise EngineError(
            f"{printable(plan_path)} is not this llmc's memory plan for the engine: "
            f"{printable(mismatch)}; {fix}"
        )
    if target is not None:
        _check_target(manifest, d, build.target, target)
    tok = d / "tokenizer.json"
    return LoadedEngine(
        dir=d,
        manifest=manifest,
        spec=spec,
        build=build,
        plan=plan,
        tokenizer_path=tok if tok.is_file() else None,
        kernels_dir=d / KERNELS_DIR,
        layouts=layouts,
        rank=rank,
    )
