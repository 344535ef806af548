"""EngineRuntime: an engine directory made runnable — weights on the device, a KV pool,
a ModelRunner on a Backend, a KVCacheManager and a Scheduler, plus the tokenizer.

Loading order (what ``EngineRuntime.load`` does):
1. resolve the device (``auto``: CUDA when torch sees a GPU, else CPU) and the backend
   (``auto``: the CUDA kernels when the device is a GPU and the engine was built for its arch
   with kernels, else the torch reference backend);
2. ``load_engine`` verifies the directory (checksums, versions, plan, target for the CUDA
   backend) and parses the manifest once: the runtime reads the ``LoadedEngine`` only; an
   engine with fp8 weights on a GPU below sm_89 is refused unless the run asks for the torch
   reference backend (``quantization.check_fp8_gpu``);
3. the engine's ``EngineLimits`` are lowered once by the run (``RuntimeConfig``'s
   ``max_batch_size``/``max_num_tokens``/``enable_chunked_prefill``; raising a limit is
   refused) and the run's workspace layout is taken from the memory plan
   (``compiler.memory_plan.run_workspace``: plan.json's offsets, or the same planner's for
   lowered limits);
4. weights go to the device, then the free memory is measured and the KV pool is sized with
   ``compiler.memory_plan.kv_cache_blocks`` (``kv_cache_free_gpu_mem_fraction`` of free memory
   after weights and the run's workspace, or ``max_kv_tokens``). On CPU, host RAM is shared
   with everything else, so without ``max_kv_tokens`` the pool is also capped at
   ``CPU_DEFAULT_KV_BYTES``; on every device it is capped at ``max_batch_size × max_seq_len``
   tokens (more could never be in use at once);
5. ModelRunner + KVCacheManager + Scheduler are built with that one ``EngineLimits``.

``EngineRuntime.from_weights`` builds the same from in-memory weights (tests, a checkpoint
driven without an engine directory).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.base.errors import ConfigError, UnsupportedError, did_you_mean
from llmc.compiler.limits import EngineLimits, check_positive_int
from llmc.compiler.memory_plan import PlannedBuffer
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.scheduler import GUARANTEED_NO_EVICT, POLICIES, Scheduler, SchedulerConfig
from llmc.runtime.tokenizer import Tokenizer

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "cuda")
DEFAULT_PREFILL_GRAPH_TOKENS = 512
"""Largest one-sequence prefill step replayed as a CUDA graph by default."""
MAX_DECODE_STEPS_PER_ITERATION = 64
"""Most decode steps of one multi-step window (its id buffer is K x max_batch_size)."""
CPU_DEFAULT_KV_BYTES = 1 << 30
"""KV pool cap on CPU when max_kv_tokens is not given (it is at least one max_seq_len)."""


@dataclass(frozen=True)
class RuntimeConfig:
    """Settings of one run of an engine (``llmc run`` / ``bench`` flags)."""

    device: str = "auto"
    backend: str = "auto"
    max_batch_size: int | None = None
    """Lower the engine's max_batch_size for this run (None: the engine's)."""
    max_num_tokens: int | None = None
    """Lower the engine's per-step token budget for this run (None: the engine's)."""
    kv_cache_free_gpu_mem_fraction: float = 0.9
    max_kv_tokens: int | None = None
    enable_block_reuse: bool = True
    scheduler_policy: str = GUARANTEED_NO_EVICT
    enable_chunked_prefill: bool | None = None
    """None: the engine's build setting."""
    cuda_graphs: bool = True
    """Replay CUDA graphs for decode-only steps (CUDA backend only; ``--no_cuda_graphs``)."""
    prefill_graph_max_tokens: int = DEFAULT_PREFILL_GRAPH_TOKENS
    """With ``cuda_graphs``: a step of one request's last prompt chunk of up to this many
    tokens replays a CUDA graph of its token-count bucket (``llmc.runtime.prefill_graphs``:
    an idle engine's time to first token); 0 = eager prefill only."""
    piecewise_graph_max_tokens: int = 0
    """With ``cuda_graphs``: the other steps (prefill batches, mixed prefill + decode) of up
    to this many tokens run their layers as captured pieces between eagerly launched
    attentions (``llmc.runtime.piecewise_graphs``); 0 = off (the default until measured on
    the GPU)."""
    async_scheduling: bool = True
    """Schedule and launch decode step N+1 while step N runs on the GPU (CUDA device only;
    CPU runs stay synchronous). See docs/RUNTIME.md."""
    decode_steps_per_iteration: int = 1
    """Multi-step decoding: decode steps run on the device per host iteration when every
    scheduled row decodes (``Scheduler.plan_window``); 1 = one step per iteration."""
    tp_timeout_s: float = 60.0
    """Tensor-parallel engines: seconds a collective (or the ranks' start) may wait for the
    other ranks before the run ends with an EngineError naming the rank."""

    def __post_init__(self) -> None:
        for name, allowed in (("device", DEVICES), ("backend", BACKENDS)):
            v = getattr(self, name)
            if v not in allowed:
                raise ConfigError(
                    f"{name} {v!r} is not one of {', '.join(allowed)}" + did_you_mean(v, allowed)
                )
        if self.scheduler_policy not in POLICIES:
            raise ConfigError(
                f"scheduler_policy {self.scheduler_policy!r} is not one of {', '.join(POLICIES)}"
                + did_you_mean(self.scheduler_policy, POLICIES)
            )
        for name in ("max_batch_size", "max_num_tokens", "max_kv_tokens"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        check_positive_int("decode_steps_per_iteration", self.decode_steps_per_iteration)
        for name in ("prefill_graph_max_tokens", "piecewise_graph_max_tokens"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {n!r}")
        if self.decode_steps_per_iteration > MAX_DECODE_STEPS_PER_ITERATION:
            raise ConfigError(
                f"decode_steps_per_iteration {self.decode_steps_per_iteration} is above "
                f"{MAX_DECODE_STEPS_PER_ITERATION}"
            )
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            raise ConfigError(
                "kv_cache_free_gpu_mem_fraction must be in (0, 1], got "
                f"{self.kv_cache_free_gpu_mem_fraction}"
            )
        if self.device == "cpu" and self.backend == "cuda":
            raise ConfigError("backend 'cuda' needs device cuda (or auto on a GPU machine)")
        if not self.tp_timeout_s > 0:
            raise ConfigError(f"tp_timeout_s must be positive, got {self.tp_timeout_s}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(
            "device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu"
        )
    return device


def _gpu_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _check_fp8_gpu(engine: Any) -> None:
    """fp8 weights on a GPU without FP8 tensor cores: refused naming it and the rebuild."""
    import torch

    from llmc.compiler.engine_format import rebuild_command
    from llmc.compiler.quantization import check_fp8_gpu

    if engine.limits.quantization != "fp8":
        return  # (nothing asked of the GPU otherwise)
    arch = _gpu_arch()
    fix = rebuild_command(engine.manifest, engine.dir, quantization="none", target=arch)
    check_fp8_gpu(engine.limits, torch.cuda.get_device_name(), arch, fix)


def _free_bytes(device: str, workspace_bytes: int) -> int:
    """Device memory free for the KV pool, after weights (already loaded) and workspace."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        try:  # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES does not
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
        except OSError:
            pass
    return max(0, int(free) - workspace_bytes)


def check_tp_config(config: RuntimeConfig, tp_size: int) -> None:
    """What a tensor-parallel run does not serve: multi-step decoding (its token feedback
    stays on rank 0's device), ConfigError naming it."""
    if config.decode_steps_per_iteration > 1:
        raise ConfigError(
            f"decode_steps_per_iteration {config.decode_steps_per_iteration} with an engine "
            f"of tp_size {tp_size} is not supported; use 1"
        )


class EngineRuntime:
    """Every component of a runnable engine; ``executor()`` drives them. The runner and
    the scheduler serve under the same ``EngineLimits`` (``limits``)."""

    def __init__(
        self,
        runner: Any,
        scheduler: Scheduler,
        tokenizer: Tokenizer | None,
        *,
        device: str,
        backend: str,
        engine: Any = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.spec = runner.spec
        self.kv: KVCacheManager = scheduler.kv
        self.limits: EngineLimits = scheduler.limits
        """The limits of this run (the engine's, lowered by the RuntimeConfig)."""
        self.device = device
        self.backend = backend
        self.engine = engine
        self.vocab_size = self.spec.vocab_size
        self.async_scheduling = False
        self.decode_steps_per_iteration = 1
        self.tp: Any = None
        """The TPRanks of a tensor-parallel run (``runtime/tp_launch.py``), else None."""

    # ---- construction --------------------------------------------------------------
    @classmethod
    def load(cls, engine_dir: str | Path, config: RuntimeConfig | None = None) -> EngineRuntime:
        """Load and verify an engine directory and build every runtime component. An engine
        with tp_size > 1 starts its other ranks (``runtime/tp_launch.py``: spawned on this
        host, or joined under torchrun); this process is rank 0. Under torchrun a process of
        another rank follows rank 0 here until the run ends, then exits (SystemExit 0)."""
        from llmc.compiler.engine_format import load_engine

        config = config or RuntimeConfig()
        device = resolve_device(config.device)
        engine = load_engine(engine_dir)
        if engine.tp_size == 1:
            return cls._load(engine, config, device)
        from llmc.runtime.tp_launch import start_ranks

        check_tp_config(config, engine.tp_size)
        ranks = start_ranks(str(engine.dir), engine.tp_size, config, device)
        try:
            if ranks.rank != 0:  # under torchrun: this process follows rank 0
                from llmc.runtime.tp_steps import follow

                # load_engine above checked every rank's files: not hashed a second time
                mine = load_engine(engine_dir, rank=ranks.rank, verify_checksums=False)
                rt = cls._load(mine, config, device, ranks)
                follow(rt.runner, ranks.group)
                raise SystemExit(0)
            return cls._load(engine, config, device, ranks)
        except BaseException:
            ranks.close(None)
            raise

    @classmethod
    def load_rank(cls, engine_dir: str | Path, config: RuntimeConfig, ranks: Any) -> EngineRuntime:
        """The runtime of rank ``ranks.rank`` (> 0) of a tensor-parallel engine: its shard,
        reducing through ``ranks.group``; driven by ``tp_steps.follow``."""
        from llmc.compiler.engine_format import load_engine

        engine = load_engine(engine_dir, rank=ranks.rank)
        return cls._load(engine, config, resolve_device(config.device), ranks)

    @classmethod
    def _load(
        cls, engine: Any, config: RuntimeConfig, device: str, ranks: Any = None
    ) -> EngineRuntime:
        """Every component of one rank of a loaded engine (``ranks``: its TPRanks, or None
        at tp_size 1). The ranks agree on the smallest KV pool any of them can hold."""
        from llmc.compiler.memory_plan import arena_bytes, kv_cache_blocks, run_workspace

        if device == "cuda" and config.backend != "torch":
            _check_fp8_gpu(engine)
        backend, target = cls._pick_backend(config.backend, device, engine)
        if target is not None:
            engine.check_target(target)
        limits = engine.limits.lowered(
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        spec = engine.rank_spec  # the engine's spec at tp_size 1
        workspace = run_workspace(spec, limits, engine.plan)
        weights = engine.load_weights(device)
        cap = limits.max_batch_size * limits.max_seq_len
        if device == "cpu" and config.max_kv_tokens is None:
            cpu_tokens = CPU_DEFAULT_KV_BYTES // engine.plan.kv_bytes_per_token
            cap = min(cap, max(cpu_tokens, limits.max_seq_len))
        max_kv = cap if config.max_kv_tokens is None else min(cap, config.max_kv_tokens)
        free = _free_bytes(device, arena_bytes(workspace))
        num_blocks = kv_cache_blocks(
            engine.plan, free, config.kv_cache_free_gpu_mem_fraction, max_kv
        )
        if ranks is not None:
            num_blocks = ranks.group.min_int(num_blocks)
        tokenizer = None
        if engine.tokenizer_path is not None:
            tokenizer = Tokenizer.from_dir(engine.tokenizer_path, engine.spec.eos_token_ids)
        return cls.from_weights(
            spec,
            weights,
            limits=limits,
            num_kv_blocks=num_blocks,
            tokenizer=tokenizer,
            device=device,
            backend=backend,
            config=config,
            engine=engine,
            workspace=workspace,
            layouts=engine.layouts,
            tp=ranks,
        )

    @staticmethod
    def _pick_backend(backend: str, device: str, engine: Any) -> tuple[str, str | None]:
        """(backend name, target the engine must be built for) for this device."""
        if device == "cpu":
            if backend == "cuda":
                raise ConfigError("backend 'cuda' needs a CUDA device; use --backend torch")
            return "torch", None
        arch = _gpu_arch()
        if backend == "torch":
            return "torch", None
        if backend == "cuda":
            return "cuda", arch
        if engine.build.target != arch or not engine.kernel_files:
            return "torch", None  # auto: the kernels when the engine has them for this GPU...
        try:
            import cupy  # noqa: F401  (...and CuPy is present)
        except Exception:
            return "torch", None
        return "cuda", arch

    @classmethod
    def from_weights(
        cls,
        spec: Any,
        weights: dict[str, Any],
        *,
        limits: EngineLimits,
        num_kv_blocks: int,
        tokenizer: Tokenizer | None = None,
        device: str = "cpu",
        backend: str = "torch",
        config: RuntimeConfig | None = None,
        engine: Any = None,
        workspace: tuple[PlannedBuffer, ...] | None = None,
        layouts: Any = None,
        tp: Any = None,
    ) -> EngineRuntime:
        """Build the runtime around engine-layout weights already in memory. ``workspace``:
        the arena layout (``PlannedBuffer``s; None: the memory planner's for ``limits``);
        ``layouts``: the weight-only packed tensors' (``LoadedEngine.layouts``); ``tp``: one
        tensor-parallel rank's TPRanks (``spec`` and ``weights`` the rank's): its runner
        all-reduces through the group, rank 0's sends every step (``StepLeader``), and
        steps run eagerly and synchronously (no CUDA graphs, no async scheduling)."""
        from llmc.runtime.model_runner import ModelRunner

        config = config or RuntimeConfig()
        eos = tuple(
            dict.fromkeys((*spec.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else ())))
        )
        kv = KVCacheManager(num_kv_blocks, limits.tokens_per_block, config.enable_block_reuse)
        scheduler = Scheduler(
            SchedulerConfig(limits, policy=config.scheduler_policy, eos_token_ids=eos), kv
        )
        be = cls._make_backend(backend, device, engine, limits.max_batch_size)
        runner = ModelRunner(
            spec,
            weights,
            backend=be,
            device=device,
            limits=limits,
            num_kv_blocks=num_kv_blocks,
            workspace=workspace,
            layouts=layouts,
            reduce=None if tp is None else tp.group.all_reduce,
        )
        steps = config.decode_steps_per_iteration
        if tp is not None:
            check_tp_config(config, tp.group.world_size)
            from llmc.runtime.tp_steps import StepLeader

            runner.leader = StepLeader(tp.group) if tp.rank == 0 else None
        elif config.cuda_graphs and backend == "cuda" and device == "cuda":
            runner.capture_cuda_graphs(
                decode_steps_per_iteration=steps,
                prefill_max_tokens=config.prefill_graph_max_tokens,
                piecewise_max_tokens=config.piecewise_graph_max_tokens,
            )
        rt = cls(runner, scheduler, tokenizer, device=device, backend=backend, engine=engine)
        overlap = tp is None and device == "cuda"  # steps may overlap the host's work
        rt.async_scheduling = config.async_scheduling and overlap  # Executor reads it
        rt.decode_steps_per_iteration = steps  # the Executor reads it too
        rt.tp = tp
        return rt

    def close(self) -> None:
        """End a tensor-parallel run: the other ranks are stopped (nothing at tp_size 1).
        Idempotent; the LLM calls it at shutdown."""
        tp, self.tp = self.tp, None
        if tp is not None:
            tp.close(getattr(self.runner, "leader", None))

    @staticmethod
    def _make_backend(backend: str, device: str, engine: Any, max_batch_size: int) -> Any:
        if backend == "cuda":
            from llmc.cuda.cuda_backend import CudaBackend

            kernels = engine.kernels_dir if engine is not None else None  # None: NVRTC
            return CudaBackend(device=device, kernels_dir=kernels, max_num_seqs=max_batch_size)
        from llmc.cuda.torch_backend import TorchBackend

        return TorchBackend(device)

    @property
    def built_limits(self) -> EngineLimits:
        """The engine's own limits, before this run lowered them (``limits`` without an
        engine directory)."""
        return self.engine.limits if self.engine is not None else self.limits

    # ---- use -----------------------------------------------------------------------
    def executor(self) -> Any:
        """A new Executor over this runtime (one at a time: they share the KV pool)."""
        from llmc.runtime.executor import Executor

        return Executor(self)

    def summary(self) -> dict[str, Any]:
        """What was loaded, for logs and --json."""
        kv = self.kv.stats()
        pre = getattr(self.runner, "prefill_graphs", None)
        return {
            "device": self.device,
            "backend": self.backend,
            "engine_dir": str(self.engine.dir) if self.engine is not None else None,
            **dataclasses.asdict(self.limits),
            "kv_blocks": kv.total_blocks,
            "kv_tokens": kv.total_blocks * kv.tokens_per_block,
            "enable_block_reuse": self.kv.enable_block_reuse,
            "scheduler_policy": self.scheduler.config.policy,
            "cuda_graphs": getattr(self.runner, "graphs", None) is not None,
            "prefill_graph_buckets": list(getattr(pre, "buckets", ())),
            "piecewise_graph_buckets": list(
                getattr(getattr(self.runner, "piecewise", None), "buckets", ())
            ),
            "async_scheduling": self.async_scheduling,
            "decode_steps_per_iteration": self.decode_steps_per_iteration,
            "tp_size": 1 if self.tp is None else self.tp.group.world_size,
        }
