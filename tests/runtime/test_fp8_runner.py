"""The ModelRunner of FP8 engines on the torch reference backend: fp8 weights (W8A8), an fp8
KV cache and both, against the float32 engine of the same checkpoint; the fused small-step
path against the unfused one; the KV scales reaching the ops; bad fp8 weights refused.

Tolerances (measured on this CPU, stated so a regression shows):
- logits of the first 4 layers of SmolLM2 (real weights), prefill in chunks of 8 tokens (so
  the later chunks read the earlier ones from the cache): max |Δ| / std(float32 logits)
  below 0.5 for fp8 weights (measured 0.17-0.24), 0.3 for the fp8 KV cache (0.02-0.11),
  0.6 for both (0.18-0.36);
- teacher-forced next-token agreement with the float32 engine on the float32 engine's own
  greedy continuations (``_teacher_forced_agreement``, 48 positions): at least 85 % for fp8
  weights or KV (measured 100 % and 97.9 %), 80 % for both (measured 97.9 %).
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.engines import load_engine_weights
from helpers.runner import BlockAllocator, EagerGraphs, drive, make_runner, new_seq, prompts
from llmc.base.errors import EngineError, UnsupportedError
from llmc.compiler.weight_passes import quantize_engine_weights
from llmc.cuda.torch_backend import TorchBackend
from llmc.runtime.types import ScheduledBatch, ScheduledSequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = [("fp8", "auto"), ("none", "fp8"), ("fp8", "fp8")]
LOGIT_TOL = {("fp8", "auto"): 0.5, ("none", "fp8"): 0.3, ("fp8", "fp8"): 0.6}
AGREE_MIN = {("fp8", "auto"): 0.85, ("none", "fp8"): 0.85, ("fp8", "fp8"): 0.8}


def fp8_runner(spec, weights, quant: str, kv: str, **kw):
    """A CPU runner of the engine weights ``weights`` (float) quantized as asked."""
    w = quantize_engine_weights(spec, weights.items(), quant, kv, "test")
    return make_runner(spec, w, quantization=quant, kv_cache_dtype=kv, **kw)


@pytest.fixture(scope="module")
def smol(smollm2_4l_dir):
    return load_engine_weights(smollm2_4l_dir)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_engine_weights(tiny_llama_dir)


def _prefill_logits(runner, spec) -> dict:
    seqs = [new_seq(i, p, 1) for i, p in enumerate(prompts(4, [5, 19, 33, 2], spec.vocab_size))]
    return drive(runner, seqs, chunk=8, budget=64, record_logits=True).logits


@pytest.mark.slow
@pytest.mark.parametrize("quant, kv", FP8)
def test_logits_are_close_to_the_float32_engine(smol, quant, kv):
    spec, weights = smol
    ref = _prefill_logits(make_runner(spec, weights), spec)
    got = _prefill_logits(fp8_runner(spec, weights, quant, kv), spec)
    assert got.keys() == ref.keys()
    for key, row in ref.items():
        err = float((got[key] - row).abs().max() / row.std())
        assert err < LOGIT_TOL[(quant, kv)], (key, err)


def _teacher_forced_agreement(spec, ref_runner, runner, n_new: int = 12) -> float:
    """The float32 runner's greedy continuations; then, for every prefix of them, whether
    ``runner``'s next token (one prefill of the prefix) is the float32 runner's."""
    ps = prompts(4, [6, 11, 20, 3], spec.vocab_size, seed=5)
    greedy = drive(ref_runner, [new_seq(i, p, n_new) for i, p in enumerate(ps)], chunk=64,
                   budget=128).outputs  # fmt: skip
    prefixes, want = [], []
    for i, p in enumerate(ps):
        for j in range(n_new):
            prefixes.append(p + greedy[i][:j])
            want.append(greedy[i][j])
    seqs = [new_seq(k, p, 1) for k, p in enumerate(prefixes)]
    got = drive(runner, seqs, chunk=64, budget=128).outputs
    return sum(got[k][0] == w for k, w in enumerate(want)) / len(want)


@pytest.mark.slow
@pytest.mark.parametrize("quant, kv", FP8)
def test_next_tokens_agree_with_the_float32_engine(smol, quant, kv):
    spec, weights = smol
    kw = dict(max_num_tokens=128, max_batch_size=64, num_kv_blocks=400)
    agree = _teacher_forced_agreement(
        spec, make_runner(spec, weights, **kw), fp8_runner(spec, weights, quant, kv, **kw)
    )
    assert agree >= AGREE_MIN[(quant, kv)], agree


class RecordingBackend(TorchBackend):
    """TorchBackend recording the KV-cache arguments of rope_and_cache_write / attention."""

    def __init__(self, fused: int = 0) -> None:
        super().__init__("cpu", fused_decode_max_tokens=fused)
        self.kv_calls: list[tuple[str, torch.dtype, tuple]] = []
        self.k_means: list[tuple] = []  # rope_and_cache_write's smooth-K argument, if any

    def rope_and_cache_write(self, qkv, positions, cos, sin, k, v, slots, *scales, out=None):
        self.kv_calls.append(("rope", k.dtype, scales[:2]))
        self.k_means.append(scales[2:])
        return super().rope_and_cache_write(qkv, positions, cos, sin, k, v, slots, *scales, out=out)

    def attention(self, q, k, v, meta, *scales, out=None):
        self.kv_calls.append(("attention", k.dtype, scales))
        return super().attention(q, k, v, meta, *scales, out=out)


@pytest.mark.parametrize("quant, kv", [("none", "auto"), *FP8])
def test_fused_small_steps_equal_the_unfused_path(tiny, quant, kv):
    spec, weights = tiny
    runs = {}
    for fused in (0, 8):
        runner = fp8_runner(spec, weights, quant, kv, backend=RecordingBackend(fused))
        seqs = [new_seq(i, p, 10) for i, p in enumerate(prompts(3, [4, 13, 7], spec.vocab_size))]
        runs[fused] = drive(runner, seqs, chunk=16, budget=32, record_logits=True)
    assert runs[0].outputs == runs[8].outputs
    assert runs[0].logits.keys() == runs[8].logits.keys()
    for key, row in runs[0].logits.items():
        assert torch.equal(row, runs[8].logits[key]), key


def test_an_fp8_kv_cache_is_e4m3_and_gets_each_layers_scales(tiny):
    spec, weights = tiny
    w = quantize_engine_weights(spec, weights.items(), "fp8", "fp8", "test")
    w["layers.0.kv_scale"] = torch.tensor([0.5, 0.25])
    w["layers.1.kv_scale"] = torch.tensor([2.0, 0.125])
    assert torch.equal(w["layers.0.k_mean"], torch.zeros(spec.num_kv_heads, spec.head_dim))
    w["layers.1.k_mean"] = torch.full((spec.num_kv_heads, spec.head_dim), 0.5)
    be = RecordingBackend()
    runner = make_runner(spec, w, quantization="fp8", kv_cache_dtype="fp8", backend=be)
    assert runner.kv_cache.storage.dtype == torch.float8_e4m3fn
    seq = new_seq(0, [5, 6, 7, 8, 9], 2)
    drive(runner, [seq], chunk=16, budget=16)
    per_layer = [(0.5, 0.25), (2.0, 0.125)] * 2  # two steps of two layers
    assert [c[2] for c in be.kv_calls if c[0] == "rope"] == per_layer
    assert [c[2] for c in be.kv_calls if c[0] == "attention"] == per_layer
    assert all(c[1] == torch.float8_e4m3fn for c in be.kv_calls)
    # each layer's smooth-K mean reaches the KV write (and only it)
    assert [float(m[0].flatten()[0]) for m in be.k_means] == [0.0, 0.5] * 2
    # a 16/32-bit cache is called exactly as before: no scales, no mean
    be = RecordingBackend()
    drive(make_runner(spec, weights, backend=be), [new_seq(0, [5, 6, 7], 2)], chunk=8, budget=8)
    assert be.kv_calls and all(c[2] == () and c[1] == torch.float32 for c in be.kv_calls)
    assert all(m == () for m in be.k_means)


def test_the_scales_reach_the_cache_values(tiny):
    """Layer 0's cached K/V are the reference's e4m3 codes for its scales."""
    from llmc.cuda import reference as ref

    spec, weights = tiny
    w = quantize_engine_weights(spec, weights.items(), "none", "fp8", "test")
    runs = {}
    for k_scale in (1.0, 0.25):
        w["layers.0.kv_scale"] = torch.tensor([k_scale, 1.0])
        runner = make_runner(spec, w, kv_cache_dtype="fp8", num_kv_blocks=4)
        drive(runner, [new_seq(0, [5, 6, 7, 8], 1)], chunk=8, budget=8)
        runs[k_scale] = runner.kv_cache.k(0).float()
    a, b = runs[1.0], runs[0.25]
    nz = a != 0
    assert nz.any()
    # the same rotated keys, stored as sat(k / scale): codes of scale 0.25 are ~4x larger
    ratio = (b[nz] / a[nz]).median()
    assert 3.5 < float(ratio) < 4.5
    assert torch.equal(ref.to_cache(a, torch.float8_e4m3fn, 1.0).float(), a)


def test_the_decode_graph_path_runs_an_fp8_engine(tiny):
    spec, weights = tiny
    seqs = lambda: [new_seq(i, p, 6) for i, p in enumerate(prompts(3, [5, 9, 2], 256, seed=2))]  # noqa: E731
    eager = drive(fp8_runner(spec, weights, "fp8", "fp8"), seqs(), chunk=16, budget=32).outputs
    runner = fp8_runner(spec, weights, "fp8", "fp8")
    runner.graphs = EagerGraphs(runner.inputs, runner.forward, runner.backend, (1, 2, 4),
                                allow_cpu=True)  # fmt: skip
    runner.graphs.capture()
    assert drive(runner, seqs(), chunk=16, budget=32).outputs == eager
    assert runner.graphs.replays > 0


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("layers.0.qkv_proj", "float", "'layers.0.qkv_proj' is [128, 64] float32, expected"),
        ("layers.1.down_proj_scale", "half", "'layers.1.down_proj_scale' is [64] float16"),
        ("layers.0.kv_scale", torch.tensor([0.0, 1.0]), "holds k_scale 0.0"),
        ("layers.1.kv_scale", torch.tensor([1.0, math.nan]), "holds v_scale nan"),
        ("layers.1.kv_scale", torch.tensor([1.0, -math.inf]), "holds v_scale -inf"),
        ("layers.0.k_mean", "half", "'layers.0.k_mean' is [2, 16] float16, expected"),
        ("layers.1.k_mean", torch.zeros(2, 8), "'layers.1.k_mean' is [2, 8] float32, expected"),
        ("layers.1.k_mean", torch.full((2, 16), math.nan), "'layers.1.k_mean' (smooth K"),
    ],
)
def test_bad_fp8_engine_weights_are_refused_naming_the_tensor(tiny, name, value, says):
    spec, weights = tiny
    w = quantize_engine_weights(spec, weights.items(), "fp8", "fp8", "test")
    w[name] = getattr(w[name], value)() if isinstance(value, str) else value
    with pytest.raises(EngineError, match="engine weights: tensor") as e:
        make_runner(spec, w, quantization="fp8", kv_cache_dtype="fp8")
    assert says in str(e.value)


def test_unquantized_weights_for_an_fp8_engine_are_refused(tiny):
    spec, weights = tiny
    with pytest.raises(EngineError, match="'layers.0.qkv_proj_scale' is missing .quantiz"):
        make_runner(spec, weights, quantization="fp8")
    w = {**weights, **{f"{n}_scale": torch.ones(len(weights[n])) for n in weights if "_proj" in n}}
    with pytest.raises(EngineError, match="'layers.0.qkv_proj' is .* float32, expected"):
        make_runner(spec, w, quantization="fp8")


def test_a_step_of_an_fp8_engine_uses_its_workspace_rows(tiny):
    """The quantized activations land in the plan's Fp8Rows buffers (no other arena)."""
    spec, weights = tiny
    runner = fp8_runner(spec, weights, "fp8", "auto")
    ws = runner.workspace
    for name in ("normed_fp8", "attn_out_fp8", "act_fp8"):
        ws[name].view(torch.uint8).fill_(0)
    alloc = BlockAllocator(runner.kv_cache.num_blocks, runner.limits.tokens_per_block)
    seq = new_seq(0, [3, 4, 5, 6], 1)
    alloc.ensure(seq, 4)
    runner.step(ScheduledBatch(0, (ScheduledSequence(seq, 0, 4, True),)))
    for name in ("normed_fp8", "attn_out_fp8", "act_fp8"):
        assert ws[name].dtype == torch.float8_e4m3fn
        assert ws[name][:4].view(torch.uint8).any(), name  # written by this step
        assert bool((ws[name + "_scale"][:4] > 0).all()), name


def test_an_fp8_engine_on_a_gpu_below_sm89_is_refused(tiny_engine, tiny_llama_dir, monkeypatch):
    import llmc.runtime.engine_runtime as er
    from helpers.engines import SMALL_LIMITS

    engine = tiny_engine(tiny_llama_dir, quantization="fp8", **SMALL_LIMITS)
    monkeypatch.setattr(er, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(er, "_gpu_arch", lambda: "sm_80")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    for backend in ("auto", "cuda"):
        with pytest.raises(UnsupportedError) as e:
            er.EngineRuntime.load(engine, er.RuntimeConfig(backend=backend))
        msg = str(e.value)
        assert "NVIDIA A100-SXM4-80GB is sm_80" in msg and "--target sm_80" in msg, msg
        assert "Rebuild it with --quantization none: llmc build" in msg
        assert "--quantization fp8" not in msg  # the rebuild drops it
