"""``Profiler``: ``llmc profile``'s report for any stretch of Python code that uses an ``LLM``.

    profiler = Profiler()          # or Profiler(llm)
    profiler.start()
    llm.generate(...)              # anything: generate, generate_async, enqueue_request
    profiler.stop()
    profiler.print()               # the Rich tables of `llmc profile`
    profiler.summary()             # the same numbers as a dict
    profiler.export_chrome_trace("trace.json")

The front door of the one profiler: ``Profiler`` picks the LLM and says what went wrong in
its own words; the measuring is ``llmc profile``'s own ``ProfileSession``
(runtime/bench/profiling.py). Nothing is re-timed: between ``start`` and ``stop`` it reads
the engine's own StepRecords and RequestRecords (those of requests that arrived in the
window) and attaches op timing — wall-clock hooks on the backend's ops on CPU,
``torch.profiler`` CUDA kernels on a GPU. The tables are runtime/bench/profile_report.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmc.base.errors import ConfigError
from llmc.runtime.bench.profiling import ProfileSession

if TYPE_CHECKING:
    from llmc.api import LLM


class Profiler:
    """Profile what one ``LLM`` does between ``start()`` and ``stop()``.

    ``llm``: the LLM to watch; None means the only LLM alive at ``start()`` (an error when
    there is none or several). ``ops``: also time backend ops / CUDA kernels (on by default;
    it adds a little overhead per op on CPU). Usable as a context manager.
    """

    def __init__(self, llm: LLM | None = None, *, ops: bool = True) -> None:
        self.llm = llm
        self.ops = ops
        self._session: ProfileSession | None = None

    # ---- recording -----------------------------------------------------------------------
    def _pick(self) -> LLM:
        if self.llm is not None:
            if self.llm.closed:
                raise ConfigError("Profiler: the LLM it was given has been shut down")
            return self.llm
        from llmc.api import live_llms

        live = live_llms()
        if len(live) != 1:
            raise ConfigError(
                f"Profiler() found {len(live)} running LLMs; create the LLM before start(), "
                "or pass it: Profiler(llm)"
            )
        return live[0]

    def start(self) -> Profiler:
        """Begin the window (and op timing). Starting again discards the previous window."""
        if self.running:
            raise ConfigError("Profiler.start(): already started; call stop() first")
        self._session = ProfileSession(self._pick(), ops=self.ops).start()
        return self

    @property
    def running(self) -> bool:
        return self._session is not None and self._session.running

    def stop(self) -> Profiler:
        """End the window: collect the steps, requests and op events recorded in it."""
        if not self.running:
            raise ConfigError("Profiler.stop(): not started; call start() first")
        assert self._session is not None
        self._session.stop()
        return self

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.running:
            self.stop()

    def _recorded(self, what: str) -> ProfileSession:
        if self._session is None or self._session.window is None:
            raise ConfigError(f"Profiler.{what}(): nothing recorded; call start() and stop()")
        return self._session

    # ---- results -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The window's numbers: ``aggregates`` (throughput, TTFT/TPOT/ITL/E2E, KV and batch,
        as ``llmc bench``), ``phases``, ``op_families``, ``ops``, ``peak_memory``, ``gpu_idle``,
        ``recommendations`` (the keys of ``llmc profile``'s ``profile`` section), the settings
        and limits in use (``runtime``) and ``window_s``."""
        return self._recorded("summary").summary()

    def print(self, console: Any = None) -> None:
        """Print the tables of ``llmc profile`` for the window (to stdout, or ``console``)."""
        from rich.console import Console

        from llmc.runtime.bench.profile_report import render_profile

        s = self._recorded("print")
        agg = s.aggregates()
        result = {"aggregates": agg.to_dict()}
        render_profile(console or Console(), result, s.report(agg), s.steps, s.engine)

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write the window as a Chrome/Perfetto trace (steps with nested ops, phases, KV
        utilization and running batch counters, GPU kernels); returns the path."""
        return self._recorded("export_chrome_trace").write_trace(path)
