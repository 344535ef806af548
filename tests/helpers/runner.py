"""ModelRunner set-ups of the runtime tests: a CPU runner, a hand-made driver, transformers
references.

``drive`` plays a minimal scheduler (the real one is tested with the runner separately):
sequences join at staggered steps, each step gives every decoding sequence one token and
the prefilling ones chunks of at most ``chunk`` tokens under a ``budget``, blocks come from
a trivial allocator that hands out shuffled block ids (so a wrong block-table lookup shows).
``EagerGraphs`` is the decode-graph path on CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helpers.engines import make_limits, pop_limits
from llmc.cuda.torch_backend import TorchBackend
from llmc.runtime.cuda_graphs import DecodeGraphs
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.piecewise_graphs import PiecewiseGraphs
from llmc.runtime.prefill_graphs import PrefillGraphs
from llmc.runtime.types import SamplingParams, ScheduledBatch, ScheduledSequence, Sequence


def load_hf(ckpt: Path):
    """The transformers model of ``ckpt`` in float32, EOS off (generate gives max_new_tokens)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


def make_runner(spec, weights, **kw) -> ModelRunner:
    """A CPU ModelRunner; ``kw``: runner arguments or EngineLimits fields (small defaults)."""
    limits = dict(max_num_tokens=128, max_batch_size=8, max_seq_len=160, tokens_per_block=8)
    limits.update(pop_limits(kw))
    args = dict(backend=TorchBackend("cpu"), device="cpu", num_kv_blocks=200)
    args.update(kw)
    return ModelRunner(spec, weights, limits=make_limits(**limits), **args)


class _EagerReplay:
    def __init__(self, graphs: DecodeGraphs, big: int, dev: dict) -> None:
        self.graphs, self.big, self.dev = graphs, big, dev

    def replay(self) -> None:
        self.graphs._body(self.big, self.dev)


class EagerGraphs(DecodeGraphs):
    """The decode-graph path on CPU: 'replay' runs the captured body eagerly on the same
    (fixed-address) staging views, so layout, padding and the token gather are exercised."""

    def capture(self) -> None:
        for big in sorted(self.buckets, reverse=True):
            dev = self._stage(big, None, [])  # records the bucket's staging layout
            self.graphs[big] = _EagerReplay(self, big, dev)


class _EagerPrefillReplay:
    def __init__(self, graphs: PrefillGraphs, big: int, dev: dict) -> None:
        self.graphs, self.big, self.dev = graphs, big, dev

    def replay(self) -> None:
        self.graphs._body(self.big, self.dev)


class EagerPrefillGraphs(PrefillGraphs):
    """The prefill-graph path on CPU: 'replay' runs the captured body eagerly on the same
    (fixed-address) staging views, so layout, padding and the fixed grid are exercised."""

    def capture(self, pool=None) -> None:
        for big in sorted(self.buckets, reverse=True):
            dev = self._stage(big, None, None)  # records the bucket's staging layout
            self.graphs[big] = _EagerPrefillReplay(self, big, dev)


class _LazyPiece:
    """One piece of an EagerPiecewiseGraphs bucket: its 'replay' runs the next piece of the
    bucket's generator (piece 0 starts it), so pieces run in order, eagerly."""

    def __init__(self, graphs: PiecewiseGraphs, big: int, k: int) -> None:
        self.graphs, self.big, self.k = graphs, big, k

    def replay(self) -> None:
        live = self.graphs.live  # type: ignore[attr-defined]
        if self.k == 0:
            live[self.big] = self.graphs._steps(self.big)
        next(live[self.big], None)


class EagerPiecewiseGraphs(PiecewiseGraphs):
    """The piecewise path on CPU: each piece's 'replay' runs that piece eagerly on the
    bucket's workspace views, with the attentions between them run by ``run`` as on the
    GPU (padding rows, the row clearing, the buckets and the head are all exercised)."""

    def capture(self, pool=None) -> None:
        self.clear_rows()
        self.live: dict = {}
        n = self.layers.spec.num_layers + 1
        for big in self.buckets:
            self.graphs[big] = [_LazyPiece(self, big, k) for k in range(n)]


def tiny_runtime(
    tiny, *, graphs=False, num_blocks=64, max_num_tokens=64, max_beam_width=1, **config
):
    """A CPU torch-backend EngineRuntime of ``tiny`` = (spec, weights, tokenizer): 6 rows,
    4-token blocks; ``graphs``: the decode-graph path replayed eagerly (``EagerGraphs``,
    with the multi-step window's token feedback when ``decode_steps_per_iteration`` > 1);
    ``config``: RuntimeConfig fields."""
    from llmc.runtime.decode_window import WindowState
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig

    spec, weights, tok = tiny
    limits = make_limits(
        max_batch_size=6,
        max_input_len=48,
        max_seq_len=96,
        max_num_tokens=max_num_tokens,
        tokens_per_block=4,
        max_beam_width=max_beam_width,
    )
    rt = EngineRuntime.from_weights(
        spec,
        weights,
        limits=limits,
        num_kv_blocks=num_blocks,
        tokenizer=tok,
        config=RuntimeConfig(device="cpu", backend="torch", **config),
    )
    assert rt.async_scheduling is False  # CPU runs stay synchronous unless asked
    if graphs:
        r = rt.runner
        steps = rt.decode_steps_per_iteration
        if steps > 1:
            r.window = WindowState(r.limits, r.device, steps)
        g = EagerGraphs(
            r.inputs, r.forward, r.backend, (1, 2, 4, 6), allow_cpu=True, window=r.window
        )
        g.capture()
        r.graphs = g
        pre = EagerPrefillGraphs(r.inputs, r.forward, r.backend, (16, 32), allow_cpu=True)
        pre.capture()
        r.prefill_graphs = pre
    return rt


def gpu_runtime(
    model, *, backend="cuda", num_blocks=64, max_num_tokens=128, dtype="float32", **config
):
    """A CUDA EngineRuntime of ``model`` = (spec, weights): 8 rows, 8-token blocks, prompts
    up to 64 tokens, activations in ``dtype``; ``config``: RuntimeConfig fields (the GPU
    tests of the runtime)."""
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig

    spec, weights = model
    limits = make_limits(
        max_batch_size=8,
        max_input_len=64,
        max_seq_len=128,
        max_num_tokens=max_num_tokens,
        tokens_per_block=8,
        dtype=dtype,
    )
    return EngineRuntime.from_weights(
        spec,
        weights,
        limits=limits,
        num_kv_blocks=num_blocks,
        device="cuda",
        backend=backend,
        config=RuntimeConfig(device="cuda", backend=backend, **config),
    )


def generate_checked(rt, sampling, lengths=(3, 11, 25, 40, 1), seed=0):
    """Random prompts of ``lengths`` tokens through a new Executor of ``rt``: every output
    ok and the KV pool whole and free afterwards; returns (outputs, executor)."""
    rng = random.Random(seed)
    vocab = rt.spec.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    ex = rt.executor()
    outs = ex.generate(prompts, sampling)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    rt.kv.check_invariants()
    assert rt.kv.num_free_blocks == rt.kv.total_blocks
    return outs, ex


def host_overhead_script():
    """scripts/host_overhead.py (its SimulatedDevice, builder and closed-loop driver), by path."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "host_overhead.py"
    spec = importlib.util.spec_from_file_location("llmc_host_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BlockAllocator:
    """Hands out block ids in a shuffled order; never frees (tests are short). Keeps the
    KVCacheManager's contract: an appended block bumps ``seq.block_table_version``."""

    def __init__(self, num_blocks: int, tokens_per_block: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tpb = tokens_per_block

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * self.tpb < num_tokens:
            seq.block_table.append(self.free.pop())
            seq.block_table_version += 1


def new_seq(rid: int, prompt: list[int], max_new: int, **sampling) -> Sequence:
    p = SamplingParams(max_new_tokens=max_new, **sampling)
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling=p,
        max_new_tokens=max_new,
        arrival_time=0.0,
    )


def prefill_batch(lengths, vocab: int, tokens_per_block: int, seed: int = 4) -> ScheduledBatch:
    """One prefill step of fresh sequences of ``lengths`` random prompt tokens, each on its
    own consecutive blocks of the pool (block tables set, nothing else allocated)."""
    rng = random.Random(seed)
    rows, block = [], 0
    for i, n in enumerate(lengths):
        s = new_seq(i, [rng.randrange(3, vocab) for _ in range(n)], 1)
        nb = -(-n // tokens_per_block)
        s.block_table, s.block_table_version = list(range(block, block + nb)), 1
        block += nb
        rows.append(ScheduledSequence(s, 0, n, True))
    return ScheduledBatch(0, tuple(rows))


@dataclass
class DriveResult:
    outputs: dict[int, list[int]]
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(request id, position of the last computed token) → logits predicting the next one."""
    num_steps: int = 0
    mixed_steps: int = 0
    """Steps that held a decode token and a prefill chunk together."""


def drive(
    runner: ModelRunner,
    seqs: list[Sequence],
    *,
    chunk: int,
    budget: int,
    start_every: int = 0,
    record_logits: bool = False,
    prefill_first: bool = True,
) -> DriveResult:
    """Run ``seqs`` to their max_new_tokens greedily (step()) or via forward_logits+argmax."""
    alloc = BlockAllocator(runner.kv_cache.num_blocks, runner.limits.tokens_per_block)
    res = DriveResult(outputs={s.request_id: s.output_token_ids for s in seqs})
    step = 0
    while any(len(s.output_token_ids) < s.max_new_tokens for s in seqs):
        active = [
            s
            for i, s in enumerate(seqs)
            if step >= i * start_every and len(s.output_token_ids) < s.max_new_tokens
        ]
        left, sched = budget, []
        for s in active:
            n = min(s.num_tokens - s.num_computed_tokens, chunk, left)
            if n <= 0:
                continue
            alloc.ensure(s, s.num_computed_tokens + n)
            sample = s.num_computed_tokens + n == s.num_tokens
            sched.append(ScheduledSequence(s, s.num_computed_tokens, n, sample))
            left -= n
        if prefill_first:  # the runner must reorder decode-first and answer in batch order
            sched.sort(key=lambda x: x.num_new_tokens == 1)
        batch = ScheduledBatch(step_id=step, sequences=tuple(sched))
        decodes = sum(x.is_decode for x in sched)
        res.mixed_steps += int(0 < decodes < len(sched))
        sampled = [x for x in sched if x.sample]
        if record_logits:
            logits = runner.forward_logits(batch)
            tokens = logits.argmax(dim=-1).tolist()
            for x, row in zip(sampled, logits, strict=True):
                res.logits[(x.seq.request_id, x.start_position + x.num_new_tokens - 1)] = row
        else:
            tokens = runner.step(batch).token_ids
        assert len(tokens) == len(sampled)
        for x in sched:
            x.seq.num_computed_tokens += x.num_new_tokens
        for x, t in zip(sampled, tokens, strict=True):
            x.seq.output_token_ids.append(t)
        step += 1
    res.num_steps = step
    return res


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]
