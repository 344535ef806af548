"""The engine core without a model: a real Scheduler + KVCacheManager, and a FakeRunner whose
next token is a fixed function of the sequence so far (or a script per request id).

- ``make_scheduler``: a Scheduler over a fresh KVCacheManager, limits as ``make_limits`` takes;
- ``FakeRunner``: checks that each step's blocks were allocated first, like the real runner;
  a branching step (forks, beams) samples fake logits (a fixed function of the sequence)
  through ``llmc.runtime.beam_search``, as the real runner does;
- ``fake_parts``: ExecutorParts over both, for Executor tests.
"""

from __future__ import annotations

from typing import Any

from helpers.engines import make_limits
from llmc.runtime.admission import GUARANTEED_NO_EVICT
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.responses import ExecutorParts
from llmc.runtime.scheduler import Scheduler, SchedulerConfig

TOKENS_PER_BLOCK = 4
"""The block size of ``fake_parts``' pool (FakeRunner checks block tables against it)."""


def make_scheduler(
    num_blocks: int,
    *,
    policy: str = GUARANTEED_NO_EVICT,
    eos: tuple[int, ...] = (),
    reuse: bool = True,
    **limits: Any,
) -> Scheduler:
    """A Scheduler over a KVCacheManager of ``num_blocks`` blocks (prefix reuse unless
    ``reuse=False``); ``limits``: the arguments of ``make_limits``."""
    run_limits = make_limits(**limits)
    kv = KVCacheManager(num_blocks, run_limits.tokens_per_block, enable_block_reuse=reuse)
    return Scheduler(SchedulerConfig(run_limits, policy=policy, eos_token_ids=eos), kv)


class FakeStepOutput:
    def __init__(self, token_ids: list[int], branch_steps=(), logprobs=None) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.branch_steps = list(branch_steps)
        self.phase_times = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}


class _ReferenceSampler:
    """The reference backend's sampler, all a branching fake step needs of a backend."""

    @staticmethod
    def sample(logits, meta):
        from llmc.cuda import reference

        return reference.sample(logits, meta)


def fake_logits(seq, vocab_size: int):
    """Logits [V] float32 that are a fixed function of ``seq``'s tokens (beams and samples
    of the fake runner; the same sequence gives the same logits in any batch)."""
    import torch

    g = torch.Generator().manual_seed(hash(tuple(seq.all_token_ids)) & 0x7FFFFFFF)
    return torch.randn(vocab_size, generator=g) * 3.0


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
        self.copies = getattr(self, "copies", []) + list(batch.block_copies)
        out = []
        for ss in batch.sequences:
            end = ss.start_position + ss.num_new_tokens
            assert len(ss.seq.block_table) * TOKENS_PER_BLOCK >= end, "blocks allocated first"
            if ss.sample:
                out.append(self.next_token(ss.seq))
        if batch.branching:
            import torch

            from llmc.runtime.beam_search import branch_sample

            rows = [ss for ss in batch.sequences if ss.sample]
            logits = torch.stack([fake_logits(ss.seq, self.vocab_size) for ss in rows])
            ids, lps, steps = branch_sample(_ReferenceSampler(), logits, rows, self.vocab_size)
            return FakeStepOutput(ids, steps, lps)
        return FakeStepOutput(out)


def fake_parts(
    *,
    num_blocks: int = 64,
    max_batch_size: int = 8,
    max_num_tokens: int = 32,
    max_seq_len: int = 64,
    max_input_len: int = 48,
    policy: str = GUARANTEED_NO_EVICT,
    eos: tuple[int, ...] = (2,),
    tokenizer=None,
    script: dict[int, list[int]] | None = None,
    vocab_size: int = 256,
    max_beam_width: int = 1,
) -> ExecutorParts:
    """ExecutorParts over a real Scheduler + KVCacheManager and a FakeRunner."""
    sched = make_scheduler(
        num_blocks,
        policy=policy,
        eos=eos,
        max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_input_len=max_input_len,
        tokens_per_block=TOKENS_PER_BLOCK,
        max_beam_width=max_beam_width,
    )
    return ExecutorParts(FakeRunner(vocab_size, script), sched, vocab_size, tokenizer)
