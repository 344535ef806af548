"""A spawned rank of a tensor-parallel run (``python -P -m llmc.runtime.tp_worker SETTINGS``,
started by ``tp_launch.start_ranks``): it joins rank 0's rendezvous, loads the engine for
its rank (``EngineRuntime.load_rank``), runs ``tp_steps.follow`` until rank 0 stops the
run, and exits 0; on an error it prints it and exits with its code (a lost rank 0:
EngineError, 7)."""

from __future__ import annotations

import json
import sys

from llmc.base.errors import LlmcError
from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig, resolve_device
from llmc.runtime.tp_group import TPGroup, make_store
from llmc.runtime.tp_launch import TPRanks, set_gpu
from llmc.runtime.tp_steps import follow


def main(argv: list[str]) -> int:
    """A spawned rank: load its shard, follow rank 0 until the run stops; the exit code."""
    s = json.loads(argv[0])
    config = RuntimeConfig(**s["config"])
    rank, world = s["rank"], s["world_size"]
    try:
        device = resolve_device(config.device)
        set_gpu(device, rank)
        store = make_store(s["host"], s["port"], world, rank, config.tp_timeout_s)
        group = TPGroup(rank, world, store, device=device, timeout_s=config.tp_timeout_s)
        ranks = TPRanks(group, [], rank)
        rt = EngineRuntime.load_rank(s["engine_dir"], config, ranks)
        follow(rt.runner, group)
    except LlmcError as e:
        print(f"llmc: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
