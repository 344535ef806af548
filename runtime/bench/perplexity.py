"""Perplexity of a served engine over a text (``llmc eval``), from its own prompt logprobs.

The text file is read (a bounded, regular, UTF-8 text file) and tokenized once with the
engine's tokenizer, then cut into windows of ``window`` tokens (default: the longest prompt
the engine takes with room for one generated token) starting every ``stride`` tokens
(default ``window``: non-overlapping), as in the stride loop of transformers' perplexity
guide. Each window runs as one prompt with ``prompt_logprobs=0`` and ``max_new_tokens=1``
(teacher forcing: the engine scores every prompt token given the ones before it), and all
windows are enqueued together, so the engine batches them in flight.

A window scores the tokens no earlier window scored: positions ``max(prev_end, begin + 1)``
to ``end - 1`` (the first token of a window has no context inside it, so with the default
stride the first token of every window is not scored), exactly the labels the guide's loop
leaves unmasked. Perplexity is ``exp(mean NLL)`` over every scored token, the NLL summed in
float64 from the engine's float32 logprobs.

Invariants: every refusal is an llmc error naming the input (the text file: UsageError;
window, stride and max_windows out of range: ConfigError naming the engine limit); a window
the engine fails raises that request's error class; a non-finite logprob is an EngineError.
"""

from __future__ import annotations

import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from llmc.base.errors import ConfigError, EngineError, UsageError, error_class
from llmc.compiler.limits import EngineLimits
from llmc.runtime.bench.served import Served
from llmc.runtime.types import Request, SamplingParams

SCHEMA = "llmc.eval"
SCHEMA_VERSION = 1
MAX_TEXT_BYTES = 64 << 20
"""Largest text file ``llmc eval`` reads (a novel is ~1 MiB)."""


@dataclass(frozen=True)
class EvalSettings:
    """What one perplexity run scores: the text and how it is cut into windows."""

    text_file: str
    window: int | None = None
    """Tokens per window; None: ``max_window(limits)``."""
    stride: int | None = None
    """Tokens between window starts, 1..window; None: the window (non-overlapping)."""
    max_windows: int | None = None
    """Score at most this many windows (the first ones); None: the whole text."""

    def __post_init__(self) -> None:
        """The ranges that need no engine (ConfigError naming the flag); the window against
        the engine's limits is ``resolve_windows``'."""
        if not isinstance(self.text_file, (str, os.PathLike)):
            raise UsageError(f"--text_file must be a path, got {self.text_file!r}")
        _checked("window", self.window, 2, None, "a token and the one it predicts")
        _checked("stride", self.stride, 1, None, "tokens between window starts")
        _checked("max_windows", self.max_windows, 1, None, "windows to score")


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` of the text, scoring ``[first_scored, end)``."""

    begin: int
    end: int
    first_scored: int


@dataclass(frozen=True)
class PerplexityResult:
    """One run's numbers (``to_dict``: the ``llmc eval --json`` document)."""

    engine_dir: str
    text_file: str
    text_bytes: int
    text_tokens: int
    window: int
    stride: int
    windows: int
    tokens_scored: int
    nll_sum: float
    """Negative log-likelihood of every scored token, summed (nats)."""
    seconds: float
    """From the first window enqueued to the last one's final response."""
    runtime: dict[str, Any]
    environment: dict[str, Any]

    @property
    def nll_mean(self) -> float:
        """Mean NLL per scored token (nats): the log of the perplexity."""
        return self.nll_sum / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_mean)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            schema=SCHEMA,
            schema_version=SCHEMA_VERSION,
            perplexity=self.perplexity,
            nll_mean=self.nll_mean,
            tokens_per_s=self.tokens_scored / self.seconds if self.seconds > 0 else None,
        )
        return d


def read_text(path: str) -> tuple[str, int]:
    """(text, bytes) of a text file; UsageError naming it when it is missing, not a regular
    file, larger than MAX_TEXT_BYTES, binary (a NUL byte), not UTF-8 or empty."""
    where = f"--text_file {path}"
    try:
        st = os.stat(path)
    except OSError as e:
        raise UsageError(f"{where}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{where}: not a regular file")
    if st.st_size > MAX_TEXT_BYTES:
        raise UsageError(f"{where}: {st.st_size} bytes, more than the {MAX_TEXT_BYTES} llmc reads")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise UsageError(f"{where}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_TEXT_BYTES:  # grew while being read
        raise UsageError(f"{where}: more than the {MAX_TEXT_BYTES} bytes llmc reads")
    nul = data.find(b"\0")
    if nul >= 0:
        raise UsageError(f"{where}: binary, not text (a NUL byte at offset {nul})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise UsageError(f"{where}: the file is empty (no text to score)")
    return text, len(data)


def max_window(limits: EngineLimits) -> int:
    """The longest window an engine takes: a prompt of at most max_input_len tokens that
    leaves max_seq_len room for the one generated token."""
    return min(limits.max_input_len, limits.max_seq_len - 1)


def _checked(name: str, value: int | None, lo: int, hi: int | None, note: str) -> int | None:
    """``value`` (None: not given) as an int in [lo, hi]; ConfigError naming the flag."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"--{name} {value!r}: must be an integer {rng} ({note})")
    return value


def plan_windows(
    num_tokens: int, window: int, stride: int, max_windows: int | None = None
) -> list[Window]:
    """The windows over ``num_tokens`` tokens (the guide's loop: start every ``stride``
    tokens, stop at the window that reaches the end), those that score nothing left out."""
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append(Window(begin, end, first))
            if max_windows is not None and len(windows) == max_windows:
                break
        prev_end = end
        if end == num_tokens:
            break
    return windows


def resolve_windows(
    settings: EvalSettings, limits: EngineLimits, num_tokens: int
) -> tuple[int, int, list[Window]]:
    """(window, stride, windows) of ``settings`` on an engine with ``limits``, checked."""
    limit = max_window(limits)
    note = f"the engine takes prompts of max_input_len={limits.max_input_len} tokens"
    if limits.max_input_len >= limits.max_seq_len:
        note += f" with room for one more under max_seq_len={limits.max_seq_len}"
    if limit < 2:
        raise ConfigError(f"the engine's longest window is {limit} token(s) ({note}); need 2")
    window = _checked("window", settings.window, 2, limit, note) or limit
    stride = _checked("stride", settings.stride, 1, window, "at most the window") or window
    if num_tokens < 2:
        raise UsageError(
            f"--text_file {settings.text_file}: {num_tokens} token(s); perplexity needs at "
            "least 2 (a token and the one it predicts)"
        )
    return window, stride, plan_windows(num_tokens, window, stride, settings.max_windows)


def evaluate(
    served: Served,
    settings: EvalSettings,
    log: Callable[[str], None] | None = None,
    text: tuple[str, int] | None = None,
) -> PerplexityResult:
    """The perplexity of ``served`` (an ``llmc.LLM``) over ``settings.text_file``; ``text``:
    its ``read_text`` already (the CLI reads it before loading the engine)."""
    from llmc.runtime.bench.benchmark import environment

    say = log or (lambda _m: None)
    rt = served.runtime
    if rt.tokenizer is None:
        raise UsageError(
            f"engine {served.engine_dir} has no tokenizer: llmc eval tokenizes the text with "
            "the engine's own (build it from a checkpoint that has one)"
        )
    body, nbytes = text if text is not None else read_text(settings.text_file)
    ids = rt.tokenizer.encode(body)
    window, stride, windows = resolve_windows(settings, rt.limits, len(ids))
    scored = sum(w.end - w.first_scored for w in windows)
    say(
        f"{len(ids)} tokens: {len(windows)} windows of <= {window} tokens (stride {stride}), "
        f"{scored} tokens scored"
    )
    sp = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    t0 = time.perf_counter()
    with served.in_caller_thread():  # every window joins the first steps
        rids = [
            served.enqueue_request(Request(prompt_token_ids=ids[w.begin : w.end], sampling=sp))
            for w in windows
        ]
        finals: dict[int, Any] = {}
        while len(finals) < len(rids):
            waiting = [r for r in rids if r not in finals]
            got = served.await_responses(waiting)
            if not got:
                raise EngineError(f"{len(waiting)} windows ended without a final response")
            finals.update((r.request_id, r) for r in got if r.is_final)
    seconds = time.perf_counter() - t0
    pairs = enumerate(zip(windows, rids, strict=True))
    nll = sum(_window_nll(i, w, finals[rid]) for i, (w, rid) in pairs)
    return PerplexityResult(
        engine_dir=str(served.engine_dir),
        text_file=str(settings.text_file),
        text_bytes=nbytes,
        text_tokens=len(ids),
        window=window,
        stride=stride,
        windows=len(windows),
        tokens_scored=scored,
        nll_sum=nll,
        seconds=seconds,
        runtime=served.summary(),
        environment=environment(rt.device),
    )


def _window_nll(i: int, w: Window, response: Any) -> float:
    """The summed NLL of window ``i``'s scored tokens from its final Response."""
    where = f"window {i} (text tokens {w.begin}..{w.end - 1})"
    if response.error is not None:
        raise error_class(response.error_code)(f"{where}: {response.error}")
    entries = response.prompt_logprobs
    if entries is None or len(entries) != w.end - w.begin:
        raise EngineError(f"{where}: the engine returned no prompt logprobs for it")
    total = 0.0
    for j in range(w.first_scored - w.begin, w.end - w.begin):
        lp = entries[j].logprob
        if not math.isfinite(lp):
            raise EngineError(f"{where}: token {w.begin + j} has a non-finite logprob {lp}")
        total -= lp
    return total
