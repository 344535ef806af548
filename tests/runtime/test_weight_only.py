"""Weight-only engines on the torch backend: int8_wo / int4_wo / GGUF-native engines run the
activation-dtype op sequence with PackedWeights, computing what a float engine of their
dequantized weights computes; the CPU dense cache changes no bit; dummy weights are
quantized at load; the real SmolLM2 kept native gives transformers' own GGUF loader's
greedy tokens."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import make_limits, tiny_build_config
from llmc.compiler.builder import build
from llmc.compiler.engine_format import load_engine
from llmc.compiler.wo_weights import packed_from_tensors
from llmc.cuda.torch_backend import TorchBackend
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = dict(max_seq_len=64, max_num_tokens=64, max_batch_size=4, tokens_per_block=8)


@pytest.fixture(scope="module", params=["int8_wo", "int4_wo"])
def wo_engine(request, tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "e"
    cfg = tiny_build_config(
        tiny_llama_dir, output_dir=str(out), quantization=request.param, group_size=32, **LIMITS
    )
    build(cfg)
    return load_engine(out)


def dequantized(engine) -> dict[str, torch.Tensor]:
    """The engine's weights with every packed one dequantized (a float32 engine's)."""
    w = engine.load_weights()
    out = {n: t for n, t in w.items() if not n.endswith(("_scale", "_offset"))}
    for name, layout in engine.layouts.items():
        out[name] = packed_from_tensors(w, name, layout).dequantize()
    return out


def runner(engine, weights, *, layouts=None, **backend) -> ModelRunner:
    lim = make_limits(**LIMITS)
    lim = lim if layouts is None else engine.limits
    return ModelRunner(
        engine.spec, weights, backend=TorchBackend("cpu", **backend), device="cpu", limits=lim,
        num_kv_blocks=32, layouts=layouts,
    )  # fmt: skip


def logits(r: ModelRunner, prompt: list[int], steps: int = 3) -> list[torch.Tensor]:
    """Logits of a prefill and the greedy decode steps of one sequence."""
    from helpers.runner import drive, new_seq

    res = drive(r, [new_seq(0, prompt, steps)], chunk=64, budget=64, record_logits=True)
    return [res.logits[k] for k in sorted(res.logits)]


def test_layouts_and_bytes(wo_engine):
    lim, lay = wo_engine.limits, wo_engine.layouts
    assert set(lay) == {f"layers.{i}.{p}" for i in range(2) for p in
                        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}  # fmt: skip
    w = wo_engine.load_weights()
    assert w["embed_tokens"].dtype == torch.float32  # embedding, lm_head, norms stay float
    if lim.quantization == "int8_wo":
        assert lay["layers.0.down_proj"].group_size == 160 and w["layers.0.down_proj"].shape == (
            64,
            160,
        )
    else:
        assert lay["layers.0.down_proj"].group_size == 32 and w["layers.0.down_proj"].shape == (
            64,
            80,
        )
        assert w["layers.0.down_proj_offset"].dtype == torch.float16
    assert wo_engine.plan.weight_bytes_total == sum(t.nbytes for t in w.values())


def test_the_engine_computes_its_dequantized_weights(wo_engine):
    """The packed engine and a float32 engine holding its dequantized weights: the same
    logits (float32 arithmetic on the same values)."""
    prompt = [5, 17, 33, 2, 90, 41]
    ours = logits(runner(wo_engine, wo_engine.load_weights(), layouts=wo_engine.layouts), prompt)
    ref = logits(runner(wo_engine, dequantized(wo_engine)), prompt)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_cpu_dense_cache_and_the_fused_path_change_no_bit(wo_engine):
    w, lay, prompt = wo_engine.load_weights(), wo_engine.layouts, [9, 8, 7, 6, 5]
    base = logits(runner(wo_engine, w, layouts=lay, dense_cache=False), prompt)
    cached = runner(wo_engine, w, layouts=lay)
    assert cached.backend.dense_cache
    for a, b in zip(base, logits(cached, prompt), strict=True):
        assert torch.equal(a, b)
    assert len(cached.backend._dense) == 4 * 2  # each packed weight dequantized once
    fused = runner(wo_engine, w, layouts=lay, fused_decode_max_tokens=8)
    for a, b in zip(base, logits(fused, prompt), strict=True):
        assert torch.equal(a, b)


def test_dummy_weights_are_quantized_at_load(tmp_path):
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig

    hf = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128,
    }  # fmt: skip
    out = tmp_path / "e"
    build(
        tiny_build_config(
            None, output_dir=str(out), load_format="dummy", quantization="int4_wo",
            group_size=64, **LIMITS,
        ),
        model_config=hf,
    )  # fmt: skip
    engine = load_engine(out)
    assert not (out / "weights.safetensors").exists() and len(engine.layouts) == 8
    w = engine.load_weights()
    assert w["layers.1.gate_up_proj"].dtype == torch.uint8
    rt = EngineRuntime.load(out, RuntimeConfig(device="cpu"))
    outs = rt.executor().generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert outs[0].ok and len(outs[0].token_ids) == 4


@pytest.mark.slow
def test_smollm2_native_greedy_equals_transformers_gguf(smollm2_gguf, tmp_path):
    """SmolLM2 built GGUF-native (float32 activations) against transformers' own GGUF
    loader (float32): 4 prompts x 32 greedy tokens, the same ids; engine weights <= 130 MB."""
    import transformers

    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig

    out = tmp_path / "smollm2"
    limits = dict(LIMITS, max_seq_len=256, max_num_tokens=256)  # chat prompts + 32 tokens
    result = build(tiny_build_config(smollm2_gguf, output_dir=str(out), **limits))
    assert result.build.limits.quantization == "gguf"
    assert result.plan.weight_bytes_total <= 130_000_000
    rt = EngineRuntime.load(out, RuntimeConfig(device="cpu"))
    tok = rt.tokenizer
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers."]  # fmt: skip
    prompts = [list(tok.apply_chat_template(t)) for t in texts] + [
        tok.encode("The quick brown fox")
    ]
    outs = rt.executor().generate(prompts, SamplingParams(max_new_tokens=32, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    model.eval()
    for p, o in zip(prompts, outs, strict=True):
        assert o.ok, o.error
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )[0, len(p):].tolist()  # fmt: skip
        assert o.token_ids == ref
    assert "Paris" in outs[0].text
