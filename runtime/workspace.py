"""The static memory of one step: the workspace arena and the host→device staging buffer.

``Workspace`` allocates ONE uint8 arena and takes a typed view per buffer at the offsets of
the engine's memory plan (``{name: (offset_bytes, shape, dtype)}``, see
``llmc.compiler.memory_plan``). It refuses (EngineError) a table that lacks a buffer, has
a wrong shape or dtype, a misaligned or out-of-range offset, or lets two buffers share bytes
while the ModelRunner's op sequence needs both at once (``RUNNER_LIVE_RANGES``); so a plan
whose liveness disagrees with the runner can never corrupt a step silently.

``Staging`` packs a step's host-side inputs into one (pinned, on CUDA) byte buffer so that
they reach the device in ONE host→device copy; typed device views are returned per section.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from llmc.base.errors import EngineError
from llmc.compiler.memory_plan import OPS
from llmc.compiler.spec import ModelSpec

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}

WorkspaceTable = Mapping[str, tuple[int, Sequence[int], str]]

# The runner's op sequence is the planner's (one decoder layer stands for all; the residual
# add of a layer's MLP output is fused with the next layer's input norm, which reads/writes
# only residual, proj_out and normed, all live across that boundary).
RUNNER_OPS = OPS
_STEP = ("embed", "sample")
RUNNER_LIVE_RANGES: dict[str, tuple[str, str]] = {
    **{
        name: _STEP
        for name in (
            "input_ids",
            "positions",
            "slot_mapping",
            "cu_seqlens_q",
            "seq_lens",
            "block_tables",
            "logits_indices",
            "sampled_ids",
        )
    },
    "residual": ("embed", "final_norm"),
    "normed": ("input_norm", "gather_last"),
    "qkv": ("qkv_proj", "rope_kv_write"),
    "q": ("rope_kv_write", "attention"),
    "attn_partial_out": ("attention", "attention"),
    "attn_partial_lse": ("attention", "attention"),
    "attn_out": ("attention", "o_proj"),
    "proj_out": ("o_proj", "residual_add"),
    "gate_up": ("gate_up_proj", "silu_mul"),
    "act": ("silu_mul", "down_proj"),
    "last_hidden": ("gather_last", "lm_head"),
    "logits": ("lm_head", "sample"),
}


def expected_shapes(
    spec: ModelSpec,
    dtype: str,
    max_num_tokens: int,
    max_batch_size: int,
    max_seq_len: int,
    tokens_per_block: int,
) -> dict[str, tuple[tuple[int, ...] | None, str]]:
    """name → (shape, dtype) the runner needs; shape None = any (backend-private buffers)."""
    t, b, h = max_num_tokens, max_batch_size, spec.hidden_size
    qd = spec.num_heads * spec.head_dim
    blocks = -(-max_seq_len // tokens_per_block)
    return {
        "input_ids": ((t,), "int64"),
        "positions": ((t,), "int64"),
        "slot_mapping": ((t,), "int64"),
        "cu_seqlens_q": ((b + 1,), "int32"),
        "seq_lens": ((b,), "int32"),
        "block_tables": ((b, blocks), "int32"),
        "logits_indices": ((b,), "int64"),
        "sampled_ids": ((b,), "int64"),
        "residual": ((t, h), dtype),
        "normed": ((t, h), dtype),
        "qkv": ((t, spec.qkv_size), dtype),
        "q": ((t, qd), dtype),
        "attn_out": ((t, qd), dtype),
        "proj_out": ((t, h), dtype),
        "gate_up": ((t, 2 * spec.intermediate_size), dtype),
        "act": ((t, spec.intermediate_size), dtype),
        "last_hidden": ((b, h), dtype),
        "logits": ((b, spec.vocab_size), "float32"),
        "attn_partial_out": (None, "float32"),
        "attn_partial_lse": (None, "float32"),
    }


def default_table(
    spec: ModelSpec,
    dtype: str,
    max_num_tokens: int,
    max_batch_size: int,
    max_seq_len: int,
    tokens_per_block: int,
) -> dict[str, tuple[int, tuple[int, ...], str]]:
    """The table an engine's plan would hold for these limits (the compiler's own packer)."""
    from llmc.compiler.memory_plan import pack_buffers, workspace_buffers

    specs = workspace_buffers(
        spec, max_num_tokens, max_batch_size, max_seq_len, tokens_per_block, dtype
    )
    placed, _, _ = pack_buffers(specs)
    return {p.name: (p.offset, tuple(p.shape), p.dtype) for p in placed}


def table_from_plan(plan) -> dict[str, tuple[int, tuple[int, ...], str]]:
    """The workspace table of a ``llmc.compiler.memory_plan.MemoryPlan`` (plan.json)."""
    return {b.name: (b.offset, tuple(b.shape), b.dtype) for b in plan.buffers}


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * TORCH_DTYPES[dtype].itemsize


def _fits(name: str, got: tuple[int, ...], need: tuple[int, ...]) -> bool:
    """A plan buffer serves the runner if its leading (token / sequence) dimension is at least
    the runner's and its other dimensions are equal (block_tables: both may be larger; the
    runner uses its flat storage). So an engine's arena also serves lowered runtime limits."""
    if len(got) != len(need) or got[0] < need[0]:
        return False
    if name == "block_tables":
        return got[1] >= need[1]
    return got[1:] == need[1:]


def check_table(table: WorkspaceTable, expected: Mapping[str, tuple[tuple | None, str]]) -> None:
    """Raise EngineError unless ``table`` gives the runner every buffer it needs, safely."""
    for name, (shape, dtype) in expected.items():
        if name not in table:
            raise EngineError(f"memory plan: workspace buffer {name!r} is missing")
        off, got_shape, got_dtype = table[name]
        if got_dtype != dtype:
            raise EngineError(f"memory plan: buffer {name!r} has dtype {got_dtype}, need {dtype}")
        if shape is not None and not _fits(name, tuple(got_shape), shape):
            raise EngineError(
                f"memory plan: buffer {name!r} has shape {list(got_shape)}, need {list(shape)} "
                "(token/sequence dimensions may be larger); rebuild the engine with `llmc build`"
            )
        if got_dtype not in TORCH_DTYPES:
            raise EngineError(f"memory plan: buffer {name!r} has unknown dtype {got_dtype!r}")
        size = TORCH_DTYPES[got_dtype].itemsize
        if off < 0 or off % size:
            raise EngineError(f"memory plan: buffer {name!r} offset {off} is not aligned")
    names = [n for n in expected if n in RUNNER_LIVE_RANGES]
    spans = {n: (table[n][0], table[n][0] + _nbytes(table[n][1], table[n][2])) for n in names}
    live = {n: tuple(RUNNER_OPS.index(o) for o in RUNNER_LIVE_RANGES[n]) for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            bytes_overlap = spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
            time_overlap = live[a][0] <= live[b][1] and live[b][0] <= live[a][1]
            if bytes_overlap and time_overlap and spans[a][0] < spans[a][1]:
                raise EngineError(
                    f"memory plan: buffers {a!r} and {b!r} share arena bytes but the runner "
                    "needs both at once; rebuild the engine with this llmc version"
                )


class Workspace:
    """One uint8 arena on ``device`` and a typed view per buffer of ``table``."""

    def __init__(self, table: WorkspaceTable, device: torch.device) -> None:
        total = max((off + _nbytes(shape, dt) for off, shape, dt in table.values()), default=0)
        self.nbytes = total
        self.arena = torch.empty(total, dtype=torch.uint8, device=device)
        self.buffers: dict[str, torch.Tensor] = {}
        for name, (off, shape, dt) in table.items():
            n = _nbytes(shape, dt)
            view = self.arena[off : off + n].view(TORCH_DTYPES[dt]).view(tuple(shape))
            self.buffers[name] = view

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]


class Staging:
    """Host byte buffers (pinned on CUDA) + one device mirror: a step's inputs in one copy.

    Usage per step: ``begin()``, ``add(name, values, dtype)`` per section, then
    ``upload()`` → {name: device tensor}. Sections are 8-byte aligned and packed in the
    order added; only the used prefix is copied. On CUDA there are two host buffers used in
    turn, so a step can be staged while the previous step's copy may still be in flight;
    ``begin()`` waits for the copy that last read the buffer it reuses (a CUDA event). The
    device mirror is the same for every step (CUDA graphs read fixed addresses); a later
    step's copy into it is ordered after the earlier step's kernels by the stream. On CPU
    the host buffer is the "device" buffer and everything is synchronous.
    """

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.device = device
        self.capacity = capacity_bytes
        cuda = device.type == "cuda"
        self._hosts = [
            torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=cuda)
            for _ in range(2 if cuda else 1)
        ]
        self._nps = [h.numpy() for h in self._hosts]
        self._events: list[Any] = [None] * len(self._hosts)
        self._turn = 0
        self.host = self._hosts[0]
        self._np = self._nps[0]
        self.dev = self.host if not cuda else torch.empty_like(self.host, device=device)
        self._sections: list[tuple[str, int, int, torch.dtype]] = []
        self._used = 0
        self._viewed: list[tuple[str, int, int, torch.dtype]] | None = None
        self._views: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        if len(self._hosts) > 1:
            self._turn ^= 1
            event = self._events[self._turn]
            if event is not None:
                event.synchronize()  # the copy that last read this host buffer is done
            self.host, self._np = self._hosts[self._turn], self._nps[self._turn]
        self._sections = []
        self._used = 0

    def add(self, name: str, values: Sequence | np.ndarray, dtype: str) -> None:
        self.reserve(name, len(values), dtype)[:] = values

    def reserve(self, name: str, n: int, dtype: str) -> np.ndarray:
        """Add a section of ``n`` values and return its host view, to be filled in place
        before ``upload()`` (``add`` is ``reserve`` + assignment)."""
        np_dtype = np.dtype(dtype)
        nbytes = n * np_dtype.itemsize
        off = -(-self._used // 8) * 8
        if off + nbytes > self.capacity:
            raise EngineError(f"step staging overflow at {name!r} ({off + nbytes} bytes)")
        self._sections.append((name, off, n, TORCH_DTYPES[dtype]))
        self._used = off + nbytes
        return self._np[off : off + nbytes].view(np_dtype)

    def upload(self) -> dict[str, torch.Tensor]:
        if self.dev is not self.host and self._used:
            self.dev[: self._used].copy_(self.host[: self._used], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        if self._sections != self._viewed:  # the same layout as last step: the same views
            self._viewed = list(self._sections)
            self._views = {
                name: self.dev[off : off + n * dt.itemsize].view(dt)
                for name, off, n, dt in self._sections
            }
        return dict(self._views)
