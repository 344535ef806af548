"""On the GPU: piecewise CUDA graphs (llmc.runtime.piecewise_graphs) under the quantized
engines — fp8 weights + fp8 KV, int4_wo and int8_wo (dummy weights of SmolLM2's shape,
bf16 activations, built for this GPU): one prefill batch's logits replayed from the pieces
are close to the eager step's with the same argmax, and chunked generation with mixed steps
replays pieces and agrees with the eager engine's greedy tokens (the first token of every
prompt; at least half of all: padded buckets may round a GEMM differently, so random
weights' near-ties can part later)."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import SMOLLM2_HF, tiny_build_config
from helpers.runner import prefill_batch
from llmc.compiler.builder import build
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
from llmc.runtime.types import SamplingParams

pytestmark = pytest.mark.cuda

LIMITS = dict(max_seq_len=128, max_num_tokens=128, max_batch_size=8, tokens_per_block=16)
QUANTS = [("fp8", "fp8"), ("int4_wo", "auto"), ("int8_wo", "auto")]
GROUP = {"int4_wo": 64}  # SmolLM2's hidden size 576 is no multiple of the default 128


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")


@pytest.fixture(scope="module", params=QUANTS, ids=[q for q, _ in QUANTS])
def engine(request, tmp_path_factory):
    quant, kv = request.param
    if quant == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need sm_89+")
    out = tmp_path_factory.mktemp("pw") / quant
    cfg = tiny_build_config(
        None, output_dir=str(out), dtype="bfloat16", target="auto", load_format="dummy",
        quantization=quant, kv_cache_dtype=kv, **LIMITS,
        **({"group_size": GROUP[quant]} if quant in GROUP else {}),
    )  # fmt: skip
    build(cfg, model_config=SMOLLM2_HF)
    return out


def _runtime(engine, piecewise: int, max_num_tokens: int = 128) -> EngineRuntime:
    cfg = RuntimeConfig(
        device="cuda", backend="cuda", piecewise_graph_max_tokens=piecewise,
        max_num_tokens=max_num_tokens,
    )  # fmt: skip
    return EngineRuntime.load(engine, cfg)


def test_quantized_piecewise_prefill_logits_close_to_eager(engine) -> None:
    rt = _runtime(engine, 128)
    runner = rt.runner
    assert runner.piecewise is not None
    batch = prefill_batch((12, 37, 5, 60), 49152, 16)  # 114 tokens, 4 sequences
    graphed = runner.forward_logits(batch)
    assert runner.piecewise.replays == 1
    runner.piecewise = None  # the same step eagerly (it rewrites the same KV slots)
    eager = runner.forward_logits(batch)
    assert torch.isfinite(graphed).all()
    assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)


def _greedy(rt: EngineRuntime, prompts: list[list[int]]) -> list[list[int]]:
    outs = rt.executor().generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(o.ok for o in outs)
    return [o.token_ids for o in outs]


def test_quantized_piecewise_chunked_generation_matches_eager(engine) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 40, 90, 3)]
    rt = _runtime(engine, 48, max_num_tokens=48)  # chunked prefill beside decode rows
    got = _greedy(rt, prompts)
    assert rt.runner.piecewise is not None and rt.runner.piecewise.replays > 0
    ref = _greedy(_runtime(engine, 0, max_num_tokens=48), prompts)
    same = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    share = same / sum(map(len, ref))
    print(f"{engine.name}: piecewise vs eager greedy agreement {share:.1%}")
    assert [x[0] for x in got] == [y[0] for y in ref] and share >= 0.5, share
