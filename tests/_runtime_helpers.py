"""Helpers shared by the runtime tests (tokenizer dirs, engines from tiny checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.compiler.limits import EngineLimits
from llmc.runtime.tokenizer import Tokenizer


def make_limits(
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    tokens_per_block: int,
    max_input_len: int | None = None,
    enable_chunked_prefill: bool = True,
    dtype: str = "float32",
) -> EngineLimits:
    """EngineLimits for a test (max_input_len defaults to max_seq_len)."""
    return EngineLimits(
        max_batch_size=max_batch_size,
        max_input_len=max_seq_len if max_input_len is None else max_input_len,
        max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens,
        tokens_per_block=tokens_per_block,
        enable_chunked_prefill=enable_chunked_prefill,
        dtype=dtype,
    )


def smollm2_tokenizer_dir(request: pytest.FixtureRequest, tmp: Path) -> Path:
    """A directory with SmolLM2's tokenizer.json: conftest's ``smollm2_hf_dir`` when it exists,
    else converted here from the GGUF with transformers."""
    try:
        return Path(request.getfixturevalue("smollm2_hf_dir"))
    except pytest.FixtureLookupError:
        pass
    from transformers import AutoTokenizer

    gguf = Path(request.getfixturevalue("smollm2_gguf"))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(tmp))
    return tmp


def load_tokenizer(path: Path, eos: tuple[int, ...] = ()) -> Tokenizer:
    return Tokenizer.from_dir(path, eos)


class FakeStepOutput:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.logprobs = None
        self.phase_times = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}


class FakeRunner:
    """A model-free runner: the next token is a fixed function of the sequence so far
    (or a scripted list per request id). Checks each step's blocks like the real runner."""

    def __init__(self, vocab_size: int = 256, script: dict[int, list[int]] | None = None):
        self.vocab_size = vocab_size
        self.script = script or {}
        self.steps = 0

    def next_token(self, seq) -> int:
        scripted = self.script.get(seq.request_id)
        n = len(seq.output_token_ids)
        if scripted is not None:
            return scripted[n % len(scripted)]
        return 3 + (sum(seq.all_token_ids) * 31 + 7 * n) % (self.vocab_size - 3)

    def step(self, batch) -> FakeStepOutput:
        self.steps += 1
        out = []
        for ss in batch.sequences:
            end = ss.start_position + ss.num_new_tokens
            assert len(ss.seq.block_table) * TOKENS_PER_BLOCK >= end, "blocks allocated first"
            if ss.sample:
                out.append(self.next_token(ss.seq))
        return FakeStepOutput(out)


TOKENS_PER_BLOCK = 4


def fake_parts(
    *,
    num_blocks: int = 64,
    max_batch_size: int = 8,
    max_num_tokens: int = 32,
    max_seq_len: int = 64,
    max_input_len: int = 48,
    policy: str = "guaranteed_no_evict",
    eos: tuple[int, ...] = (2,),
    tokenizer=None,
    script: dict[int, list[int]] | None = None,
    vocab_size: int = 256,
):
    """ExecutorParts over a real Scheduler + KVCacheManager and a FakeRunner."""
    from llmc.runtime.kv_cache import KVCacheManager
    from llmc.runtime.responses import ExecutorParts
    from llmc.runtime.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(num_blocks, TOKENS_PER_BLOCK)
    sched = Scheduler(
        SchedulerConfig(
            make_limits(
                max_num_tokens=max_num_tokens,
                max_batch_size=max_batch_size,
                max_seq_len=max_seq_len,
                max_input_len=max_input_len,
                tokens_per_block=TOKENS_PER_BLOCK,
            ),
            policy=policy,
            eos_token_ids=eos,
        ),
        kv,
    )
    return ExecutorParts(FakeRunner(vocab_size, script), sched, vocab_size, tokenizer)


@pytest.fixture(scope="module", autouse=False)
def one_torch_thread():
    """Tiny models run op by op: on a 2-core machine (often shared with other test
    processes) torch's intra-op threads only add synchronisation, so use one for the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
