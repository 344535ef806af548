"""The step messages of a tensor-parallel run: rank 0 (``StepLeader``) sends each step's
inputs, the other ranks (``follow``) run the same forward on their shard.

Rank 0 alone runs the Executor, the Scheduler and the KV manager; its ModelRunner stages a
step as always (``StepInputBuilder.prepare``: one host buffer), then broadcasts a header
and that one buffer (the staging device mirror: host memory on CPU, device memory under
NCCL). A follower copies the sections it needs (token ids, positions, slots, sequence
offsets and lengths, block tables) into its workspace with the same
``StepInputBuilder.place`` and runs ``ModelRunner.forward`` with no sampled row: every rank
then runs the same collectives (one all-reduce after o_proj and one after down, per layer)
in the same order. KV block copies (forks, beams) are sent as their own message, before
the step that needs them. Sampling, logprobs and lm_head's logits are rank 0's only.

Header (int64 ``[HEADER]``): op, then for a step: tokens, sequences, block-table width,
decode sequences, longest query, longest context, staged bytes, and each section's offset
in ``SECTIONS`` order; for a copy: the number of (src, dst) pairs.
"""

from __future__ import annotations

import torch

from llmc.base.errors import EngineError
from llmc.runtime.step_inputs import StepInputs
from llmc.runtime.tp_group import TPGroup
from llmc.runtime.workspace import Staging

OP_STOP, OP_STEP, OP_COPY = 0, 1, 2
SECTIONS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables")
HEADER = 8 + len(SECTIONS)


class StepLeader:
    """Rank 0's side: a step's inputs, block copies and the end of the run to the others."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self._header = torch.zeros(HEADER, dtype=torch.int64, device=group.device)
        self.stopped = False

    def _send_header(self, values: list[int]) -> None:
        h = self._header
        h.zero_()
        h[: len(values)] = torch.tensor(values, dtype=torch.int64)
        self.group.broadcast(h, ctrl=True)

    def send_step(self, inp: StepInputs, staging: Staging) -> None:
        """Broadcast the step ``staging`` holds (just uploaded by ``prepare``)."""
        a = inp.attn
        b, nb = a.block_tables.shape
        offsets = staging.offsets()
        head = [OP_STEP, inp.num_tokens, b, nb, a.num_decode_seqs, a.max_query_len]
        head += [a.max_seq_len, staging.used, *(offsets[s] for s in SECTIONS)]
        self._send_header(head)
        self.group.broadcast(staging.dev[: staging.used])

    def send_copies(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Broadcast KV block copies ``(src, dst)`` (made before the next step's writes)."""
        self._send_header([OP_COPY, len(copies)])
        pairs = torch.tensor(copies, dtype=torch.int64).to(self.group.device)
        self.group.broadcast(pairs)

    def stop(self) -> None:
        """Tell the followers the run is over (once; a failed group is left alone)."""
        if not self.stopped:
            self.stopped = True
            self._send_header([OP_STOP])


def follow(runner: object, group: TPGroup) -> None:
    """A follower's loop: receive and run rank 0's messages until it stops the run.
    ``runner`` is the rank's ModelRunner (reducing through ``group``)."""
    inputs = runner.inputs  # type: ignore[attr-defined]
    staging = inputs.staging
    header = torch.zeros(HEADER, dtype=torch.int64, device=group.device)
    while True:
        group.broadcast(header, ctrl=True)
        h = header.tolist()
        op = h[0]
        if op == OP_STOP:
            return
        if op == OP_COPY:
            pairs = torch.empty(h[1], 2, dtype=torch.int64, device=group.device)
            group.broadcast(pairs)
            runner._copy_blocks(tuple(map(tuple, pairs.tolist())))  # type: ignore[attr-defined]
            continue
        if op != OP_STEP:
            raise EngineError(f"tensor-parallel rank {group.rank}: unknown step message {op}")
        t, b, nb, num_decode, max_query, max_seq_len, used = h[1:8]
        if used > staging.capacity:
            raise EngineError(
                f"tensor-parallel rank {group.rank}: a step of {used} staged bytes exceeds "
                f"this rank's staging buffer ({staging.capacity}); the ranks' limits differ"
            )
        group.broadcast(staging.dev[:used])
        sizes = (t, t, t, b + 1, b, b * nb)
        dtypes = ("int64", "int64", "int64", "int32", "int32", "int32")
        offsets = h[8:]
        layout = {SECTIONS[i]: (offsets[i], sizes[i], dtypes[i]) for i in range(len(SECTIONS))}
        static, attn = inputs.place(
            staging.views(layout), b, nb, num_decode, max_query, max_seq_len
        )
        ws = inputs.workspace
        inp = StepInputs(
            num_tokens=t,
            num_sampled=0,
            sampled=[],
            attn=attn,
            input_ids=static["input_ids"],
            logits_indices=ws["logits_indices"][:0],
            sampling=None,
        )
        runner.forward(inp)  # type: ignore[attr-defined]
