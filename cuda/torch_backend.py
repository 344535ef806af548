"""TorchBackend: the Backend protocol on plain torch ops (the reference; CPU and CUDA).

Every op IS the function of the same name in ``llmc.cuda.reference`` (``attention`` is
``paged_attention``): ``_reference_op`` turns the function into a method that takes the
protocol's optional ``out`` (a view of the step's workspace arena) and copies the result
there when it is given, so the reference and the backend cannot drift apart. Each op
computes into a temporary that torch allocates and copies it into ``out``: the accepted
cost of a reference backend; the CUDA backend allocates nothing per step.

``fused_decode_max_tokens`` (default 0: off) lets CPU tests run the ModelRunner's fused
small-step op sequence (``norm_linear``, ``norm_gate_up_silu``, ``linear_residual_add``),
whose reference functions compose the unfused ops, so both sequences give the same bits.

Weight-only ``PackedWeight``s (int8_wo, int4_wo, GGUF blocks): on CPU (``dense_cache``,
default on for a CPU device, off on CUDA where the float32 copy would not be counted by the
KV sizing) each weight is dequantized once, on first use, and the reference ops run on
that float32 matrix (``DequantizedWeight``: the same values, so the same bits). Measured on
this project's 2-core CPU for SmolLM2 shapes (x [1, 576] @ [1536, 576]): dequantize per call
62.7 ms, ``torch.ops.aten._weight_int8pack_mm`` 5.7 ms, ``_weight_int4pack_mm_for_cpu``
9.5 ms, the cached float32 matmul 0.26 ms: the cache is the fastest correct choice (its cost
is the float32 copy in host memory; the engine's own bytes stay packed).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llmc.cuda import reference as ref
from llmc.cuda import reference_fp8 as ref8
from llmc.cuda.backend import check_fused_decode_max_tokens
from llmc.cuda.reference_fp8 import Fp8Rows
from llmc.cuda.reference_wo import PackedWeight


@dataclass(frozen=True)
class DequantizedWeight(PackedWeight):
    """A PackedWeight with its ``dequantize()`` computed once (``dense`` float32 [N, K]):
    ``dequantize`` returns it (or its rows), the very values the packed weight gives, so
    every reference op computes the same bits as on the packed weight."""

    dense: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]

    @classmethod
    def of(cls, w: PackedWeight) -> DequantizedWeight:
        return cls(w.codes, w.scales, w.offsets, w.bits, w.code_zero, w.group_size, w.dequantize())

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.dense if rows is None else self.dense.index_select(0, rows)


def _into(out: Any, value: Any) -> Any:
    """``value``, or ``out`` holding a copy of it (viewed as ``value``'s shape where the
    op's result has another shape than the workspace buffer, as rotated q does). Tensors
    and ``Fp8Rows`` (codes and scales copied) alike."""
    if out is None:
        return value
    if isinstance(value, Fp8Rows) != isinstance(out, Fp8Rows):
        raise TypeError(f"out must be a {type(value).__name__}, got {type(out).__name__}")
    if out.shape != value.shape:
        out = out.view(value.shape)
    out.copy_(value)
    return out


def _reference_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The backend method of reference function ``fn``: ``fn``'s arguments, then ``out``
    (keyword or one positional argument past ``fn``'s own); the result — the first of a
    tuple — is written into ``out`` when given."""
    sig = inspect.signature(fn)
    arity = len(sig.parameters)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    out_param = inspect.Parameter("out", kind, default=None, annotation="torch.Tensor | None")

    @functools.wraps(fn)
    def op(self: TorchBackend, *args: Any, out: torch.Tensor | None = None) -> Any:
        if len(args) > arity:  # ``out`` passed positionally, as the protocol allows
            *args, out = args
        value = fn(*map(self.weight, args))
        if isinstance(value, tuple):
            return (_into(out, value[0]), *value[1:])
        return _into(out, value)

    params = [inspect.Parameter("self", kind), *sig.parameters.values(), out_param]
    op.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return op


def _in_place_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The backend method of reference function ``fn`` that has no ``out`` (it writes in
    place): ``fn`` on the arguments, packed weights resolved by ``TorchBackend.weight``."""

    @functools.wraps(fn)
    def op(self: TorchBackend, *args: Any) -> Any:
        return fn(*map(self.weight, args))

    sig = inspect.signature(fn)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    op.__signature__ = sig.replace(parameters=[this, *sig.parameters.values()])  # type: ignore[attr-defined]
    return op


class TorchBackend:
    """The reference backend. ``device``: where inputs, weights and outputs live."""

    name = "torch"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        fused_decode_max_tokens: int = 0,
        dense_cache: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.fused_decode_max_tokens = check_fused_decode_max_tokens(
            fused_decode_max_tokens, "TorchBackend"
        )
        self.dense_cache = self.device.type == "cpu" if dense_cache is None else dense_cache
        self._dense: dict[int, tuple[PackedWeight, DequantizedWeight]] = {}

    def weight(self, arg: Any) -> Any:
        """``arg``, or for a ``PackedWeight`` with the dense cache on, the same weight
        holding its dequantized float32 matrix, made once per weight (``DequantizedWeight``;
        the reference ops then compute the same bits without dequantizing per call)."""
        if not isinstance(arg, PackedWeight) or not self.dense_cache:
            return arg
        hit = self._dense.get(id(arg))
        if hit is None or hit[0] is not arg:  # the weight itself is kept: ids stay unique
            hit = (arg, DequantizedWeight.of(arg))
            self._dense[id(arg)] = hit
        return hit[1]

    embedding = _reference_op(ref.embedding)
    rms_norm = _reference_op(ref.rms_norm)
    add_rms_norm = _reference_op(ref.add_rms_norm)  # (normed → out, residual updated in place)
    linear = _reference_op(ref.linear)
    rope_and_cache_write = _reference_op(ref.rope_and_cache_write)
    attention = _reference_op(ref.paged_attention)
    silu_and_mul = _reference_op(ref.silu_and_mul)
    norm_linear = _reference_op(ref.norm_linear)
    norm_gate_up_silu = _reference_op(ref.norm_gate_up_silu)
    # in place on ``residual`` / a fresh id tensor: no ``out`` in the protocol
    linear_residual_add = _in_place_op(ref.linear_residual_add)
    sample = staticmethod(ref.sample)
    # FP8 (W8A8): dequantize-and-matmul in float32, on any device
    quantize_fp8 = _reference_op(ref8.quantize_fp8)
    rms_norm_fp8 = _reference_op(ref8.rms_norm_fp8)
    add_rms_norm_fp8 = _reference_op(ref8.add_rms_norm_fp8)
    silu_and_mul_fp8 = _reference_op(ref8.silu_and_mul_fp8)
    linear_fp8 = _reference_op(ref8.linear_fp8)
    norm_linear_fp8 = _reference_op(ref8.norm_linear_fp8)
    norm_gate_up_silu_fp8 = _reference_op(ref8.norm_gate_up_silu_fp8)
    linear_residual_add_fp8 = staticmethod(ref8.linear_residual_add_fp8)
