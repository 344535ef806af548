"""Host time per engine step, measured on CPU: the real Executor, Scheduler, KVCacheManager and
ModelRunner over a no-op backend, so what is timed is only the host's work per step.

The model has Llama-3-8B's vocabulary and engine limits (tokens_per_block 32, max_seq_len
4096, so block tables are 128 blocks wide) but tiny layers whose ops do nothing; sampling
returns a fixed id (never EOS: requests run to ``--osl``). Two step paths:

- ``--path graph`` (default): decode-only steps go through ``DecodeGraphs`` with a replay
  that does nothing (the CUDA-graph path's host work: staging, replay call, id copy);
- ``--path eager``: every step through ``ModelRunner._prepare`` / ``_forward`` (no-op ops).

Prints µs per phase (median over the decode-only steps after a warm-up), as the profile's
phase table names them: schedule, prepare, forward, sample, update, and the whole step.

    .venv/bin/python scripts/host_overhead.py --batch 128 --isl 128 --osl 256
    .venv/bin/python scripts/host_overhead.py --batch 256 --async_scheduling --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from llmc.compiler.spec import ModelSpec
from llmc.runtime.cuda_graphs import DecodeGraphs
from llmc.runtime.executor import Executor
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.model_runner import ModelRunner
from llmc.runtime.responses import ExecutorParts
from llmc.runtime.scheduler import Scheduler, SchedulerConfig
from llmc.runtime.types import Request, SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "update")


class NoopBackend:
    """Backend whose ops return their output buffers untouched; ``sample`` returns id 7."""

    name = "noop"

    def __init__(self, max_rows: int) -> None:
        self._ids = torch.full((max_rows,), 7, dtype=torch.int64)

    def embedding(self, ids, table, out=None):
        return out

    def rms_norm(self, x, weight, eps, out=None):
        return out

    def add_rms_norm(self, x, residual, weight, eps, out=None):
        return out, residual

    def linear(self, x, weight, bias=None, out=None):
        return out

    def rope_and_cache_write(self, qkv, positions, cos, sin, k_cache, v_cache, slots, out=None):
        return out

    def attention(self, q, k_cache, v_cache, meta, out=None):
        return out

    def silu_and_mul(self, x, out=None):
        return out

    def sample(self, logits, meta):
        return self._ids[: logits.shape[0]]


class _NoopGraph:
    def replay(self) -> None:
        pass


class MockGraphs(DecodeGraphs):
    """DecodeGraphs on CPU whose 'graphs' replay nothing (host work of the graph path)."""

    def capture(self) -> None:
        r = self.runner
        for big in sorted(self.buckets, reverse=True):
            self._stage(big, None, [])
            self._layout[big] = list(r.staging._sections)
            self.graphs[big] = _NoopGraph()


def build(args: argparse.Namespace) -> Executor:
    spec = ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=8192,
    )
    shapes = spec.tensor_shapes()
    weights = {n: torch.zeros(s) for n, s in shapes.items()}
    tpb, max_seq = 32, 4096
    num_blocks = args.batch * (-(-(args.isl + args.osl) // tpb)) + 8
    runner = ModelRunner(
        spec,
        weights,
        backend=NoopBackend(args.batch),
        device="cpu",
        dtype="float32",
        max_num_tokens=8192,
        max_batch_size=args.batch,
        max_seq_len=max_seq,
        tokens_per_block=tpb,
        num_kv_blocks=num_blocks,
    )
    if args.path == "graph":
        graphs = MockGraphs(runner, allow_cpu=True)
        graphs.capture()
        runner.graphs = graphs
    kv = KVCacheManager(num_blocks, tpb, enable_block_reuse=True)
    sched = Scheduler(
        SchedulerConfig(
            max_num_tokens=8192,
            max_batch_size=args.batch,
            max_seq_len=max_seq,
            max_input_len=2048,
            tokens_per_block=tpb,
            eos_token_ids=(128001,),
        ),
        kv,
    )
    return Executor(
        ExecutorParts(runner, sched, spec.vocab_size), async_scheduling=args.async_scheduling
    )


def run(args: argparse.Namespace) -> dict[str, float]:
    ex = build(args)
    sp = SamplingParams(max_new_tokens=args.osl, temperature=args.temperature, top_k=args.top_k)
    for i in range(args.batch):
        ids = [(i * 7919 + j * 104729) % 128000 + 1 for j in range(args.isl)]
        ex.enqueue_request(Request(prompt_token_ids=ids, sampling=sp, streaming=args.streaming))
    t0 = time.perf_counter()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    while ex.step():
        ex.await_responses(timeout=0)  # drain responses as a client would
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    decode = [r for r in ex.step_records if r.num_prefill_tokens == 0][args.warmup :]
    out = {p: statistics.median(r.phase_times.get(p, 0.0) for r in decode) * 1e6 for p in PHASES}
    steps = [r.end_time - r.start_time for r in decode]
    out["step"] = statistics.median(steps) * 1e6
    out["decode_steps"] = len(decode)
    out["wall_s"] = wall
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--path", choices=("graph", "eager"), default="graph")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top_k", type=int, default=0)
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--async_scheduling", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = run(args)
    print(
        f"batch {args.batch}, isl {args.isl}, osl {args.osl}, path {args.path}, "
        f"async {args.async_scheduling}: {res['decode_steps']} decode steps, "
        f"wall {res['wall_s']:.2f} s"
    )
    print("µs per decode step: " + "  ".join(f"{p} {res[p]:.0f}" for p in (*PHASES, "step")))


if __name__ == "__main__":
    main()
