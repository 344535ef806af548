"""Launcher of the Hopper prefill attention (cuda/prefill_attention_sm90.cu, sm_90a only).

``Sm90Prefill.launch`` runs the prefill sequences of an attention batch (those after the
``num_decode_seqs`` decode rows) through ``prefill_sm90_kernel`` (KV cache in q's dtype) or
``prefill_sm90_fp8_kernel`` (float8_e4m3fn KV cache, real value = stored * k_scale /
v_scale). Grid (row tiles of 128 (token, head) rows, prefill sequences, kv heads), 384
threads, ``smem_bytes(head_dim, fp8)`` of dynamic shared memory (set as each kernel's limit on
first use, so an eager warm-up step does it before any graph capture).

Selection: ``CudaBackend.sm90_prefill`` (default: on for a compute-capability 9.0 device,
off when the environment sets ``LLMC_SM90_PREFILL=0``) and ``supports`` (16-bit q, head_dim
64 or 128, power-of-two tokens_per_block); anything else keeps prefill_attention.cu.
Invariant: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.launch_args import aligned as _aligned
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p

# One line turns the kernel off by default (the environment variable still can per run).
SM90_PREFILL_DEFAULT = True
ENV_SWITCH = "LLMC_SM90_PREFILL"  # "0" forces prefill_attention.cu
ROWS_PER_CTA = 128  # BM of the kernel: 2 consumer warpgroups x 64 (token, head) rows
KEYS_PER_TILE = 128  # BN
THREADS = 384  # producer + 2 consumer warpgroups
HEAD_DIMS = (64, 128)
_LOG2E = 1.4426950408889634


def stages(head_dim: int) -> int:
    """K/V ring depth of the kernel (its STAGES)."""
    return 2 if head_dim == 128 else 4


def smem_bytes(head_dim: int, fp8: bool = False) -> int:
    """Dynamic shared memory of one CTA: Q tile + STAGES K and V tiles (16-bit) + 1024 bytes
    of alignment slack, and for an fp8 cache the raw ring of 2 K + 2 V e4m3 tiles (the
    kernel traps when given less than it needs)."""
    tiles = (ROWS_PER_CTA + 2 * stages(head_dim) * KEYS_PER_TILE) * head_dim * 2
    return tiles + (4 * KEYS_PER_TILE * head_dim if fp8 else 0) + 1024


def enabled_by_default(capability: tuple[int, int]) -> bool:
    """Whether a backend on a device of ``capability`` uses the kernel unless told not to."""
    if os.environ.get(ENV_SWITCH, "").strip() == "0":
        return False
    return SM90_PREFILL_DEFAULT and tuple(capability) == (9, 0)


def supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the kernel serves q of ``dtype`` / ``head_dim`` over blocks of
    ``block_size`` tokens (a power of two)."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and head_dim in HEAD_DIMS
        and block_size > 0
        and block_size & (block_size - 1) == 0
    )


def causal_flops(q_lens: list[int], seq_lens: list[int], num_q_heads: int, head_dim: int) -> float:
    """Matmul FLOPs of causal prefill chunks (2 products x 2 FLOPs per multiply-add): query
    i of a chunk of q_len at seq_len attends seq_len - q_len + i + 1 keys."""
    keys = sum(ql * (sl - ql) + ql * (ql + 1) // 2 for ql, sl in zip(q_lens, seq_lens, strict=True))
    return 4.0 * num_q_heads * head_dim * keys


class Sm90Prefill:
    """The kernel launches of one CudaBackend (``backend`` provides ``_lib`` and
    ``_launch``)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._kernels: dict[tuple, Any] = {}  # with their dynamic shared memory limit raised

    def kernel(self, q_dtype: torch.dtype, hd: int, nq: int, nkv: int, fp8: bool) -> Any:
        key = (q_dtype, hd, nq, nkv, fp8)
        k = self._kernels.get(key)
        if k is None:
            lib = self.backend._lib(q_dtype, hd, nq, nkv)
            name = "prefill_sm90_fp8_kernel" if fp8 else "prefill_sm90_kernel"
            k = lib.get("prefill_sm90", name)
            k.max_dynamic_shared_size_bytes = smem_bytes(hd, fp8)
            self._kernels[key] = k
        return k

    def launch(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        out: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention of the prefill sequences of ``meta`` into ``out`` [T, nq * hd] (decode
        rows untouched). q [T, nq, hd] bf16/f16; caches [blocks, tokens_per_block, nkv, hd]
        in q's dtype or float8_e4m3fn (then scaled by ``k_scale`` / ``v_scale``)."""
        _need(q, "q")
        _need(out, "out", q.dtype)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            _need(c, name)
            if c.dtype not in (q.dtype, torch.float8_e4m3fn):
                raise UnsupportedError(
                    f"prefill_sm90: {name} must be {q.dtype} or float8_e4m3fn, got {c.dtype}"
                )
        if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape:
            raise UnsupportedError("prefill_sm90: k_cache and v_cache differ in dtype or shape")
        for name in ("cu_seqlens_q", "seq_lens", "block_tables"):
            _need(getattr(meta, name), name, torch.int32)
        t, nq, hd = q.shape
        nkv, bs = k_cache.shape[2], k_cache.shape[1]
        if not supports(q.dtype, hd, bs) or k_cache.shape[3] != hd or nq % nkv:
            raise UnsupportedError(
                f"prefill_sm90: no kernel for q {q.dtype} head_dim {hd}, heads {nq}/{nkv}, "
                f"tokens_per_block {bs} (needs 16-bit q, head_dim 64/128, power-of-two blocks)"
            )
        for name, v in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(v) and v > 0):
                raise UnsupportedError(f"prefill_sm90: {name} must be finite and > 0, got {v}")
        if not _aligned(q, k_cache, v_cache, out):
            raise UnsupportedError("prefill_sm90: tensors must be 16-byte aligned")
        b, nd = meta.seq_lens.shape[0], meta.num_decode_seqs
        if b <= nd or t <= nd:
            return out
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        kern = self.kernel(q.dtype, hd, nq, nkv, fp8)
        tiles = math.ceil(meta.max_query_len * (nq // nkv) / ROWS_PER_CTA)
        scale = _LOG2E / math.sqrt(hd) * (k_scale if fp8 else 1.0)
        args = (
            _p(q), _p(k_cache), _p(v_cache), _p(meta.block_tables),
            _i(meta.block_tables.shape[1]), _i(bs.bit_length() - 1), _p(meta.seq_lens),
            _p(meta.cu_seqlens_q), _i(nd), _p(out), np.float32(scale),
            np.float32(v_scale if fp8 else 1.0),
        )  # fmt: skip
        self.backend._launch(
            kern, (max(1, tiles), b - nd, nkv), (THREADS,), args, shared_mem=smem_bytes(hd, fp8)
        )
        return out
