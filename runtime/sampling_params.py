"""SamplingParams: how one request picks its tokens, validated at construction (no torch).

The one home of every sampling rule (each field's type and range, ``__post_init__``) and of
the derived properties the fast paths read (``is_plain``, ``greedy``, ``uses_penalties``,
``num_branches``). Re-exported by ``llmc.runtime.types``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmc.base.errors import RequestError
from llmc.runtime.fields import (
    INT32_MAX,
    MAX_LOGPROBS,
    _bad,
    _integer,
    _logit_bias,
    _real,
    _strings,
    _token_ids,
    _top_count,
)

FLOAT32_MAX = 3.4028234663852886e38
"""The float columns are float32: a larger value would become inf on the device."""
MAX_OUTPUTS = 256
"""Most outputs (``n``, ``best_of``, ``beam_width``) one request may ask for; the engine's
``max_batch_size`` (every output is a row of the step) and ``max_beam_width`` bound them
further at admission."""
EARLY_STOPPING = (True, False, "never")


def _max_new_tokens(p: SamplingParams) -> int:
    """The generation limit from ``max_new_tokens`` / ``max_tokens`` (either name, 32 when
    neither is given; both given and different: refused naming both)."""
    given = [n for n in ("max_new_tokens", "max_tokens") if getattr(p, n) is not None]
    if not given:
        return 32
    values = [_integer(p, n, 1, INT32_MAX) for n in given]
    if len(values) == 2 and values[0] != values[1]:
        raise RequestError(
            f"sampling parameters max_new_tokens={values[0]} and max_tokens={values[1]} "
            "differ: they are two names of one limit, give one"
        )
    return values[0]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    Validated at construction: a bad value raises RequestError naming the field.
    """

    _field_kind = "sampling parameter"  # how its errors name a field (fields._bad)

    max_new_tokens: int | None = None
    """Most tokens to generate: this, or ``max_tokens``, or 32 when neither is given (always
    an int after construction)."""
    temperature: float = 0.0
    top_k: int = 0
    """0 disables top-k (-1, vLLM's spelling, is taken as 0)."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Stop strings; the output is cut before the stop string."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the log-probability and rank of each sampled token and this many top
    alternatives (``llmc.runtime.logprobs.TokenLogprobs``, also vLLM's ``dict[int, Logprob]``;
    the front door attaches the tokens' texts)."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: None = off; k >= 0 = return, for every prompt token but
    the first (whose entry is None), its log-probability given the tokens before it (raw
    logits, float32 log_softmax), its rank and the k most likely tokens there. Computed in
    the prefill (``llmc.runtime.prompt_logprobs``); such a request shares no cached prefix
    blocks (every prompt position must be computed)."""
    clamp_max_new_tokens: bool = False
    """If prompt + max_new_tokens exceeds max_seq_len: clamp instead of failing the request."""
    max_tokens: int | None = None
    """vLLM's and TensorRT-LLM's name of ``max_new_tokens``. Either name may be given; both
    given and different is refused naming both. After construction both hold the limit, so
    ``dataclasses.replace`` that changes one of them must change the other too."""
    min_tokens: int = 0
    """vLLM's ``min_tokens``: EOS and ``stop_token_ids`` are suppressed (their logits set to
    -inf before sampling) until this many tokens were generated; at most max_new_tokens."""
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    """OpenAI's and vLLM's ``logit_bias``: token id → a bias in [-100, 100] added to that
    token's logit before anything else sees it (penalties, temperature, the filters, the
    logprobs returned), every step; -100 all but bans a token. Given as a mapping (or (id,
    bias) pairs); held as (id, bias) pairs sorted by id. At most 1,024 ids, each inside the
    engine's vocabulary (checked at admission)."""
    n: int = 1
    """Outputs returned (vLLM's ``n``): independent samples of the prompt, or with
    ``use_beam_search`` the ``n`` best beams. The samples share the prompt's KV blocks
    (prefilled once, forked at the first generated token); sample ``i`` of a seeded request
    draws from a seed derived from ``(seed, i)``."""
    best_of: int | None = None
    """Samples drawn (>= n, default n); the ``n`` with the highest cumulative log-probability
    are returned (vLLM's ``best_of``). Not streamable when above ``n``."""
    use_beam_search: bool = False
    """Beam search (TensorRT-LLM / transformers semantics: greedy, no sampling knobs)."""
    beam_width: int | None = None
    """Beams of a beam search (default: best_of, else n); at most the engine's
    ``max_beam_width``."""
    length_penalty: float = 1.0
    """Beam search: a finished beam's score is its summed logprob / generated_len**this."""
    early_stopping: bool | str = False
    """Beam search, as transformers' ``early_stopping``: True stops once ``beam_width``
    beams finished; False stops when no running beam can beat the worst finished one
    (scored at the current length); "never" scores that bound at max length."""

    def __post_init__(self) -> None:
        """The one home of every sampling rule: each field's type and range, checked where
        the params are made (Python API, ``llmc run`` flags and JSONL, a server), so nothing
        that reaches the step loop can crash it. Values are normalized in place: integral
        numbers (numpy ints) become ``int``, real numbers ``float``, ``stop`` a tuple of
        strings (a plain string is ONE stop string), ``stop_token_ids`` a tuple of ints."""
        put = functools.partial(object.__setattr__, self)
        put("max_new_tokens", _max_new_tokens(self))
        put("max_tokens", self.max_new_tokens)
        put("min_tokens", _integer(self, "min_tokens", 0, INT32_MAX))
        if self.min_tokens > self.max_new_tokens:
            limit = f"more than max_new_tokens={self.max_new_tokens}"
            raise _bad(self, "min_tokens", limit)
        if self.top_k == -1 and not isinstance(self.top_k, bool):  # vLLM's "off"
            put("top_k", 0)
        put("top_k", _integer(self, "top_k", 0, INT32_MAX, "0 disables it"))
        put("temperature", _real(self, "temperature", 0.0, FLOAT32_MAX, "0 means greedy"))
        put("top_p", _real(self, "top_p", 0.0, 1.0, open_low=True))
        put("min_p", _real(self, "min_p", 0.0, 1.0))
        put(
            "repetition_penalty",
            _real(self, "repetition_penalty", 0.0, FLOAT32_MAX, "1 disables it", open_low=True),
        )
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _real(self, name, -2.0, 2.0))
        if self.seed is not None:
            put("seed", _integer(self, "seed", None, None, "any integer, taken modulo 2**64"))
        if self.logprobs is not None:
            put("logprobs", _integer(self, "logprobs", 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", _top_count(self, "prompt_logprobs"))
        for name in ("ignore_eos", "clamp_max_new_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(self, name, "must be True or False")
        put("stop", _strings(self, "stop"))
        put("stop_token_ids", tuple(_token_ids(self, "stop_token_ids")))
        put("logit_bias", _logit_bias(self, "logit_bias"))
        self._check_outputs(put)

    def _check_outputs(self, put: Any) -> None:
        """``n``, ``best_of`` and the beam-search fields (one rule each, named)."""
        put("n", _integer(self, "n", 1, MAX_OUTPUTS))
        if self.best_of is not None:
            put("best_of", _integer(self, "best_of", 1, MAX_OUTPUTS))
            if self.best_of < self.n:
                raise _bad(self, "best_of", f"must be >= n ({self.n})")
        if not isinstance(self.use_beam_search, bool):
            raise _bad(self, "use_beam_search", "must be True or False")
        put("length_penalty", _real(self, "length_penalty", -FLOAT32_MAX, FLOAT32_MAX))
        if self.early_stopping not in EARLY_STOPPING or not isinstance(
            self.early_stopping, (bool, str)
        ):
            raise _bad(self, "early_stopping", 'must be True, False or "never"')
        if self.beam_width is not None:  # its range first: 0 is out of range, not "beams"
            put("beam_width", _integer(self, "beam_width", 1, MAX_OUTPUTS))
        if not self.use_beam_search:
            if self.beam_width not in (None, 1):
                raise _bad(self, "beam_width", "needs use_beam_search=True")
            return
        width = self.num_branches
        if self.n > width:
            raise _bad(self, "n", f"must be at most the beam width ({width})")
        if self.best_of is not None and self.beam_width is not None and self.best_of != width:
            raise _bad(self, "best_of", f"differs from beam_width={width} (give one of them)")
        knobs = {
            "temperature": 0.0,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_tokens": 0,
        }
        for name, neutral in knobs.items():
            if getattr(self, name) != neutral:
                raise _bad(self, name, "beam search is greedy: leave it at its default")
        if self.logprobs is not None:
            raise _bad(self, "logprobs", "not returned by beam search (beams are rescored)")
        if self.stop:
            raise _bad(self, "stop", "stop strings do not end beams (give stop_token_ids)")

    @property
    def num_branches(self) -> int:
        """Sequences this request decodes at once: its beams, or its best_of samples."""
        if self.use_beam_search:
            return self.beam_width or self.best_of or self.n
        return self.best_of or self.n

    @property
    def ranks_by_logprob(self) -> bool:
        """Sampling with best_of > n: every token's logprob is needed to rank the samples."""
        return not self.use_beam_search and self.num_branches > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Any repetition / presence / frequency penalty (they need the token history)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def is_plain(self) -> bool:
        """Plain sampling: a row with these params needs only its constant sampling columns,
        no logprobs (their own device→host copy) and no penalties (counts of the token
        history, built on the host). The one statement of the rule behind the fast paths:
        CUDA-graph decode steps (``cuda_graphs.graph_eligible``), async scheduling
        (``engine_step.ahead_ok``) and the decode row cache (``decode_row_cache.DecodeRowCache``)
        serve only plain rows. ``min_tokens`` masks stop ids and ``logit_bias`` adds to the
        logits from the host's step inputs, so such a row is not plain either; nor are beam
        search (its rows' logits are rescored on the host's orders) and best_of > n (every
        token's logprob ranks the samples)."""
        return (
            self.logprobs is None
            and not self.uses_penalties
            and not self.min_tokens
            and not self.logit_bias
            and not self.use_beam_search
            and not self.ranks_by_logprob
        )

    @property
    def token_logprobs(self) -> bool:
        """Whether each sampled token's logprob is computed (asked for, or best_of ranking)."""
        return self.logprobs is not None or self.ranks_by_logprob
