"""The engine's memory plan: weights, one step's activation workspace, and the KV cache.

Owns three things, all pure arithmetic (no torch, so ``llmc build --dry_run`` stays fast):

1. **Workspace.** ``workspace_buffers`` is the one table of the workspace: every
   intermediate buffer of one forward step at ``T = max_num_tokens`` tokens and
   ``B = max_batch_size`` sequences (an ``EngineLimits``), with its shape, dtype and live
   range over the op sequence ``OPS`` (embed, one decoder layer's ops, final_norm,
   gather_last, lm_head, sample; every layer reuses the same buffers, so one layer stands for
   all). The buffers are packed into one arena by offset (``pack_buffers``). The build writes
   the packing into plan.json; the runtime allocates one arena and takes views at plan.json's
   offsets, or, when the run lowers the limits, at the offsets ``plan_workspace`` packs for
   them (``run_workspace`` picks). ``plan_mismatch`` is how ``load_engine`` refuses a plan.json
   that is not what this table and packer give. The buffer names are the runner's contract.
2. **Weights.** Bytes per engine tensor (``quantization.engine_tensors``: with fp8 weights
   the e4m3 projections at 1 byte per element plus their float32 scales; weight-only packed
   tensors, per the manifest's layouts, as their codes, scales and offsets) and in total.
   An fp8 engine's workspace adds its quantized activations (``_fp8_buffers``).
3. **KV cache.** Bytes per token and per block (1 byte per element for an fp8 cache); for a
   known device memory, the capacity in blocks, tokens and concurrent ``max_seq_len``
   requests, following TensorRT-LLM: the pool gets ``kv_cache_free_gpu_mem_fraction`` of the
   memory left free after weights and workspace (or an absolute ``max_kv_tokens``).
   ``kv_cache_blocks`` is what the runtime calls at load time with the free memory it
   measures.

Invariants (checked by tests/compiler/test_memory_plan.py): two buffers whose live ranges intersect
never overlap in the arena; every offset is a multiple of ``alignment``; the packed arena is
never larger than the naive one (every buffer in its own aligned slot).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from llmc.base.errors import CapacityError, ConfigError, EngineError, check_positive_ints
from llmc.base.text import printable
from llmc.compiler.limits import EngineLimits
from llmc.compiler.quantization import (
    ELEMENT_BYTES,
    FP8,
    Layouts,
    engine_tensor_bytes,
    kv_element_bytes,
)
from llmc.compiler.spec import ModelSpec

PLAN_FORMAT_VERSION = 2
"""2: the plan stores the EngineLimits it was made for (``limits``)."""
ALIGNMENT = 256
MAX_KV_SPLITS = 32
"""Split-KV (flash-decoding) partitions per sequence the attention workspace is sized for."""

LAYER_OPS = (
    "input_norm",
    "qkv_proj",
    "rope_kv_write",
    "attention",
    "o_proj",
    "post_attn_add_norm",
    "gate_up_proj",
    "silu_mul",
    "down_proj",
    "residual_add",
)
OPS = ("embed", *LAYER_OPS, "final_norm", "gather_last", "lm_head", "sample")
"""The op sequence liveness is computed over (one decoder layer stands for all layers)."""

DTYPE_BYTES = {**ELEMENT_BYTES, "int64": 8, "int32": 4}
GIB = 1 << 30


def _op(name: str) -> int:
    return OPS.index(name)


@dataclass(frozen=True)
class BufferSpec:
    """One workspace buffer before packing; live over ops ``first..last`` (inclusive)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    first: int
    last: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def overlaps_in_time(self, other: BufferSpec) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class PlannedBuffer(BufferSpec):
    """A packed buffer: bytes ``[offset, offset + nbytes)`` of the arena."""

    offset: int


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def arena_bytes(placed: tuple[PlannedBuffer, ...] | list[PlannedBuffer]) -> int:
    """Size of the arena that holds every placed buffer."""
    return max((p.offset + p.nbytes for p in placed), default=0)


def pack_buffers(
    buffers: list[BufferSpec] | tuple[BufferSpec, ...], alignment: int = ALIGNMENT
) -> tuple[tuple[PlannedBuffer, ...], int, int]:
    """Pack buffers into one arena; returns (placed buffers in input order, packed, naive).

    Greedy by size (largest first): each buffer goes to the lowest aligned offset where it
    does not overlap any already placed buffer whose live range intersects its own. Since
    the top of the placed buffers is always a valid spot, the arena never exceeds ``naive``
    (the sum of the sizes, each padded to ``alignment``).
    """
    names = [b.name for b in buffers]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate buffer names in {names}")
    order = sorted(range(len(buffers)), key=lambda i: (-buffers[i].nbytes, buffers[i].first, i))
    offsets: dict[int, int] = {}
    for i in order:
        b = buffers[i]
        busy = sorted(
            (offsets[j], offsets[j] + buffers[j].nbytes)
            for j in offsets
            if b.overlaps_in_time(buffers[j])
        )
        offset = 0
        for start, end in busy:
            if offset + b.nbytes <= start:
                break
            offset = max(offset, align_up(end, alignment))
        offsets[i] = offset
    placed = tuple(
        PlannedBuffer(b.name, tuple(b.shape), b.dtype, b.first, b.last, offsets[i])
        for i, b in enumerate(buffers)
    )
    packed = arena_bytes(placed)
    naive = sum(align_up(b.nbytes, alignment) for b in buffers)
    return placed, packed, naive


def workspace_buffers(spec: ModelSpec, limits: EngineLimits) -> list[BufferSpec]:
    """Every buffer of one forward step: THE table of the workspace (names, shapes, dtypes and
    live ranges); the build packs it into plan.json, a run packs it for its own limits."""
    t, b, h = limits.max_num_tokens, limits.max_batch_size, spec.hidden_size
    i, v, nq, hd = spec.intermediate_size, spec.vocab_size, spec.num_heads, spec.head_dim
    dtype = limits.dtype
    step = (0, len(OPS) - 1)
    max_blocks = limits.max_blocks_per_seq

    def buf(name: str, shape: tuple[int, ...], dt: str, first: str, last: str) -> BufferSpec:
        return BufferSpec(name, shape, dt, _op(first), _op(last))

    fp8 = limits.quantization == "fp8"
    # fp8 weights: the layers' norms write e4m3 rows (normed_fp8); only final_norm writes
    # normed, unless a projection kept in dtype (float_projections) reads it from its norm
    normed_from = "final_norm" if fp8 and not limits.float_projections else "input_norm"
    return [
        # Step inputs live the whole step.
        BufferSpec("input_ids", (t,), "int64", *step),
        BufferSpec("positions", (t,), "int64", *step),
        BufferSpec("slot_mapping", (t,), "int64", *step),
        BufferSpec("cu_seqlens_q", (b + 1,), "int32", *step),
        BufferSpec("seq_lens", (b,), "int32", *step),
        BufferSpec("block_tables", (b, max_blocks), "int32", *step),
        BufferSpec("logits_indices", (b,), "int64", *step),
        BufferSpec("sampled_ids", (b,), "int64", *step),
        # The hidden state carried across layers: written by embed, read by final_norm.
        buf("residual", (t, h), dtype, "embed", "final_norm"),
        # Written by input_norm, post_attn_add_norm and final_norm; last read by gather_last.
        buf("normed", (t, h), dtype, normed_from, "gather_last"),
        buf("qkv", (t, spec.qkv_size), dtype, "qkv_proj", "rope_kv_write"),
        buf("q", (t, nq * hd), dtype, "rope_kv_write", "attention"),
        buf("attn_partial_out", (b, nq, MAX_KV_SPLITS, hd), "float32", "attention", "attention"),
        buf("attn_partial_lse", (b, nq, MAX_KV_SPLITS), "float32", "attention", "attention"),
        buf("attn_out", (t, nq * hd), dtype, "attention", "o_proj"),
        # Written by o_proj (read by post_attn_add_norm) and by down_proj (read by residual_add).
        buf("proj_out", (t, h), dtype, "o_proj", "residual_add"),
        buf("gate_up", (t, 2 * i), dtype, "gate_up_proj", "silu_mul"),
        buf("act", (t, i), dtype, "silu_mul", "down_proj"),
        buf("last_hidden", (b, h), dtype, "gather_last", "lm_head"),
        buf("logits", (b, v), "float32", "lm_head", "sample"),
        *(_fp8_buffers(buf, t, h, i, nq * hd) if fp8 else ()),
    ]


def _fp8_buffers(
    buf: Callable[..., BufferSpec], t: int, h: int, i: int, q: int
) -> list[BufferSpec]:
    """An fp8 engine's quantized activations (``Fp8Rows``: e4m3 codes + a float32 scale per
    token): the norm outputs (qkv and gate_up inputs), the attention output (o_proj input,
    quantized by o_proj's op) and the SiLU·mul output (down input)."""
    rows = (
        ("normed_fp8", h, "input_norm", "gate_up_proj"),
        ("attn_out_fp8", q, "o_proj", "o_proj"),
        ("act_fp8", i, "silu_mul", "down_proj"),
    )
    out = []
    for name, k, first, last in rows:
        out.append(buf(name, (t, k), FP8, first, last))
        out.append(buf(name + "_scale", (t,), "float32", first, last))
    return out


def plan_workspace(spec: ModelSpec, limits: EngineLimits) -> tuple[PlannedBuffer, ...]:
    """The packed workspace of one step at ``limits`` (what plan.json holds for the build's)."""
    return pack_buffers(workspace_buffers(spec, limits))[0]


def run_workspace(
    spec: ModelSpec, limits: EngineLimits, plan: MemoryPlan | None
) -> tuple[PlannedBuffer, ...]:
    """The arena layout a run allocates: the engine's plan.json buffers when it was planned
    for the run's limits (``load_engine`` checked they are what this llmc plans), else the
    plan for the run's own (lowered) limits, by the same function as the build."""
    if plan is not None and plan.limits == limits:
        return plan.buffers
    return plan_workspace(spec, limits)


@dataclass(frozen=True)
class Capacity:
    """KV-cache capacity on one device (TensorRT-LLM's free-memory-fraction rule)."""

    device_memory_bytes: int
    memory_source: str
    """Where the number came from, e.g. 'detected free memory of cuda:0' or '--gpu_memory_gb'."""
    kv_cache_free_gpu_mem_fraction: float
    free_after_weights_bytes: int
    """device memory - weights - workspace (may be negative: the weights do not fit)."""
    kv_pool_bytes: int
    kv_blocks: int
    kv_tokens: int
    max_concurrent_requests: int
    """Requests of max_seq_len tokens that fit in the pool at once."""


@dataclass(frozen=True)
class MemoryPlan:
    """Everything the runtime needs to allocate memory for the engine once, at load."""

    limits: EngineLimits
    """The limits planned for (the engine's)."""
    buffers: tuple[PlannedBuffer, ...]
    workspace_bytes: int
    naive_workspace_bytes: int
    weight_bytes: dict[str, int]
    weight_bytes_total: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    capacity: Capacity | None = None
    max_kv_splits: int = MAX_KV_SPLITS
    alignment: int = ALIGNMENT
    ops: tuple[str, ...] = OPS
    version: int = PLAN_FORMAT_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def blocks_per_max_seq(self) -> int:
        """KV blocks of one request of max_seq_len tokens: ``max_beam_width`` sequences
        (its beams may share no block but the prompt's)."""
        return self.limits.max_blocks_per_seq * self.limits.max_beam_width

    @property
    def one_request(self) -> str:
        """How the capacity messages name that request."""
        w = self.limits.max_beam_width
        beams = f" x {w} beams (max_beam_width)" if w > 1 else ""
        return f"one request of max_seq_len={self.limits.max_seq_len} tokens{beams}"

    def buffer(self, name: str) -> PlannedBuffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"memory plan has no buffer {name!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["buffers"] = [
            {**asdict(b), "shape": list(b.shape), "nbytes": b.nbytes} for b in self.buffers
        ]
        d["ops"] = list(self.ops)
        d["notes"] = list(self.notes)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryPlan:
        if d.get("version") != PLAN_FORMAT_VERSION:
            raise EngineError(
                f"plan.json has format version {d.get('version')!r}, this llmc reads version "
                f"{PLAN_FORMAT_VERSION}; rebuild the engine with `llmc build`"
            )
        try:
            d = dict(d)
            d["limits"] = EngineLimits(**d["limits"])
            d["buffers"] = tuple(
                PlannedBuffer(**{**b, "shape": tuple(b["shape"])})
                for b in map(_stored, d["buffers"])
            )
            d["ops"] = tuple(d["ops"])
            d["notes"] = tuple(d.get("notes", ()))
            if d.get("capacity") is not None:
                d["capacity"] = Capacity(**d["capacity"])
            plan = cls(**d)
        except KeyError as e:
            raise EngineError(f"plan.json is malformed: missing key {e}") from None
        except (TypeError, ValueError, AttributeError, ConfigError) as e:
            raise EngineError(f"plan.json is malformed: {printable(e)}") from None
        # what the runtime divides by or allocates from: positive integers, named if not
        sizes = ("kv_bytes_per_token", "kv_bytes_per_block", "workspace_bytes", "alignment")
        check_positive_ints({k: getattr(plan, k) for k in sizes}, "plan.json", EngineError)
        return plan

    @classmethod
    def from_json(cls, text: str) -> MemoryPlan:
        try:
            d = json.loads(text)
        except ValueError as e:  # JSONDecodeError, or a number too long to convert
            raise EngineError(f"plan.json is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise EngineError("plan.json is not a JSON object")
        return cls.from_dict(d)


def _stored(b: dict[str, Any]) -> dict[str, Any]:
    """A plan.json buffer without its derived ``nbytes``."""
    return {k: v for k, v in b.items() if k != "nbytes"}


def plan_memory(
    spec: ModelSpec,
    limits: EngineLimits,
    *,
    device_memory_bytes: int | None = None,
    memory_source: str = "",
    kv_cache_free_gpu_mem_fraction: float = 0.9,
    check_fits: bool = True,
    layouts: Layouts | None = None,
) -> MemoryPlan:
    """Plan weights, workspace and KV cache; with a device memory, compute the capacity.

    With ``check_fits``, a device on which one request of ``max_seq_len`` tokens cannot fit
    raises CapacityError with the numbers and a suggested max_seq_len or memory size.
    """
    # fp8 codes and their scales, weight-only codes, scales and offsets (``layouts``) included
    weight_bytes = engine_tensor_bytes(spec, limits, layouts)
    placed, packed, naive = pack_buffers(workspace_buffers(spec, limits))
    kv_token = spec.kv_bytes_per_token(kv_element_bytes(limits))  # 1 byte per element for fp8
    plan = MemoryPlan(
        limits=limits,
        buffers=placed,
        workspace_bytes=packed,
        naive_workspace_bytes=naive,
        weight_bytes=weight_bytes,
        weight_bytes_total=sum(weight_bytes.values()),
        kv_bytes_per_token=kv_token,
        kv_bytes_per_block=kv_token * limits.tokens_per_block,
    )
    if device_memory_bytes is None:
        return plan
    cap = capacity(plan, device_memory_bytes, memory_source, kv_cache_free_gpu_mem_fraction)
    plan = dataclasses.replace(plan, capacity=cap)
    if check_fits and cap.kv_blocks < plan.blocks_per_max_seq:
        raise CapacityError(_does_not_fit(plan, cap))
    return plan


def plan_mismatch(plan: MemoryPlan, spec: ModelSpec, layouts: Layouts | None = None) -> str | None:
    """Where a loaded plan.json differs from what this llmc plans for its limits (None: it
    agrees). The runtime takes the arena offsets and the KV sizes from plan.json, so a plan
    made by another planner (an llmc checkout of the same version, or an edit) is refused at
    load rather than trusted; the capacity report and notes are the build's and not compared."""
    want = plan_memory(spec, plan.limits, layouts=layouts)
    if plan.buffers != want.buffers:
        got = {b.name: b for b in plan.buffers}
        for b in want.buffers:
            if got.get(b.name) != b:
                return (
                    f"workspace buffer {b.name!r} is {got.get(b.name)}, this llmc plans {b} "
                    f"for max_num_tokens={plan.limits.max_num_tokens}"
                )
        return f"workspace buffers {sorted(set(got) - {b.name for b in want.buffers})} are unknown"
    for f in dataclasses.fields(MemoryPlan):
        if f.name not in ("capacity", "notes") and getattr(plan, f.name) != getattr(want, f.name):
            return f"{f.name} is {getattr(plan, f.name)}, this llmc plans {getattr(want, f.name)}"
    return None


def capacity(
    plan: MemoryPlan, device_memory_bytes: int, memory_source: str, fraction: float
) -> Capacity:
    """KV capacity on a device with ``device_memory_bytes`` free before the engine loads."""
    free = device_memory_bytes - plan.weight_bytes_total - plan.workspace_bytes
    pool = max(0, int(free * fraction))
    blocks = pool // plan.kv_bytes_per_block
    return Capacity(
        device_memory_bytes=device_memory_bytes,
        memory_source=memory_source,
        kv_cache_free_gpu_mem_fraction=fraction,
        free_after_weights_bytes=free,
        kv_pool_bytes=pool,
        kv_blocks=blocks,
        kv_tokens=blocks * plan.limits.tokens_per_block,
        max_concurrent_requests=blocks // plan.blocks_per_max_seq,
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _does_not_fit(plan: MemoryPlan, cap: Capacity) -> str:
    need_kv = plan.blocks_per_max_seq * plan.kv_bytes_per_block
    need_mem = (
        plan.weight_bytes_total
        + plan.workspace_bytes
        + math.ceil(need_kv / cap.kv_cache_free_gpu_mem_fraction)
    )
    head = (
        f"{plan.one_request} does not fit: it needs "
        f"{plan.blocks_per_max_seq} KV blocks ({_gib(need_kv)} at "
        f"{plan.kv_bytes_per_token} bytes/token), but {_gib(cap.device_memory_bytes)} of device "
        f"memory ({cap.memory_source}) - weights {_gib(plan.weight_bytes_total)} - workspace "
        f"{_gib(plan.workspace_bytes)} leaves {_gib(max(cap.free_after_weights_bytes, 0))}, "
        f"x {cap.kv_cache_free_gpu_mem_fraction} = {cap.kv_blocks} blocks "
        f"({cap.kv_tokens} tokens)"
    )
    fixes = [f"--gpu_memory_gb {math.ceil(need_mem / GIB * 100) / 100}"]
    if plan.limits.max_num_tokens > plan.limits.tokens_per_block:
        fixes.append("a smaller --max_num_tokens (smaller workspace)")
    seq = _max_seq_len_fix(cap.kv_blocks, plan.limits)
    if seq.startswith("--"):
        return f"{head}; use {seq} or " + " or ".join(fixes)
    return f"{head}; use " + " or ".join(fixes) + f" ({seq})"


def _max_seq_len_fix(blocks: int, limits: EngineLimits) -> str:
    """The largest ``--max_seq_len`` a pool of ``blocks`` KV blocks holds, as a flag (with the
    ``--max_input_len`` it then needs), or the sentence that none does."""
    tokens = blocks * limits.tokens_per_block
    if tokens <= 0:
        return "no --max_seq_len fits: the pool holds no KV block"
    if tokens < limits.max_input_len:
        return f"--max_seq_len {tokens} --max_input_len {tokens}"
    return f"--max_seq_len {tokens}"


def kv_cache_blocks(
    plan: MemoryPlan, free_bytes: int, fraction: float, max_kv_tokens: int | None = None
) -> int:
    """Blocks of the KV pool the runtime allocates at load time (TensorRT-LLM's rule).

    ``free_bytes`` is the device memory free *after* the weights and workspace are allocated
    (the runtime measures it). The pool is ``fraction`` of it; with ``max_kv_tokens`` it is
    at most that many tokens (rounded up to whole blocks). Raises CapacityError when one
    request of ``max_seq_len`` tokens would not fit.
    """
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"kv_cache_free_gpu_mem_fraction must be in (0, 1], got {fraction}")
    tpb = plan.limits.tokens_per_block
    blocks = max(0, int(free_bytes * fraction)) // plan.kv_bytes_per_block
    if max_kv_tokens is not None:
        blocks = min(blocks, -(-max_kv_tokens // tpb))
    if blocks < plan.blocks_per_max_seq:
        limit = "" if max_kv_tokens is None else f", max_kv_tokens={max_kv_tokens}"
        fix = _max_seq_len_fix(blocks, plan.limits)
        raise CapacityError(
            f"KV cache of {blocks} blocks ({blocks * tpb} tokens; "
            f"{_gib(free_bytes)} free x {fraction}{limit}) cannot hold {plan.one_request} "
            f"({plan.blocks_per_max_seq} blocks of "
            f"{plan.kv_bytes_per_block} bytes); free more device memory or raise "
            f"kv_cache_free_gpu_mem_fraction or max_kv_tokens"
            + (f", or rebuild with {fix}" if fix.startswith("--") else f" ({fix})")
        )
    return blocks
