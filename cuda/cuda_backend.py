"""CudaBackend: the Backend protocol on llmc's CuPy RawKernels plus cuBLAS matmuls.

Every kernel is launched on torch's *current* stream (``cupy.cuda.ExternalStream`` over
``torch.cuda.current_stream().cuda_stream``), so torch and CuPy work interleave in order
and a step can be captured in a CUDA graph. Tensors are passed by ``data_ptr``; results go
into the caller's ``out=`` workspace views. Launches never allocate, synchronise or read
device values on the host. The only device memory the backend owns is the flash-decoding
partials buffer, its per-(token, kv head) arrival counters (zero between launches: the
last split of a sequence resets its counter) and the sampled-token buffer, allocated by
``reserve`` (called lazily on first use: call it, or run one eager step, before capturing
graphs).

Decode attention is ONE kernel per call: the launch's grid has up to ``num_splits`` splits
per sequence (from the batch size: enough CTAs for the chip), and each sequence uses
``ceil(context / min_split_keys)`` of them, decided on the device from its own context, so
a graph captured for the longest context still runs short contexts unsplit.

Kernel constants (dtype, head_dim, query / kv heads) are read from the tensors of each
call; kernels of each config come from the engine's ``kernels/`` cubins when present, else
the kernel cache or NVRTC (``llmc.cuda.kernel_library.KernelLibrary``). Matrix products are
torch.mm/addmm.

Small-step fusions (``norm_linear``, ``norm_gate_up_silu``, ``linear_residual_add``;
cuda/gemv.cu, launched by ``llmc.cuda.gemv_ops.GemvOps``) serve steps of at most
``fused_decode_max_tokens`` (<= 8) tokens. Weight-only ``PackedWeight``s (int8_wo, int4_wo,
GGUF blocks) are dispatched on their type to ``llmc.cuda.gemv_wo_ops.WoOps`` (the three
fused ops, ``linear``, ``embedding``).

KV cache: the activation dtype, or float8_e4m3fn codes with one k and one v scale per layer
(``kv_cache_dtype fp8``): rope_kv_fp8_kernel writes ``sat(k / k_scale)``, the *_fp8
attention kernels read codes and fold the scales in (llmc.cuda.reference.to_cache /
from_cache). FP8 activations and GEMMs: ``llmc.cuda.fp8_ops.Fp8Ops``.

Limits of the current kernels: contiguous tensors with 16-byte-aligned bases for the
vector paths (unaligned views raise), q/k/v of one dtype, cos/sin float32.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from llmc.base.errors import UnsupportedError
from llmc.cuda.backend import AttentionMetadata, check_fused_decode_max_tokens
from llmc.cuda.fp8_ops import Fp8Ops
from llmc.cuda.gemv_fp8_ops import GemvFp8Ops
from llmc.cuda.gemv_ops import FUSED_DECODE_DEFAULT, GEMV_MAX_TOKENS, GEMV_SMEM_BYTES, GemvOps
from llmc.cuda.gemv_wo_ops import WoOps
from llmc.cuda.kernel_library import KernelLibrary
from llmc.cuda.kernels import KernelConfig
from llmc.cuda.launch_args import aligned as _aligned
from llmc.cuda.launch_args import i32 as _i
from llmc.cuda.launch_args import need as _need
from llmc.cuda.launch_args import ptr as _p
from llmc.cuda.launch_args import rms_block
from llmc.cuda.pdl_launch import PdlOps, pdl_modes
from llmc.cuda.prefill_sm90_ops import Sm90Prefill, enabled_by_default, supports
from llmc.cuda.reference_fp8 import FP8_DTYPE, Fp8Rows
from llmc.cuda.reference_wo import PackedWeight
from llmc.cuda.sampling_ops import SamplingOps

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
LOG2E = 1.4426950408889634
MAX_SPLITS = 32
SPLIT_ROWS_PER_SEQ = 8  # partials budget: max_num_seqs * 8 (token, split) rows
CTAS_PER_SM = 4  # most resident split-kernel CTAs per SM (CUDA-core pass: (128, 4) bounds)
CLUSTER_SPLITS = 8  # paged_attention_cluster_kernel: CTAs per (token, kv head) (CSPLIT)


def _kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, k_scale: Any, v_scale: Any
) -> bool:
    """Check the layer's KV cache against the activation dtype; True when it holds e4m3
    codes (the *_fp8 kernels). Scales: positive finite floats for an fp8 cache; the
    16/32-bit cache kernels store values as they are, so there they must be 1."""
    fp8 = k_cache.dtype == FP8_DTYPE
    _need(k_cache, "k_cache", FP8_DTYPE if fp8 else dtype)
    _need(v_cache, "v_cache", k_cache.dtype)
    for name, v in (("k_scale", k_scale), ("v_scale", v_scale)):
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        if not ok or not (math.isfinite(v) and v > 0):
            raise UnsupportedError(
                f"CudaBackend: {name} of the KV cache must be a positive finite number, got {v!r}"
            )
    if not fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise UnsupportedError(
            f"CudaBackend: KV scales {k_scale}, {v_scale} apply to an fp8 KV cache only"
        )
    return fp8


class CudaBackend(WoOps, GemvOps, GemvFp8Ops, Fp8Ops, SamplingOps, PdlOps):
    """Backend on CuPy kernels. ``kernels_dir``: an engine's cubins (None = NVRTC).

    ``fused_decode_max_tokens`` (0..8, default 4; 0 = off): the ModelRunner runs steps of
    at most this many tokens through the fused gemv ops.
    """

    name = "cuda"

    def __init__(
        self,
        device: torch.device | str = "cuda",
        kernels_dir: Any = None,
        max_num_seqs: int = 256,
        fused_decode_max_tokens: int = FUSED_DECODE_DEFAULT,
    ) -> None:
        self.fused_decode_max_tokens = check_fused_decode_max_tokens(
            fused_decode_max_tokens, "CudaBackend", GEMV_MAX_TOKENS
        )
        import cupy

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise UnsupportedError(f"CudaBackend needs a CUDA device, got {device!r}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.kernels_dir = kernels_dir
        self.max_num_seqs = max_num_seqs
        self._cp = cupy
        self._cp_device = cupy.cuda.Device(self.device.index)
        self._libs: dict[KernelConfig, KernelLibrary] = {}
        self._streams: dict[int, Any] = {}
        props = torch.cuda.get_device_properties(self.device)
        self._sm_count = props.multi_processor_count
        # gemv staging budget: what the device lends one block (227 KB on sm_90), less the
        # kernels' < 5 KB of static shared memory
        optin = getattr(props, "shared_memory_per_block_optin", GEMV_SMEM_BYTES + 8192)
        self._gemv_smem = min(GEMV_SMEM_BYTES, (optin - 8192) // 1024 * 1024)
        self._part_acc: torch.Tensor | None = None
        self._part_ml: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._gemv_kernels: dict[tuple[torch.dtype, str], Any] = {}
        self._occupancy: dict[int, int] = {}  # id(kernel) -> resident CTAs per SM
        self._zero_means: dict[tuple[int, int], torch.Tensor] = {}  # fp8 KV without k_mean
        # dequantize-then-cuBLAS's side stream (llmc.cuda.wo_dequant_ops), made here: never
        # first during a graph capture
        self._wo_side = torch.cuda.Stream(self.device)
        # small decode batches: split over a thread-block cluster (sm_90+; see attention)
        self.cluster_decode = torch.cuda.get_device_capability(self.device)[0] >= 9
        self.force_splits: int | None = None  # benchmark override of num_splits
        self.force_min_keys: int | None = None  # benchmark override of min_split_keys
        # prefill rows on prefill_attention_sm90.cu (sm_90; False or LLMC_SM90_PREFILL=0:
        # prefill_attention.cu; see llmc.cuda.prefill_sm90_ops)
        self.sm90_prefill = enabled_by_default(torch.cuda.get_device_capability(self.device))
        # sampling: a cluster of SAMPLE_CLUSTER CTAs per row, its slices in shared memory
        # (sm_90+, slices within the opt-in budget less the kernel's < 8 KB static shared
        # memory); else sample_kernel, one CTA per row
        self.cluster_sampling = self.cluster_decode
        self._sample_smem = optin - 8192
        self._sample_kernels: dict[str, Any] = {}
        self._sm90 = Sm90Prefill(self)
        # programmatic dependent launch of the small steps' GEMVs (pdl) and rope_kv + decode
        # attention (pdl_attention); sm_90+, LLMC_PDL=0: off (llmc.cuda.pdl_launch)
        self.pdl, self.pdl_attention = pdl_modes(torch.cuda.get_device_capability(self.device))

    # ---- plumbing ------------------------------------------------------------------
    def _lib(self, dtype: torch.dtype, hd: int = 2, nq: int = 1, nkv: int = 1) -> KernelLibrary:
        if dtype not in _DTYPES:
            raise UnsupportedError(f"CudaBackend: dtype {dtype} is not supported")
        cfg = KernelConfig(_DTYPES[dtype], hd, nq, nkv)
        lib = self._libs.get(cfg)
        if lib is None:
            lib = self._libs[cfg] = KernelLibrary(cfg, self.kernels_dir)
        return lib

    def _zero_k_mean(self, nkv: int, hd: int) -> torch.Tensor:
        """A persistent zero k_mean (graph-safe: allocated once per shape, outside steps)."""
        z = self._zero_means.get((nkv, hd))
        if z is None:
            z = self._zero_means[nkv, hd] = torch.zeros(
                nkv, hd, dtype=torch.float32, device=self.device
            )
        return z

    def _launch(
        self,
        kernel: Any,
        grid: tuple,
        block: tuple,
        args: tuple,
        shared_mem: int = 0,
        pdl: bool = False,
    ) -> None:
        """Launch on torch's current stream; ``pdl``: as a programmatic dependent launch
        (only kernels that call cuda/pdl.cuh's ``pdl_wait()`` first; when ``self.pdl``)."""
        ptr = torch.cuda.current_stream(self.device).cuda_stream
        launcher = self._pdl_ready() if pdl and self.pdl else None
        if launcher is not None:
            with self._cp_device:
                launcher(kernel, grid, block, args, shared_mem, ptr)
            return
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self._cp.cuda.ExternalStream(ptr, self.device.index)
        with self._cp_device, stream:
            kernel(grid, block, args, shared_mem=shared_mem)

    def reserve(self, max_num_seqs: int, num_q_heads: int, head_dim: int, vocab_rows: int = 0):
        """Allocate the decode partials and token buffers (before any graph capture)."""
        rows = max_num_seqs * SPLIT_ROWS_PER_SEQ * num_q_heads
        # each buffer by its own size: a later call with more rows of a smaller head_dim
        # needs a larger _part_ml and _counters under an _part_acc that is large enough
        if self._part_acc is None or self._part_acc.numel() < rows * head_dim:
            self._part_acc = torch.empty(rows * head_dim, dtype=torch.float32, device=self.device)
        if self._part_ml is None or self._part_ml.numel() < rows * 2:
            self._part_ml = torch.empty(rows * 2, dtype=torch.float32, device=self.device)
        if self._counters is None or self._counters.numel() < rows:
            # one counter per (decode token, kv head); num_kv_heads <= num_q_heads
            self._counters = torch.zeros(rows, dtype=torch.int32, device=self.device)
        n = max(max_num_seqs, vocab_rows)
        if self._tokens is None or self._tokens.numel() < n:
            self._tokens = torch.empty(n, dtype=torch.int64, device=self.device)

    # ---- ops -----------------------------------------------------------------------
    def embedding(
        self, ids: torch.Tensor, table: torch.Tensor | PackedWeight, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if isinstance(table, PackedWeight):  # weight-only table: llmc.cuda.gemv_wo_ops
            return self.embedding_wo(ids, table, out)
        _need(ids, "ids", torch.int64)
        _need(table, "embedding table")
        t, h = ids.shape[0], table.shape[1]
        if out is None:
            out = torch.empty(t, h, dtype=table.dtype, device=self.device)
        if t == 0:
            return out
        vec_ok = (h * table.element_size()) % 16 == 0 and _aligned(table, out)
        k = self._lib(table.dtype).get("embedding", "embedding_kernel")
        args = (_p(ids), _p(table), _p(out), _i(t), _i(h), np.int64(table.shape[0]), _i(vec_ok))
        self._launch(k, (min(t, 65535),), (128,), args)
        return out

    def _rms(self, x, residual, weight, eps, out, q8: Fp8Rows | None = None) -> Any:
        """RMSNorm (+ residual add) of x into ``out``, or into e4m3 rows ``q8`` (then the
        fp8 kernel: the same launch, so the same float32 sums and normed values)."""
        _need(x, "x")
        _need(weight, "norm weight", x.dtype)
        t, h = x.shape
        if q8 is None and out is None:
            out = torch.empty_like(x)
        dst = out if q8 is None else q8.q
        if t == 0:
            return dst if q8 is None else q8
        vec = 16 // x.element_size()
        ts = (x, weight, dst) + ((residual,) if residual is not None else ())
        vec_ok = h % vec == 0 and _aligned(*ts)
        block = rms_block(h, vec, vec_ok)
        res = residual if residual is not None else x
        head = (_p(x), _p(res), _p(weight))
        tail = (_i(t), _i(h), np.float32(eps), _i(residual is not None), _i(vec_ok))
        if q8 is None:
            k = self._lib(x.dtype).get("rmsnorm", "rms_norm_kernel")
            self._launch(k, (min(t, 65535),), (block,), head + (_p(out),) + tail)
            return out
        k = self._lib(x.dtype).get("rmsnorm", "rms_norm_fp8_kernel")
        self._launch(k, (min(t, 65535),), (block,), head + (_p(q8.q), _p(q8.scale)) + tail)
        return q8

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._rms(x, None, weight, eps, out)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _need(residual, "residual", x.dtype)
        return self._rms(x, residual, weight, eps, out), residual

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(weight, PackedWeight):  # weight-only: llmc.cuda.gemv_wo_ops
            return self.linear_wo(x, weight, bias, out)
        if out is None:
            return torch.nn.functional.linear(x, weight, bias)
        if out.dtype != x.dtype:  # e.g. float32 logits from 16-bit weights
            out.copy_(torch.nn.functional.linear(x, weight, bias))
            return out
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)

    def rope_and_cache_write(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        k_mean: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The reference's ``rope_and_cache_write``; ``k_mean`` [nkv, hd] float32 (an e4m3
        cache only: smooth K) is subtracted from rotated k before it is quantized."""
        _need(qkv, "qkv")
        fp8 = _kv_cache(k_cache, v_cache, qkv.dtype, k_scale, v_scale)
        _need(positions, "positions", torch.int64)
        _need(slot_mapping, "slot_mapping", torch.int64)
        _need(cos, "cos", torch.float32)
        _need(sin, "sin", torch.float32)
        nkv, hd = k_cache.shape[2], k_cache.shape[3]
        t = qkv.shape[0]
        nq = qkv.shape[1] // hd - 2 * nkv
        out = torch.empty(t, nq, hd, dtype=qkv.dtype, device=self.device) if out is None else out
        out = out.view(t, nq, hd)
        if not _aligned(qkv, k_cache, v_cache, out):
            raise UnsupportedError(
                "CudaBackend.rope_and_cache_write: tensors must be 16-byte aligned"
            )
        if t == 0:
            return out
        mean_ptr = np.uint64(0)  # the 16-bit kernel ignores it
        if fp8:
            if k_mean is None:
                k_mean = self._zero_k_mean(nkv, hd)
            _need(k_mean, "k_mean", torch.float32)
            if tuple(k_mean.shape) != (nkv, hd):
                raise UnsupportedError(
                    f"CudaBackend.rope_and_cache_write: k_mean is {list(k_mean.shape)}, "
                    f"expected [{nkv}, {hd}]"
                )
            mean_ptr = _p(k_mean)
        name = "rope_kv_fp8_kernel" if fp8 else "rope_kv_kernel"
        k = self._lib(qkv.dtype, hd, nq, nkv).get("rope_kv", name)
        # the reference's float32(1 / scale) (llmc.cuda.reference.to_cache)
        inv_k, inv_v = (np.float32(1.0 / k_scale), np.float32(1.0 / v_scale)) if fp8 else (1, 1)
        args = (
            _p(qkv), _p(positions), _p(cos), _p(sin), _p(k_cache), _p(v_cache),
            _p(slot_mapping), _p(out), _i(t), _i(cos.shape[0]), np.float32(inv_k),
            np.float32(inv_v), mean_ptr,
        )  # fmt: skip
        self._launch(k, (min(t, 65535),), (128,), args, pdl=self._pdl_step(t))
        return out

    def min_split_keys(self, num_decode: int, num_kv_heads: int) -> int:
        """Fewest keys per split (the device splits a context into ceil(len / this))."""
        if self.force_min_keys:
            return max(1, self.force_min_keys)
        # tiny batches: latency, one 32-key step per CTA; else amortise the partials merge
        return 32 if num_decode * num_kv_heads < self._sm_count else 128

    def cluster_decode_ok(self, num_decode: int, num_kv_heads: int) -> bool:
        """Whether decode rows run ``paged_attention_cluster_kernel``: on sm_90+, when the
        batch's clusters (one per (token, kv head), CLUSTER_SPLITS CTAs each) fit one wave."""
        ctas = num_decode * num_kv_heads * CLUSTER_SPLITS
        return self.cluster_decode and 0 < ctas <= 2 * self._sm_count

    def num_splits(
        self, num_decode: int, num_kv_heads: int, max_seq_len: int, ctas_per_sm: int = CTAS_PER_SM
    ) -> int:
        """Most flash-decoding splits per sequence (grid z) of a decode launch.

        ~2 waves of CTAs (``ctas_per_sm`` resident per SM) when the batch gives fewer CTAs
        than SMs, none otherwise; never more than ``max_seq_len`` needs at
        ``min_split_keys`` keys per split.
        """
        budget = (self.max_num_seqs * SPLIT_ROWS_PER_SEQ) // max(1, num_decode)
        if self.force_splits:
            return max(1, min(self.force_splits, MAX_SPLITS, budget))
        ctas = max(1, num_decode * num_kv_heads)
        if ctas >= self._sm_count:  # measured: batch 64 x 4096 is fastest unsplit
            return 1
        want = math.ceil(2 * ctas_per_sm * self._sm_count / ctas)
        by_len = math.ceil(max(1, max_seq_len) / self.min_split_keys(num_decode, num_kv_heads))
        return max(1, min(want, by_len, MAX_SPLITS, budget))

    def prefill_kernel(self, dtype: torch.dtype, head_dim: int, block_size: int) -> str:
        """The family that serves prefill rows: prefill_sm90, prefill_attention or (fp32,
        odd head dims) decode_attention's paged kernel."""
        if self.sm90_prefill and supports(dtype, head_dim, block_size):
            return "prefill_sm90"
        tensor_core = self._lib(dtype, head_dim).cfg.tensor_core_prefill
        return "prefill_attention" if tensor_core else "decode_attention"

    def _ctas_per_sm(self, kernel: Any) -> int:
        """Resident CTAs of 128 threads per SM for ``kernel``'s register count (the
        tensor-core pass of decode_mma.cuh needs ~200: 2; the CUDA-core pass 128: 4)."""
        n = self._occupancy.get(id(kernel))
        if n is None:
            regs = -(-(getattr(kernel, "num_regs", 0) or 128) // 8) * 8
            n = self._occupancy[id(kernel)] = max(1, min(CTAS_PER_SM, 65536 // (128 * regs)))
        return n

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _need(q, "q")
        fp8 = _kv_cache(k_cache, v_cache, q.dtype, k_scale, v_scale)
        for name in ("cu_seqlens_q", "seq_lens", "block_tables"):
            _need(getattr(meta, name), name, torch.int32)
        t, nq, hd = q.shape
        nkv, bs = k_cache.shape[2], k_cache.shape[1]
        if out is None:
            out = torch.empty(t, nq * hd, dtype=q.dtype, device=self.device)
        if not _aligned(q, k_cache, v_cache, out):
            raise UnsupportedError("CudaBackend.attention: tensors must be 16-byte aligned")
        b = meta.seq_lens.shape[0]
        nd = meta.num_decode_seqs
        if t == 0 or b == 0:
            return out
        self.reserve(self.max_num_seqs, nq, hd)  # no allocation once the buffers fit
        lib = self._lib(q.dtype, hd, nq, nkv)
        mbps = meta.block_tables.shape[1]
        # fp8 cache: k_scale folds into the score scale, v_scale scales the output
        scale = np.float32(LOG2E / math.sqrt(hd) * (k_scale if fp8 else 1.0))
        vs = np.float32(v_scale if fp8 else 1.0)
        sfx = "_fp8_kernel" if fp8 else "_kernel"
        paged = lib.get("decode_attention", "paged_attention" + sfx)
        common = (_p(q), _p(k_cache), _p(v_cache), _p(meta.block_tables), _i(mbps), _i(bs))
        bs_shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
        if nd > 0 and self.cluster_decode_ok(nd, nkv):
            # small batch: the splits of a (token, kv head) merge in distributed shared memory
            k = lib.get("decode_attention", "paged_attention_cluster" + sfx)
            args = common + (
                _p(meta.seq_lens), _p(out), scale, _i(self.min_split_keys(nd, nkv)),
                _i(bs_shift), vs,
            )  # fmt: skip
            threads = 32 * lib.cfg.cluster_warps  # its block: CNW warps (KernelConfig)
            self._launch(k, (nd, nkv, CLUSTER_SPLITS), (threads,), args, pdl=self._pdl_step(t))
        elif nd > 0:
            splits = self.num_splits(nd, nkv, meta.max_seq_len, self._ctas_per_sm(paged))
            args = common + (
                _p(meta.seq_lens), _p(meta.cu_seqlens_q), _i(b), _i(0), _i(1), _p(out),
                _p(self._part_acc), _p(self._part_ml), scale,
                _i(self.min_split_keys(nd, nkv)), _i(bs_shift), _p(self._counters), vs,
            )  # fmt: skip
            self._launch(paged, (nd, nkv, splits), (128,), args, pdl=self._pdl_step(t))
        if b > nd and t > nd:
            if self.prefill_kernel(q.dtype, hd, bs) == "prefill_sm90":
                self._sm90.launch(q, k_cache, v_cache, meta, out, k_scale, v_scale)
            elif lib.cfg.tensor_core_prefill:
                g = nq // nkv
                tiles = math.ceil(meta.max_query_len * g / 64)
                pre = lib.get("prefill_attention", "prefill_attention" + sfx)
                args = common + (
                    _p(meta.seq_lens),
                    _p(meta.cu_seqlens_q),
                    _i(nd),
                    _p(out),
                    scale,
                    vs,
                )
                self._launch(pre, (tiles, b - nd, nkv), (128,), args)
            else:
                args = common + (
                    _p(meta.seq_lens), _p(meta.cu_seqlens_q), _i(b), _i(nd), _i(0), _p(out),
                    _p(out), _p(out), scale, _i(1), _i(bs_shift), _p(self._counters), vs,
                )  # fmt: skip
                self._launch(paged, (t - nd, nkv, 1), (128,), args)
        return out

    def silu_and_mul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _need(x, "x")
        t, i2 = x.shape
        i = i2 // 2
        if out is None:
            out = torch.empty(t, i, dtype=x.dtype, device=self.device)
        if t == 0:
            return out
        vec = 16 // x.element_size()
        vec_ok = i % vec == 0 and _aligned(x, out)
        per = i // vec if vec_ok else i
        k = self._lib(x.dtype).get("activation", "silu_and_mul_kernel")
        args = (_p(x), _p(out), _i(t), _i(i), _i(vec_ok))
        self._launch(k, (math.ceil(per / 256), min(t, 65535)), (256,), args)
        return out
