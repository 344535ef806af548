"""Sampling op of the CudaBackend (cuda/sampling.cu): kernel choice and launch.

Sampled rows run ``sample_cluster_kernel`` on sm_90+: a thread-block cluster of
``SAMPLE_CLUSTER`` CTAs per row, each keeping its slice of the row's values in shared
memory (``sample_slice`` floats; the kernel's dynamic shared-memory limit is set once, on
first use, so an eager warm-up step does it before any graph capture). Batches of greedy
rows only launch it without shared memory. Devices below sm_90, vocabularies whose slices
do not fit the shared-memory budget and batches past 65,535 rows run ``sample_kernel``
(one CTA per row, the logits re-read on every pass; the same tokens). Both write the same
token ids as ``llmc.cuda.reference.sample`` (its docstring states the rule); no scratch
memory.

``SamplingOps`` is a mixin: the class using it provides ``device``, ``max_num_seqs``,
``_lib(dtype)``, ``_launch(kernel, grid, block, args, shared_mem)``, ``_tokens`` (the
token buffer, possibly None), ``cluster_sampling`` (bool) and ``_sample_smem`` (bytes of
dynamic shared memory a CTA may opt in to) (CudaBackend does).
"""

from __future__ import annotations

from typing import Any

import torch

from llmc.cuda.backend import SamplingMetadata
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p

SAMPLE_CLUSTER = 8  # sample_cluster_kernel: CTAs per row (sampling.cu SAMPLE_CLUSTER)
SAMPLE_THREADS = 256  # sampling.cu's block (== its 256 radix bins)
_CHECKS = (
    ("temperature", torch.float32), ("top_k", torch.int32), ("top_p", torch.float32),
    ("min_p", torch.float32), ("seeds", torch.int64), ("offsets", torch.int64),
    ("repetition_penalty", torch.float32), ("presence_penalty", torch.float32),
    ("frequency_penalty", torch.float32),
)  # fmt: skip


def sample_slice(vocab: int) -> int:
    """Floats of a row that one CTA of sample_cluster_kernel keeps in shared memory
    (sampling.cu: ceil(vocab / SAMPLE_CLUSTER) rounded up to a multiple of 4)."""
    return (-(-vocab // SAMPLE_CLUSTER) + 3) // 4 * 4


MAX_GRID_Y = 65535  # the cluster kernel's rows are grid.y


def sample_plan(
    rows: int, vocab: int, all_greedy: bool, cluster: bool, smem_budget: int
) -> tuple[str, tuple[int, ...], int]:
    """(kernel name, grid, dynamic shared-memory bytes) of a launch over ``rows`` x
    ``vocab`` logits."""
    smem = 0 if all_greedy else 4 * sample_slice(vocab)  # greedy rows keep no slice
    if cluster and smem <= smem_budget and rows <= MAX_GRID_Y:
        return "sample_cluster_kernel", (SAMPLE_CLUSTER, rows), smem
    return "sample_kernel", (rows,), 0


class SamplingOps:
    """``sample`` on sampling.cu (mixin; see the module docstring)."""

    device: torch.device
    max_num_seqs: int
    cluster_sampling: bool
    _sample_smem: int
    _tokens: torch.Tensor | None
    _sample_kernels: dict[str, Any]

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Token ids [S] int64: a view of a buffer the next call overwrites."""
        _need(logits, "logits", torch.float32)
        s, v = logits.shape
        if self._tokens is None or self._tokens.numel() < s:
            self._tokens = torch.empty(
                max(s, self.max_num_seqs), dtype=torch.int64, device=self.device
            )
        out = self._tokens[:s]
        if s == 0:
            return out
        for name, dt in _CHECKS:
            _need(getattr(meta, name), name, dt)
        has_pen = meta.output_counts is not None
        if has_pen:
            _need(meta.output_counts, "output_counts", torch.int32)
            _need(meta.prompt_mask, "prompt_mask", torch.bool)
        counts = meta.output_counts if has_pen else logits
        pmask = meta.prompt_mask if has_pen else logits
        args = (
            _p(logits), _i(v), _p(meta.temperature), _p(meta.top_k), _p(meta.top_p),
            _p(meta.min_p), _p(meta.seeds), _p(meta.offsets), _p(meta.repetition_penalty),
            _p(meta.presence_penalty), _p(meta.frequency_penalty), _p(counts), _p(pmask),
            _i(has_pen), _i(meta.all_greedy), _p(out),
        )  # fmt: skip
        name, grid, smem = sample_plan(
            s, v, meta.all_greedy, self.cluster_sampling, self._sample_smem
        )
        k = self._sample_kernels.get(name)
        if k is None:
            k = self._lib(torch.float32).get("sampling", name)
            if name == "sample_cluster_kernel":
                k.max_dynamic_shared_size_bytes = self._sample_smem
            self._sample_kernels[name] = k
        self._launch(k, grid, (SAMPLE_THREADS,), args, shared_mem=smem)
        return out
