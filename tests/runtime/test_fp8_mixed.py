"""Mixed fp8 engines (``EngineLimits.float_projections``, ``--exclude_modules``) on the torch
reference backend: each projection runs the fp8 or the activation-dtype op by its own dtype,
fed by the matching producer; excluding every projection is bit for bit the unquantized
engine, excluding none the fp8 one; the fused small-step path equals the unfused one; the
plan's ``normed`` buffer lives through the layer once a projection reads it."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import load_engine_weights, make_limits
from helpers.runner import drive, make_runner, new_seq, prompts
from llmc.compiler.memory_plan import workspace_buffers
from llmc.compiler.quantization import FP8_PROJECTIONS
from llmc.compiler.weight_passes import quantize_engine_weights
from llmc.cuda.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPS = (
    "rms_norm", "add_rms_norm", "rms_norm_fp8", "add_rms_norm_fp8", "linear", "linear_fp8",
    "quantize_fp8", "silu_and_mul", "silu_and_mul_fp8", "norm_linear", "norm_linear_fp8",
    "linear_residual_add", "linear_residual_add_fp8", "norm_gate_up_silu",
    "norm_gate_up_silu_fp8",
)  # fmt: skip


class OpRecorder(TorchBackend):
    """TorchBackend recording the names of the layer ops it runs (lm_head's linear too)."""

    def __init__(self, fused: int = 0) -> None:
        super().__init__("cpu", fused_decode_max_tokens=fused)
        self.ops: list[str] = []

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if name in OPS:
            ops = super().__getattribute__("ops")

            def op(*a, **k):
                ops.append(name)
                return attr(*a, **k)

            return op
        return attr


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_engine_weights(tiny_llama_dir)


def _all(spec) -> tuple[str, ...]:
    return tuple(f"layers.{i}.{p}" for i in range(spec.num_layers) for p in FP8_PROJECTIONS)


def mixed_runner(spec, weights, quant: str, kv: str, floats=(), **kw):
    w = quantize_engine_weights(spec, weights.items(), quant, kv, "test", None, floats)
    extra = {"float_projections": tuple(floats)} if floats else {}
    return make_runner(spec, w, quantization=quant, kv_cache_dtype=kv, **extra, **kw)


def _run(runner, spec, new: int = 6):
    seqs = [new_seq(i, p, new) for i, p in enumerate(prompts(3, [4, 13, 7], spec.vocab_size))]
    return drive(runner, seqs, chunk=16, budget=32, record_logits=True)


def _equal(a, b) -> None:
    assert a.outputs == b.outputs
    assert a.logits.keys() == b.logits.keys()
    for key, row in a.logits.items():
        assert torch.equal(row, b.logits[key]), key


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("fused", [0, 8])
def test_excluding_every_projection_is_the_unquantized_engine(tiny, kv, fused):
    spec, weights = tiny
    mixed = mixed_runner(spec, weights, "fp8", kv, _all(spec), backend=OpRecorder(fused))
    plain = mixed_runner(spec, weights, "none", kv, backend=TorchBackend("cpu", fused))
    _equal(_run(mixed, spec), _run(plain, spec))
    assert not any(op.endswith("_fp8") for op in mixed.backend.ops)


def test_excluding_nothing_is_the_fp8_engine(tiny):
    spec, weights = tiny
    a = _run(mixed_runner(spec, weights, "fp8", "fp8"), spec)
    w = quantize_engine_weights(spec, weights.items(), "fp8", "fp8", "test")
    _equal(a, _run(make_runner(spec, w, quantization="fp8", kv_cache_dtype="fp8"), spec))


@pytest.mark.parametrize(
    "floats",
    [("layers.1.gate_up_proj", "layers.1.down_proj"), ("layers.0.qkv_proj",),
     ("layers.0.o_proj", "layers.1.down_proj"), ("layers.1.gate_up_proj",)],
    ids=["last-mlp", "qkv0", "o0+down1", "gate_up1"],
)  # fmt: skip
def test_fused_small_steps_equal_the_unfused_path_of_a_mixed_engine(tiny, floats):
    spec, weights = tiny
    runs = [
        _run(mixed_runner(spec, weights, "fp8", "fp8", floats, backend=OpRecorder(f)), spec)
        for f in (0, 8)
    ]
    _equal(*runs)
    # and the mix is neither the all-fp8 engine nor the unquantized one
    fp8 = _run(mixed_runner(spec, weights, "fp8", "fp8"), spec)
    none = _run(mixed_runner(spec, weights, "none", "fp8"), spec)
    key = next(iter(runs[0].logits))
    assert not torch.equal(runs[0].logits[key], fp8.logits[key])
    assert not torch.equal(runs[0].logits[key], none.logits[key])


def test_each_projection_runs_the_op_of_its_dtype(tiny):
    """Unfused, one prefill step: layer 0 all fp8; layer 1 with gate_up and down in dtype."""
    spec, weights = tiny
    floats = ("layers.1.gate_up_proj", "layers.1.down_proj")
    be = OpRecorder()
    runner = mixed_runner(spec, weights, "fp8", "fp8", floats, backend=be)
    drive(runner, [new_seq(0, [5, 6, 7, 8], 1)], chunk=16, budget=16)
    layer0 = ["rms_norm_fp8", "linear_fp8", "quantize_fp8", "linear_fp8", "add_rms_norm_fp8",
              "linear_fp8", "silu_and_mul_fp8", "linear_fp8"]  # fmt: skip
    layer1 = ["add_rms_norm_fp8", "linear_fp8", "quantize_fp8", "linear_fp8", "add_rms_norm",
              "linear", "silu_and_mul", "linear"]  # fmt: skip
    assert be.ops[: len(layer0) + len(layer1)] == layer0 + layer1
    # a decode step on the fused path: layer 1's MLP through the activation-dtype ops
    be8 = OpRecorder(fused=8)
    runner = mixed_runner(spec, weights, "fp8", "fp8", floats, backend=be8)
    drive(runner, [new_seq(0, [5, 6, 7, 8], 1)], chunk=16, budget=16)
    fused = [op for op in be8.ops if op.startswith(("norm_", "linear_residual"))]
    assert fused == [
        "norm_linear_fp8", "linear_residual_add_fp8", "norm_gate_up_silu_fp8",
        "linear_residual_add_fp8", "norm_linear_fp8", "linear_residual_add_fp8",
        "norm_gate_up_silu", "linear_residual_add",
    ]  # fmt: skip


def test_the_plan_keeps_normed_live_through_a_mixed_layer(tiny):
    spec, _ = tiny

    def normed(floats):
        lim = make_limits(
            max_batch_size=4, max_num_tokens=32, max_seq_len=64, tokens_per_block=8,
            quantization="fp8", float_projections=floats,
        )  # fmt: skip
        return next(b for b in workspace_buffers(spec, lim) if b.name == "normed")

    whole, mixed = normed(()), normed(("layers.1.down_proj",))
    assert mixed.first < whole.first and mixed.last == whole.last
