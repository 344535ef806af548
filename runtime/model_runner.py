"""ModelRunner: one engine step on a Backend — flattened tokens in, sampled token ids out.

Per ``step(batch)``:
1. prepare (``llmc.runtime.step_inputs``): check the batch, order the sequences decode-first,
   flatten their new tokens with no padding, stage positions, cache slots, block tables,
   the rows to sample and the sampling columns with ONE host→device copy, then copy each
   section into its static workspace buffer (device-to-device).
2. forward: embed → per layer [norm, qkv, rope + KV write, paged attention, o_proj,
   add+norm, gate_up, silu·mul, down, (add+norm fused with the next layer's norm)] →
   final add+norm → gather the sampled rows → lm_head (embed_tokens when tied) → logits.
   Steps of at most ``backend.fused_decode_max_tokens`` tokens run fused small-batch ops
   instead (norm+qkv, o_proj+add, norm+gate_up+SiLU, down+add; see ``forward``). An engine
   with fp8 weights runs the W8A8 ops (``llmc.runtime.layers`` holds every layer sequence);
   one with weight-only packed weights (int8_wo, int4_wo, a GGUF kept native) runs the
   activation-dtype sequence with ``PackedWeight``s in place of the weight tensors.
   Every op writes into a view of the workspace arena (the memory plan's offsets).
3. sample: ``backend.sample`` → ``sampled_ids``; ONE device→host copy returns the ids (and,
   when a row asked for them, the log-probabilities packed in the same copy). A prefill
   step with rows that score prompt tokens (``prompt_logprobs``) then runs lm_head over
   them in slices of the logits workspace (``llmc.runtime.prompt_logprobs``: forward keeps
   their hidden states after the final norm) and reads the packed entries back.

After ``capture_cuda_graphs()``, decode-only steps (one new token per sequence, plain
sampling) instead replay the CUDA graph of their batch-size bucket
(``llmc.runtime.cuda_graphs.DecodeGraphs``, built on the runner's StepInputBuilder,
``forward`` and backend): one staging copy, one graph launch, one copy of the ids. With
``prefill_max_tokens``, a step of one sequence's last prompt chunk of up to that many tokens
replays a prefill graph of its token-count bucket the same way
(``llmc.runtime.prefill_graphs.PrefillGraphs``: the idle engine's time to first token).
With ``piecewise_max_tokens``, the other steps of more than ``fused_decode_max_tokens``
tokens run their layers as captured pieces with the attentions between them launched
eagerly (``llmc.runtime.piecewise_graphs.PiecewiseGraphs``); their head and sampling stay
eager.

A multi-step window (``ScheduledBatch.window``, ``--decode_steps_per_iteration``) is staged
once and runs K forward + sample steps (or K replays of its bucket's graph), each followed by
the device-side token feedback of ``llmc.runtime.decode_window``; its ids come back with one
copy, per row (``StepOutput.window_token_ids``).

Invariants: tokens are returned in the batch's order (one per sequence with ``sample``);
the KV-cache tensors (``kv_cache``) are written only at the step's slots; on CUDA the only
synchronisation is the final device→host copy, so ``phase_times['forward']`` measures
launch time there and ``'sample'`` includes waiting for the device. Nothing is allocated on
the device inside a step except torch-internal temporaries of the reference ops and, only
when a row uses them, penalty counts and logprobs (documented in llmc.runtime.sampling) and
the scored prompt rows' hidden states (llmc.runtime.prompt_logprobs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from llmc.base.errors import EngineError
from llmc.compiler.limits import EngineLimits, check_positive_int
from llmc.compiler.memory_plan import PlannedBuffer, plan_workspace
from llmc.compiler.quantization import check_engine_tensors, engine_tensors, kv_cache_dtype
from llmc.compiler.spec import ModelSpec
from llmc.compiler.wo_layout import OFFSET_SUFFIX, WeightLayout
from llmc.compiler.wo_weights import packed_from_tensors
from llmc.cuda.backend import Backend
from llmc.runtime import beam_search
from llmc.runtime import prompt_logprobs as plp
from llmc.runtime import sampling as smp
from llmc.runtime.branches import BranchStep
from llmc.runtime.cuda_graphs import DecodeGraphs
from llmc.runtime.decode_window import WindowState, window_span
from llmc.runtime.kv_tensors import KVCacheTensors, allocate_kv_cache
from llmc.runtime.layers import DecoderLayers
from llmc.runtime.piecewise_graphs import PiecewiseGraphs, piecewise_buckets
from llmc.runtime.prefill_graphs import PrefillGraphs, prefill_buckets
from llmc.runtime.rope import cos_sin_tables
from llmc.runtime.step_inputs import StepInputBuilder, StepInputs
from llmc.runtime.tp_steps import StepLeader
from llmc.runtime.types import RequestFault, ScheduledBatch
from llmc.runtime.workspace import TORCH_DTYPES, Workspace


@dataclass
class StepOutput:
    """Result of one step: one token per sampled sequence, in the batch's order."""

    token_ids: list[int]
    logprobs: list[smp.TokenLogprobs | None] | None = None
    prompt_logprobs: list[plp.PromptSpan] | None = None
    """The prompt-logprob entries this step computed (``prompt_logprobs``), else None."""
    branch_steps: list[BranchStep] = field(default_factory=list)
    """Forks and beam steps of requests with several sequences (``llmc.runtime.beam_search``)."""
    window_token_ids: list[list[int]] | None = None
    """A multi-step window: each row's tokens, in the batch's order (``token_ids`` empty)."""
    phase_times: dict[str, float] = field(default_factory=dict)
    """Seconds of 'prepare', 'forward' and 'sample' (prompt logprobs included)."""


class ModelRunner:
    """Runs ScheduledBatches of one model on one Backend from static buffers."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        *,
        backend: Backend,
        device: torch.device | str,
        limits: EngineLimits,
        num_kv_blocks: int,
        workspace: tuple[PlannedBuffer, ...] | None = None,
        layouts: Mapping[str, WeightLayout] | None = None,
        reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``workspace``: the arena layout (a memory plan's buffers, planned for ``limits``);
        None: the memory planner's for ``limits`` (``llmc.compiler.memory_plan``).
        ``layouts``: the weight-only packed engine tensors (``LoadedEngine.layouts``), which
        the runner holds as ``PackedWeight``s; every op takes one where it takes a weight.
        ``reduce``: one tensor-parallel rank's (``TPGroup.all_reduce``; ``spec`` and
        ``weights`` are then the rank's, ``compiler/tp_layout.py``); on rank 0, ``leader``
        (a ``StepLeader``, set by the EngineRuntime) sends each step to the other ranks."""
        check_positive_int("num_kv_blocks", num_kv_blocks)
        self.spec = spec
        self.backend = backend
        self.device = torch.device(device)
        self.limits = limits
        self.layouts = dict(layouts or {})
        self.weights = self._load_weights(weights)
        kv_dtype = TORCH_DTYPES[kv_cache_dtype(limits)]  # e4m3 for an fp8 cache
        self.kv_cache: KVCacheTensors = allocate_kv_cache(
            spec, num_kv_blocks, limits.tokens_per_block, kv_dtype, self.device
        )
        self.cos, self.sin = cos_sin_tables(spec, limits.max_seq_len, self.device)
        if workspace is None:
            workspace = plan_workspace(spec, limits)
        self.workspace = Workspace(workspace, self.device)
        self.layers = DecoderLayers(
            spec, self.weights, limits, backend, self.kv_cache, (self.cos, self.sin),
            self.workspace, reduce,
        )  # fmt: skip
        self.leader: StepLeader | None = None
        self.inputs = StepInputBuilder(spec, self.workspace, self.device, limits)
        pin = self.device.type == "cuda"
        # two read-back buffers: step N+1 may be launched before step N's ids are read
        self._host_ids = torch.empty(2, limits.max_batch_size, dtype=torch.int64, pin_memory=pin)
        self._launches = 0
        self._unread = 0  # launched steps whose ids were not read back yet
        self.graphs: DecodeGraphs | None = None  # once captured
        self.prefill_graphs: PrefillGraphs | None = None  # once captured (optional)
        self.piecewise: PiecewiseGraphs | None = None  # once captured (optional)
        self.window: WindowState | None = None  # multi-step decoding's, once needed

    def capture_cuda_graphs(
        self,
        buckets: tuple[int, ...] | None = None,
        decode_steps_per_iteration: int = 1,
        prefill_max_tokens: int = 0,
        piecewise_max_tokens: int = 0,
    ) -> float:
        """Capture decode-only CUDA graphs per batch-size bucket (default
        ``cuda_graphs.default_buckets``); later decode-only steps replay them. Returns the
        capture time in seconds. Needs a CUDA device and a backend whose launches are
        capturable (the CudaBackend). ``decode_steps_per_iteration`` > 1: multi-step
        windows of up to that many steps replay them too, with a captured token feedback
        (``llmc.runtime.decode_window``). ``prefill_max_tokens`` > 0: also one-sequence
        prefill graphs up to that many tokens (``llmc.runtime.prefill_graphs``).
        ``piecewise_max_tokens`` > 0: also the piecewise graphs of the other steps up to
        that many tokens (``llmc.runtime.piecewise_graphs``)."""
        if decode_steps_per_iteration > 1:
            self.window = WindowState(self.limits, self.device, decode_steps_per_iteration)
        graphs = DecodeGraphs(self.inputs, self.forward, self.backend, buckets, window=self.window)
        graphs.capture()
        self.graphs = graphs
        seconds = graphs.capture_seconds
        fused = int(getattr(self.backend, "fused_decode_max_tokens", 0))
        sizes = prefill_buckets(prefill_max_tokens, fused, self.limits.max_num_tokens)
        if sizes:
            pre = PrefillGraphs(self.inputs, self.forward, self.backend, sizes)
            pre.capture(graphs.pool)
            self.prefill_graphs = pre
            seconds += pre.capture_seconds
        sizes = piecewise_buckets(piecewise_max_tokens, fused, self.limits.max_num_tokens)
        if sizes:
            pw = PiecewiseGraphs(self.inputs, self.embed, self.layers, sizes)
            pw.capture(graphs.pool)
            self.piecewise = pw
            seconds += pw.capture_seconds
        return seconds

    # ---- set-up --------------------------------------------------------------------
    def _load_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The engine tensors on the device: those of the activation dtype cast to it (a
        float tensor of another precision is accepted), fp8 codes and float32 scales kept
        as they are, weight-only codes, scales and offsets joined into one ``PackedWeight``
        under the weight's name (``quantization.engine_tensors``; EngineError naming a
        tensor that does not match)."""
        lay = self.layouts
        check_engine_tensors(
            weights, self.spec, self.limits, "engine weights", cast_ok=True, layouts=lay
        )
        out: dict[str, Any] = {}
        for name, (_, dtype) in engine_tensors(self.spec, self.limits, lay).items():
            w = weights[name]
            dt = torch.uint8 if dtype == "uint8" else TORCH_DTYPES[dtype]
            out[name] = w.to(device=self.device, dtype=dt).contiguous()
        for name, layout in lay.items():
            out[name] = packed_from_tensors(out, name, layout)
            out.pop(name + "_scale")
            out.pop(name + OFFSET_SUFFIX, None)
        if self.spec.tie_word_embeddings:
            out["lm_head"] = out["embed_tokens"]
        return out

    # ---- forward -------------------------------------------------------------------
    def forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Run the layers on inputs ``self.inputs`` prepared; returns logits [S, V] float32
        (a workspace view) or None if S = 0. Captured as is by the CUDA graphs.

        Steps of ``0 < T <= backend.fused_decode_max_tokens`` tokens (attribute absent = 0)
        run each layer as norm_linear (input norm + qkv), rope + KV write, attention,
        linear_residual_add (o_proj, into residual in place), norm_gate_up_silu (post-attn
        norm + gate_up + SiLU·mul), linear_residual_add (down) and end with rms_norm of the
        residual; the unfused path defers each residual add into the next add+norm. Both
        compute the same values (every intermediate rounded to the dtype). The layers' op
        sequences (and their fp8 forms) are ``DecoderLayers``'s (runtime/layers.py).
        """
        t = inp.num_tokens
        # tensor parallelism reduces between o_proj / down and their residual add: unfused
        fused = 0 < t <= getattr(self.backend, "fused_decode_max_tokens", 0)
        fused = fused and self.layers.reduce is None
        self.embed(inp.input_ids, t)
        self.layers.run(inp, fused)  # runtime/layers.py: the activation-dtype or fp8 sequence
        return self.head(inp, fused)

    def embed(self, input_ids: torch.Tensor, rows: int) -> None:
        """The step's token embeddings into the first ``rows`` rows of ``residual``."""
        residual = self.workspace["residual"][:rows]
        self.backend.embedding(input_ids, self.weights["embed_tokens"], out=residual)

    def head(self, inp: StepInputs, fused: bool) -> torch.Tensor | None:
        """After the layers: the final norm, the sampled rows' gather and lm_head → logits
        [S, V] float32 (a workspace view), None if S = 0; the scored prompt rows' hidden
        states kept (``inp.prompt``). ``fused``: the layers ran the fused small-step path
        (the residual holds every add)."""
        be, w, ws, spec = self.backend, self.weights, self.workspace, self.spec
        t, s = inp.num_tokens, inp.num_sampled
        eps = spec.rms_norm_eps
        residual, normed, proj_out = ws["residual"][:t], ws["normed"][:t], ws["proj_out"][:t]
        prompt = inp.prompt
        if s == 0 and prompt is None:
            return None
        if fused:  # the residual already holds every add
            be.rms_norm(residual, w["final_norm"], eps, out=normed)
        else:
            be.add_rms_norm(proj_out, residual, w["final_norm"], eps, out=normed)
        if prompt is not None:  # copied out: lm_head's logits may reuse normed's bytes
            prompt.hidden = normed.index_select(0, prompt.index)
        if s == 0:
            return None
        last_hidden = ws["last_hidden"][:s]
        torch.index_select(normed, 0, inp.logits_indices, out=last_hidden)
        logits = ws["logits"][:s]
        be.linear(last_hidden, w["lm_head"], out=logits)
        return logits

    # ---- public --------------------------------------------------------------------
    def forward_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [S, V] float32 of the sampled rows (batch order); a copy (for tests)."""
        inp = self._prepare(batch)
        logits = self._forward(inp)
        if logits is None:
            return torch.empty(0, self.spec.vocab_size, device=self.device)
        return logits.clone()

    def _forward(self, inp: StepInputs) -> torch.Tensor | None:
        """``forward`` of an eager step, its layers as the piecewise graphs when they serve
        it (``PiecewiseGraphs.can_run``); the same logits."""
        pw = self.piecewise
        if pw is not None and pw.can_run(inp):
            pw.run(inp)
            return self.head(inp, fused=False)
        return self.forward(inp)

    def step(self, batch: ScheduledBatch) -> StepOutput:
        """Compute one step; return the sampled token of each ``sample`` sequence."""
        return self.launch(batch).result()

    def launch(self, batch: ScheduledBatch, src_rows: list[int] | None = None) -> PendingStep:
        """Start one step on the device and return without waiting for its sampled ids.

        ``src_rows`` (async scheduling): a decode-only batch scheduled before the previous
        step's tokens reached the host; row ``i``'s input is row ``src_rows[i]`` of the
        previous step's sampled ids, which stay on the device. At most two launched steps
        may be unread (``PendingStep.result()``) at a time.
        """
        if self._unread >= 2:
            raise EngineError("two launched steps are unread; call result() on the older one")
        if batch.is_empty:
            return PendingStep(self, None, None, {}, token_ids=[])
        if batch.block_copies:  # copy-on-write of forked sequences' last blocks, first
            if self.leader is not None:
                self.leader.send_copies(batch.block_copies)
            self._copy_blocks(batch.block_copies)
        if batch.window is not None:
            return self._launch_window(batch)
        if self.graphs is not None and self.graphs.can_run(batch):
            t0 = time.perf_counter()
            b, big = self.graphs.stage(batch, src_rows)
            t1 = time.perf_counter()
            self.graphs.replay(big)
            return self._replayed(b, t0, t1)
        pre = self.prefill_graphs
        if pre is not None and src_rows is None and pre.can_run(batch):
            t0 = time.perf_counter()
            big = pre.stage(batch)
            t1 = time.perf_counter()
            pre.replay(big)
            return self._replayed(1, t0, t1)
        t0 = time.perf_counter()
        inp = self._prepare(batch, src_rows)
        t1 = time.perf_counter()
        logits = self._forward(inp)
        t2 = time.perf_counter()
        times: dict[str, Any] = {"prepare": t1 - t0, "forward": t2 - t1}
        pending = self._sample(inp, logits, times, batch.branching)
        times["sample"] = time.perf_counter() - t2  # sampling launch; result() adds the wait
        if inp.prompt is not None:  # after the sampler: the slices reuse the logits rows
            packed = plp.score(
                self.backend, inp.prompt, self.weights["lm_head"], self.workspace["logits"]
            )
            try:
                pending.prompt_logprobs = plp.unpack(inp.prompt, packed.tolist())
            except RequestFault:  # the Executor runs the step again without that request
                pending.result()  # (its ids are read and dropped: no unread step is left)
                raise
            times["sample"] = time.perf_counter() - t2
        return pending

    def _replayed(self, n: int, t0: float, t1: float) -> PendingStep:
        """The PendingStep of a replayed graph staged from ``t0`` to ``t1``: its first
        ``n`` sampled ids on their way to the host."""
        pending = self._read_back_ids(n, {"prepare": t1 - t0})
        pending.times["forward"] = time.perf_counter() - t1
        return pending

    def _prepare(self, batch: ScheduledBatch, src_rows: list[int] | None = None) -> StepInputs:
        """``inputs.prepare``; under tensor parallelism the staged step goes to the other
        ranks too (``StepLeader.send_step``), which then run the same forward."""
        inp = self.inputs.prepare(batch, src_rows)
        if self.leader is not None:
            self.leader.send_step(inp, self.inputs.staging)
        return inp

    def _launch_window(self, batch: ScheduledBatch) -> PendingStep:
        """Start a multi-step window (``ScheduledBatch.window``): its inputs staged once,
        then K times forward + sample (or the bucket's CUDA graph) and the device-side
        token feedback (``WindowState.advance``); one copy of the ids at the end."""
        assert batch.window is not None
        k, eos = batch.window.num_steps, batch.window.eos_token_ids
        win = self.window
        if win is None or win.max_steps < k:  # (graphs keep theirs: this window runs eagerly)
            win = self.window = WindowState(self.limits, self.device, k)
        t0 = time.perf_counter()
        span = window_span(batch.sequences, k)
        graphs = self.graphs
        if graphs is not None and graphs.window is win and graphs.can_run(batch):
            b, big = graphs.stage(batch, None, span)
            win.stage(batch.sequences, big, eos, span)
            t1 = time.perf_counter()
            for _ in range(k):
                graphs.replay(big)
                graphs.advance(big)
        else:
            inp = self.inputs.prepare(batch, None, span)
            b = inp.num_sampled
            win.stage(batch.sequences, b, eos, span)
            t1 = time.perf_counter()
            attn, meta = inp.attn, inp.sampling
            assert meta is not None and b == len(batch.sequences)
            sampled = self.workspace["sampled_ids"][:b]
            feed = {
                "input_ids": inp.input_ids,
                "positions": attn.positions,
                "slot_mapping": attn.slot_mapping,
                "seq_lens": attn.seq_lens,
                "offsets": meta.offsets,
            }
            for j in range(k):  # step j's longest context is the first's + j
                step = dataclasses.replace(attn, max_seq_len=attn.max_seq_len + j)
                logits = self.forward(dataclasses.replace(inp, attn=step))
                assert logits is not None
                sampled.copy_(self.backend.sample(logits, meta))
                win.advance(b, sampled, feed, attn.block_tables)
        host, event = win.read_back(k)
        self._unread += 1
        times = {"prepare": t1 - t0, "forward": time.perf_counter() - t1}
        return PendingStep(self, host, event, times, window=(win, b))

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """KV blocks ``dst = src`` in every layer (K and V), before the step writes."""
        st = self.kv_cache.storage  # [L, 2, num_blocks, tokens_per_block, nkv, hd]
        pairs = torch.tensor(copies, dtype=torch.int64, device=self.device)  # [c, 2]
        src, dst = pairs[:, 0], pairs[:, 1]
        st[:, :, dst] = st[:, :, src]

    def _sample(
        self, inp: StepInputs, logits: torch.Tensor | None, times: dict, branching: bool = False
    ) -> PendingStep:
        """Sample the step's rows from ``logits``; the ids (and logprobs) of a PendingStep.
        A ``branching`` step (forks, beams) samples through ``llmc.runtime.beam_search``."""
        if logits is None or inp.sampling is None:
            return PendingStep(self, None, None, times, token_ids=[])
        if branching:
            ids, lps, steps = beam_search.branch_sample(
                self.backend, logits, inp.sampled, self.spec.vocab_size
            )
            pending = PendingStep(self, None, None, times, token_ids=ids, logprobs=lps)
            pending.branch_steps = steps
            return pending
        s, meta = inp.num_sampled, inp.sampling
        smp.apply_logit_bias(logits, inp.sampled)
        smp.suppress_stop_ids(logits, inp.sampled)  # min_tokens
        ids = self.backend.sample(logits, meta)
        out_ids = self.workspace["sampled_ids"][:s]
        out_ids.copy_(ids)
        if meta.num_logprobs is not None:
            packed = smp.logprob_tensor(logits, meta, out_ids, meta.num_logprobs).cpu().tolist()
            token_ids = [int(row[0]) for row in packed]
            logprobs = smp.unpack_logprobs(packed, [x.seq for x in inp.sampled])
            return PendingStep(self, None, None, times, token_ids=token_ids, logprobs=logprobs)
        return self._read_back_ids(s, times)

    def _read_back_ids(self, n: int, times: dict[str, Any]) -> PendingStep:
        """Start the device→host copy of the first ``n`` sampled ids (pinned buffer, event)."""
        host = self._host_ids[self._launches % 2, :n]
        self._launches += 1
        src = self.workspace["sampled_ids"][:n]
        if self.device.type == "cuda":
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(src)
            event = None
        self._unread += 1
        return PendingStep(self, host, event, times)


class PendingStep:
    """A launched step: ``result()`` waits for its sampled ids (once) → StepOutput."""

    def __init__(
        self,
        runner: ModelRunner,
        host: torch.Tensor | None,
        event: Any,
        times: dict[str, Any],
        *,
        token_ids: list[int] | None = None,
        logprobs: list[smp.TokenLogprobs | None] | None = None,
        window: tuple[WindowState, int] | None = None,
    ) -> None:
        """``window``: a multi-step window's (state, rows); ``host`` is its [K, rows] ids."""
        self._runner, self._host, self._event = runner, host, event
        self._window = window
        self.times = times
        self._ids, self._logprobs = token_ids, logprobs
        self.prompt_logprobs: list[plp.PromptSpan] | None = None
        """Set by ``ModelRunner.launch`` when the step scored prompt tokens."""
        self.branch_steps: list[BranchStep] = []
        """Set by ``ModelRunner._sample`` on a branching step (forks, beam steps)."""
        self._out: StepOutput | None = None

    def result(self) -> StepOutput:
        if self._out is None:
            ids, window_ids = self._ids, None
            if ids is None:  # wait for the ids' device→host copy
                t0 = time.perf_counter()
                if self._event is not None:
                    self._event.synchronize()
                assert self._host is not None
                if self._window is not None:
                    win, rows = self._window
                    window_ids = win.row_tokens(self._host, rows)
                    ids = []
                else:
                    ids = self._host.tolist()
                self._runner._unread -= 1
                self.times["sample"] = self.times.get("sample", 0.0) + time.perf_counter() - t0
            self._out = StepOutput(
                token_ids=ids,
                window_token_ids=window_ids,
                logprobs=self._logprobs,
                prompt_logprobs=self.prompt_logprobs,
                branch_steps=self.branch_steps,
                phase_times=self.times,
            )
        return self._out
