"""The token-equivalence scenarios shared by the runtime tests of the fast paths (async
scheduling, multi-step decoding): each fast path must give, token for token, what the plain
loop gives on the same prompts and sampling parameters.

- ``PROMPTS``: six prompts of 1..25 tokens; ``SHARED_PREFIX_PROMPTS``: six sharing 21 tokens
  (prefix reuse, chunked prefill);
- ``greedy``: greedy params with given lengths (EOS off); ``mixed_sampling``: seeded and
  unseeded top-k / top-p / min-p rows beside greedy ones; ``model_eos``: sampled rows that
  stop on the model's EOS;
- ``stop_id_params`` / ``stop_string_params``: params that stop each request at a token or
  a text it really produces in a reference run (``first``: where the stops start).
"""

from __future__ import annotations

from typing import Any

from llmc.runtime.types import SamplingParams

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate((3, 11, 25, 7, 1, 17))]
SHARED_PREFIX_PROMPTS = [[9 + j % 50 for j in range(21)] + [60 + i] * (1 + i) for i in range(6)]


def greedy(n=(9, 14, 5, 20, 12, 7), **kw: Any) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=k, ignore_eos=True, **kw) for k in n]


def mixed_sampling() -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=16, temperature=0.9, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True),
        SamplingParams(max_new_tokens=18, temperature=0.7, min_p=0.05, seed=3, ignore_eos=True),
        *greedy((10, 6, 15)),
    ]


def model_eos() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=30, temperature=1.2, seed=i) for i in range(6)]


def stop_id_params(ref: list[Any], first: int, max_new: int = 20) -> list[SamplingParams]:
    """Request ``i`` stops at its reference output's token ``first + i``."""
    return [
        SamplingParams(
            max_new_tokens=max_new, ignore_eos=True, stop_token_ids=(o.token_ids[first + i],)
        )
        for i, o in enumerate(ref)
    ]


def stop_string_params(ref: list[Any], max_new: int = 24) -> list[SamplingParams]:
    """Request ``i`` stops at two characters from the middle of its reference text (plain
    greedy when they are blank)."""
    stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 2] for o in ref]
    return [
        SamplingParams(max_new_tokens=max_new, ignore_eos=True, stop=(s,))
        if s.strip()
        else greedy()[0]
        for s in stops
    ]
