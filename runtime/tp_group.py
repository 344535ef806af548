"""``TPGroup``: the ranks of one tensor-parallel run as torch.distributed process groups of
their own (gloo on CPU, NCCL on GPUs), never the global default group, so one process may
load several engines one after another.

Two groups share one TCPStore (rank 0 hosts it): ``ctrl`` carries only the header of each
step message, which a follower may wait for as long as rank 0 has no work (a follower's
timeout on it is ``IDLE_TIMEOUT``, rank 0's the run's); ``data`` carries everything
else — the step's staged inputs, KV block copies, and the all-reduces of every layer — with
the run's ``timeout_s``. A rank that dies
closes its sockets, so the others fail at their next collective (at once, or after
``timeout_s`` when it hangs); every failure is an EngineError naming the rank it waited on
(``describe_peer`` of the launcher says which process exited and how).

``NO_MULTICAST_ENV`` keeps NVLink multicast off (NCCL, PyTorch symmetric memory, NVSHMEM):
set in this process before NCCL starts and in every process llmc spawns.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import torch

from llmc.base.errors import EngineError

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
IDLE_TIMEOUT = datetime.timedelta(days=7)
"""How long a follower waits for rank 0's next step (rank 0 may have no request for long)."""


def make_store(host: str, port: int, world_size: int, rank: int, timeout_s: float) -> object:
    """The TCPStore of a run: rank 0 hosts it (``port`` 0: a free one, then ``store.port``),
    the others connect within ``timeout_s`` (EngineError naming the address)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        raise EngineError(
            f"tensor-parallel rank {rank} of {world_size}: cannot reach the rendezvous at "
            f"{host}:{port} within {timeout_s:g} s: {str(e).splitlines()[0][:300]}"
        ) from None


def no_multicast_env() -> None:
    """Set ``NO_MULTICAST_ENV`` in this process (NCCL reads it when it starts)."""
    os.environ.update(NO_MULTICAST_ENV)


class TPGroup:
    """This process's rank among ``world_size`` and the two process groups (module doc)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: object,
        *,
        device: torch.device | str,
        timeout_s: float,
        describe_peer: Callable[[], str] | None = None,
    ) -> None:
        """Create the groups over ``store`` (``make_store``); waits at most ``timeout_s`` for
        the other ranks to join. ``describe_peer`` says which peer failed, when it knows."""
        import torch.distributed as dist

        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.timeout_s = timeout_s
        self.describe_peer = describe_peer
        timeout = datetime.timedelta(seconds=timeout_s)
        self.nccl = self.device.type == "cuda"
        if self.nccl:
            no_multicast_env()
        try:
            # a follower may wait for rank 0's next header as long as rank 0 is idle; rank
            # 0's side of it (the header reaching every rank) has the run's timeout
            idle = timeout if rank == 0 else IDLE_TIMEOUT
            self.ctrl = self._group(dist.PrefixStore("ctrl", store), idle)
            self.data = self._group(dist.PrefixStore("data", store), timeout)
        except (RuntimeError, OSError) as e:
            raise EngineError(
                f"tensor-parallel rank {rank} of {world_size}: the group did not form within "
                f"{timeout_s:g} s: {str(e).splitlines()[0][:300]}{self._peer()}"
            ) from None

    def _group(self, store: object, timeout: datetime.timedelta) -> object:
        import torch.distributed as dist

        if self.nccl:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        return dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)

    @property
    def peers(self) -> str:
        """The ranks this one waits on, in words."""
        if self.rank != 0:
            return "rank 0"
        others = [str(r) for r in range(1, self.world_size)]
        return f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(others)}"

    def _peer(self) -> str:
        said = self.describe_peer() if self.describe_peer is not None else ""
        return f" ({said})" if said else ""

    def _fail(self, what: str, e: BaseException) -> EngineError:
        return EngineError(
            f"tensor-parallel rank {self.rank}: {what} failed, {self.peers} stopped answering "
            f"(timeout {self.timeout_s:g} s){self._peer()}: {str(e).splitlines()[0][:300]}"
        )

    def _wait(self, work: object, what: str) -> None:
        try:
            work.wait()  # type: ignore[attr-defined]
        except RuntimeError as e:  # DistBackendError, gloo's closed connection or timeout
            raise self._fail(what, e) from None

    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` = the sum of every rank's ``t``, in place."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(self.data.allreduce([t], opts), "all-reduce")  # type: ignore[attr-defined]

    def broadcast(self, t: torch.Tensor, *, ctrl: bool = False) -> None:
        """``t`` = rank 0's ``t`` on every rank; ``ctrl`` for a step's header (a follower's
        wait for it may last as long as rank 0 is idle)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group = self.ctrl if ctrl else self.data
        self._wait(group.broadcast([t], opts), "broadcast")  # type: ignore[attr-defined]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of all ranks (the KV pool every rank can hold)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.data.allreduce([t], opts), "all-reduce")  # type: ignore[attr-defined]
        return int(t.item())
