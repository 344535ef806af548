"""Starting the ranks of a tensor-parallel engine: spawned by llmc on one host, or joined
under ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

Spawned: the loading process is rank 0; it hosts the rendezvous on a free port of
127.0.0.1 and starts ranks 1..N-1 as ``python -P -m llmc.runtime.tp_worker SETTINGS``
(environment: this one's plus ``NO_MULTICAST_ENV``; runtime/tp_worker.py).
``TPRanks.describe_peer`` names a spawned rank that exited and its exit code, so rank
0's error says which rank died. ``TPRanks.close`` stops the followers (waiting at most the
timeout, then killing them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from llmc.base.errors import ConfigError, EngineError
from llmc.runtime.tp_group import NO_MULTICAST_ENV, TPGroup, make_store, no_multicast_env
from llmc.runtime.tp_steps import StepLeader

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
HOST = "127.0.0.1"
EXIT_GRACE_S = 0.5
"""How long a failed collective waits for a spawned rank to be reaped, to name how it ended."""


@dataclass
class TPRanks:
    """This process's place in a tensor-parallel run and the ranks it spawned."""

    group: TPGroup
    procs: list[subprocess.Popen] = field(default_factory=list)
    """Ranks 1..N-1 when this process spawned them (rank r at index r - 1), else empty."""
    local_rank: int = 0
    """The GPU of this rank on its host."""

    @property
    def rank(self) -> int:
        return self.group.rank

    def describe_peer(self) -> str:
        return exited(self.procs)

    def close(self, leader: StepLeader | None) -> None:
        """Stop the run: the followers are told (when the group still works), then waited
        for at most the timeout, then killed."""
        if leader is not None:
            try:
                leader.stop()
            except EngineError:
                pass  # a follower is gone already: the rest end on their closed connection
        for p in self.procs:
            try:
                p.wait(timeout=self.group.timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def exited(procs: list[subprocess.Popen]) -> str:
    """The spawned ranks (rank r at index r - 1) that have exited, with their exit codes
    (empty: none known)."""
    gone = []
    for r, p in enumerate(procs, start=1):
        try:  # a killed rank's sockets close just before it can be reaped: wait a moment
            p.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
        gone.append(f"rank {r} (pid {p.pid}) exited with code {p.returncode}")
    return "; ".join(gone)


def torchrun_rank(environ: Mapping[str, str], tp_size: int) -> tuple[int, int, str, int] | None:
    """(rank, world size, master address, port) under torchrun, else None. A WORLD_SIZE that
    is not the engine's tp_size, or a missing or malformed variable, is a ConfigError."""
    if "WORLD_SIZE" not in environ:
        return None
    missing = [k for k in TORCHRUN_KEYS if not environ.get(k)]
    if missing:
        raise ConfigError(f"torchrun environment: {', '.join(missing)} not set")
    try:
        rank, world, port = (int(environ[k]) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    except ValueError:
        raise ConfigError(
            "torchrun environment: RANK, WORLD_SIZE and MASTER_PORT must be integers"
        ) from None
    if world != tp_size:
        raise ConfigError(
            f"torchrun started {world} processes (WORLD_SIZE) but the engine has tp_size "
            f"{tp_size}: start one process per rank"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"torchrun environment: RANK {rank} is outside 0..{world - 1}")
    return rank, world, environ["MASTER_ADDR"], port


def start_ranks(engine_dir: str, tp_size: int, config: Any, device: str) -> TPRanks:
    """Join (torchrun) or start (spawn) the run's ranks; returns this process's TPRanks
    once every rank has joined (EngineError naming a rank that did not, within the
    timeout). ``config`` is the RuntimeConfig every rank loads with."""
    timeout = float(config.tp_timeout_s)
    joined = torchrun_rank(os.environ, tp_size)
    if device == "cuda":
        no_multicast_env()
    if joined is not None:
        rank, world, host, port = joined
        local = int(os.environ.get("LOCAL_RANK", rank))
        set_gpu(device, local)
        store = make_store(host, port, world, rank, timeout)
        return TPRanks(TPGroup(rank, world, store, device=device, timeout_s=timeout), [], local)
    store = make_store(HOST, 0, tp_size, 0, timeout)
    port = store.port  # type: ignore[attr-defined]
    env = {**os.environ, **NO_MULTICAST_ENV}
    procs = []
    for rank in range(1, tp_size):
        settings = {
            "engine_dir": str(engine_dir),
            "config": asdict(config),
            "rank": rank,
            "world_size": tp_size,
            "host": HOST,
            "port": port,
        }
        cmd = [sys.executable, "-P", "-m", "llmc.runtime.tp_worker", json.dumps(settings)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
    try:
        group = TPGroup(
            0, tp_size, store, device=device, timeout_s=timeout,
            describe_peer=lambda: exited(procs),
        )  # fmt: skip
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return TPRanks(group, procs, 0)


def set_gpu(device: str, local_rank: int) -> None:
    """Rank ``local_rank``'s GPU of this host is the current device (nothing on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.set_device(local_rank)
