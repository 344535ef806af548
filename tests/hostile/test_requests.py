"""Hostile requests: bad sampling values, prompts the tokenizer rejects, malformed JSONL lines,
bad arrival rates, through ``llmc run`` / ``llmc bench`` (child processes, bounded time and
memory: tests/helpers/hostile.py) and the Python API (SamplingParams, Request, LLM).

The promise: a bad value is a RequestError (exit 8) or ConfigError/UsageError (3/2) naming
the field and the value; a bad value of one request in a file fails that request alone (its
line named) while the others run; nothing crashes the engine loop. The step-loop faults and
chat templates that never end are in tests/runtime/test_request_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.engines import SMALL_LIMITS
from helpers.hostile import Case, run_case, run_llmc
from llmc.base.errors import ConfigError, RequestError
from llmc.runtime.types import FinishReason, Request, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, **SMALL_LIMITS)


def _run(*flags: str) -> list[str]:
    return ["run", "--engine_dir", "{engine}", "--prompt", "hi", *flags]


def _bench(*flags: str) -> list[str]:
    return ["bench", "--engine_dir", "{engine}", "--num_requests", "2", *flags]


# ---- flags: refused before the engine loads ------------------------------------------------
FLAG_CASES = [
    Case(
        "top_k 2**31", _run("--top_k", "2147483648", "--temperature", "1"), 8, ["top_k=2147483648"]
    ),
    Case("top_k negative", _run("--top_k", "-2"), 8, ["top_k=-2"]),
    Case("temperature nan", _run("--temperature", "nan"), 8, ["temperature=nan"]),
    Case("temperature inf", _run("--temperature", "inf"), 8, ["temperature=inf"]),
    Case("temperature beyond float32", _run("--temperature", "1e39"), 8, ["temperature=1e+39"]),
    Case("top_p nan", _run("--top_p", "nan"), 8, ["top_p=nan"]),
    Case("top_p 0", _run("--top_p", "0"), 8, ["top_p=0.0"]),
    Case("min_p 2", _run("--min_p", "2"), 8, ["min_p=2.0"]),
    Case("repetition_penalty 0", _run("--repetition_penalty", "0"), 8, ["repetition_penalty"]),
    Case("presence_penalty inf", _run("--presence_penalty", "inf"), 8, ["presence_penalty=inf"]),
    Case("max_new_tokens negative", _run("--max_new_tokens", "-5"), 8, ["max_new_tokens=-5"]),
    Case("max_new_tokens huge", _run("--max_new_tokens", "99999999999"), 8, ["max_new_tokens"]),
    Case("logprobs 21", _run("--logprobs", "21"), 8, ["logprobs=21"]),
    Case("seed float", _run("--seed", "1.5"), 2, ["seed"]),
    Case("seed string", _run("--seed", "abc"), 2, ["seed"]),
    Case("logprobs float", _run("--logprobs", "1.5"), 2, ["logprobs"]),
    Case("stop_token_ids not ints", _run("--stop_token_ids", "a,b"), 2, ["stop_token_ids"]),
    Case("stop_token_ids negative", _run("--stop_token_ids", "-3"), 8, ["stop_token_ids=(-3,)"]),
    Case("request_rate nan", _bench("--request_rate", "nan"), 3, ["request_rate", "nan"]),
    Case("request_rate inf", _bench("--request_rate", "inf"), 3, ["request_rate", "inf"]),
    Case("request_rate negative", _bench("--request_rate", "-2"), 3, ["request_rate", "-2"]),
    Case("request_rate zero", _bench("--request_rate", "0"), 3, ["request_rate", "0"]),
]


@pytest.mark.parametrize("case", FLAG_CASES, ids=str)
def test_bad_flags_are_refused_cleanly(case, engine):
    out = run_case(case, engine=engine)
    assert out.seconds < 30


# ---- per-request values: the request fails alone, the others run ---------------------------
GOOD_LINE = '{"prompt": "ok", "max_new_tokens": 3, "ignore_eos": true}'
LINE_CASES = [  # (name, the JSONL line (bytes), what its error says)
    ("seed float", b'{"prompt": "a", "seed": 1.5}', "seed=1.5: must be an integer"),
    ("seed string", b'{"prompt": "a", "seed": "7"}', "seed='7': must be an integer"),
    ("seed bool", b'{"prompt": "a", "seed": true}', "seed=True: must be an integer"),
    ("logprobs float", b'{"prompt": "a", "logprobs": 1.0}', "logprobs=1.0: must be an integer"),
    ("top_k 2**31", b'{"prompt": "a", "top_k": 2147483648}', "top_k=2147483648"),
    ("top_k float", b'{"prompt": "a", "top_k": 5.5}', "top_k=5.5: must be an integer"),
    ("temperature NaN", b'{"prompt": "a", "temperature": NaN}', "temperature=nan"),
    ("temperature string", b'{"prompt": "a", "temperature": "hot"}', "temperature='hot'"),
    ("max_new_tokens bool", b'{"prompt": "a", "max_new_tokens": true}', "max_new_tokens=True"),
    ("max_new_tokens huge", b'{"prompt": "a", "max_new_tokens": 1e30}', "max_new_tokens=1e+30"),
    ("ignore_eos string", b'{"prompt": "a", "ignore_eos": "no"}', "ignore_eos='no'"),
    ("stop number", b'{"prompt": "a", "stop": 5}', "stop=5"),
    ("stop empty string", b'{"prompt": "a", "stop": [""]}', "non-empty strings"),
    (
        "stop id outside vocab",
        b'{"prompt": "a", "stop_token_ids": [99999]}',
        "stop_token_ids 99999",
    ),
    ("stop id float", b'{"prompt": "a", "stop_token_ids": [2.0]}', "stop_token_ids=[2.0]"),
    ("prompt number", b'{"prompt": 5}', "prompt=5: must be a string"),
    ("prompt list", b'{"prompt": ["a"]}', "prompt=['a']: must be a string"),
    ("prompt lone surrogate", b'{"prompt": "a\\ud800b"}', "lone surrogate"),
    ("input_ids string", b'{"input_ids": "abc"}', "prompt_token_ids='abc'"),
    ("input_ids floats", b'{"input_ids": [1.5, 2]}', "integer token ids"),
    ("input_ids outside vocab", b'{"input_ids": [1, 300]}', "prompt token id 300"),
    ("input_ids negative", b'{"input_ids": [-1]}', "prompt token id -1"),
    ("input_ids and prompt", b'{"input_ids": [1], "prompt": "a"}', "not both"),
    ("chat string", b'{"prompt": "a", "chat": "yes"}', "apply_chat_template='yes'"),
    ("empty prompt", b'{"prompt": ""}', "the prompt is empty"),
    ("invalid JSON", b'{"prompt": "a",', "not valid JSON"),
    ("deeply nested JSON", b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "JSON"),
    ("not an object", b'{"prompt": "a"} x', "not valid JSON"),
    ("unknown key", b'{"prompt": "a", "temprature": 1}', "unknown key 'temprature'"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
]


@pytest.fixture(scope="module")
def jsonl_run(engine, tmp_path_factory):
    """One ``llmc run --json`` over a file: a good line, then every bad line, then a good one."""
    path = tmp_path_factory.mktemp("hostile_jsonl") / "in.jsonl"
    lines = [GOOD_LINE.encode(), *(line for _, line, _ in LINE_CASES), GOOD_LINE.encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = run_llmc(["run", "--engine_dir", engine, "--input_file", path, "--json"])
    return path, out


def test_a_file_with_bad_lines_runs_its_good_ones(jsonl_run):
    path, out = jsonl_run
    assert out.exit_code == RequestError.exit_code, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and out.seconds < 60
    outputs = json.loads(out.stdout)["outputs"]
    assert len(outputs) == len(LINE_CASES) + 2
    for o in (outputs[0], outputs[-1]):
        assert o["error"] is None and len(o["token_ids"]) == 3
    assert f"{path}:1:" not in out.stderr  # the prefix of each error is said once
    assert "request 1: request" not in out.stderr


@pytest.mark.parametrize(("name", "line", "says"), LINE_CASES, ids=[c[0] for c in LINE_CASES])
def test_a_bad_line_fails_alone_naming_its_line(jsonl_run, name, line, says):
    path, out = jsonl_run
    n = 2 + [c[0] for c in LINE_CASES].index(name)
    o = json.loads(out.stdout)["outputs"][n - 1]
    assert o["finish_reason"] == "error" and o["error_code"] == RequestError.exit_code
    assert o["error"].startswith(f"{path}:{n}: ") and says in o["error"], o["error"]
    assert f"request {n - 1}: {path}:{n}: " in out.stderr


def test_invalid_utf8_on_the_command_line_fails_that_prompt(engine):
    """argv bytes that are not UTF-8 arrive as lone surrogates: that prompt fails alone."""
    args = ["--prompt", b"\xff\xfe", "--prompt", "ok", "--max_new_tokens", "2", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "llmc.cli.main", "run", "--engine_dir", str(engine), *args],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == RequestError.exit_code, proc.stderr[-2000:]
    assert b"Traceback" not in proc.stderr
    bad, ok = json.loads(proc.stdout)["outputs"]
    assert "lone surrogate" in bad["error"] and ok["error"] is None


# ---- the Python API -------------------------------------------------------------------------
SAMPLING_CASES = [  # (keyword arguments, what the RequestError says)
    (dict(top_k=2**31), "top_k=2147483648"),
    (dict(top_k=True), "top_k=True"),
    (dict(top_k=3.0), "top_k=3.0"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(seed="1"), "seed='1'"),
    (dict(seed=False), "seed=False"),
    (dict(logprobs=1.0), "logprobs=1.0"),
    (dict(logprobs=True), "logprobs=True"),
    (dict(logprobs=-1), "logprobs=-1"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(max_new_tokens=2**40), "max_new_tokens=1099511627776"),
    (dict(max_new_tokens=True), "max_new_tokens=True"),
    (dict(max_new_tokens=4.0), "max_new_tokens=4.0"),
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(temperature=math.inf), "temperature=inf"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(temperature="0.5"), "temperature='0.5'"),
    (dict(temperature=None), "temperature=None"),
    (dict(temperature=True), "temperature=True"),
    (dict(top_p=math.nan), "top_p=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(min_p=math.inf), "min_p=inf"),
    (dict(repetition_penalty=math.nan), "repetition_penalty=nan"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
    (dict(presence_penalty=math.inf), "presence_penalty=inf"),
    (dict(frequency_penalty=-3.0), "frequency_penalty=-3.0"),
    (dict(stop=[""]), "stop=['']"),
    (dict(stop=5), "stop=5"),
    (dict(stop=None), "stop=None"),
    (dict(stop=["a", 1]), "stop=['a', 1]"),
    (dict(stop=["s"] * 65), "at most 64"),
    (dict(stop_token_ids=[-1]), "stop_token_ids=[-1]"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids=[1.5]"),
    (dict(stop_token_ids=[True]), "stop_token_ids=[True]"),
    (dict(stop_token_ids="12"), "stop_token_ids='12'"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids=[2147483648]"),
    (dict(ignore_eos="false"), "ignore_eos='false'"),
    (dict(clamp_max_new_tokens=1), "clamp_max_new_tokens=1"),
]


@pytest.mark.parametrize(("kwargs", "says"), SAMPLING_CASES, ids=[c[1] for c in SAMPLING_CASES])
def test_sampling_params_refuse_bad_values_naming_them(kwargs, says):
    with pytest.raises(RequestError, match="sampling parameter ") as err:
        SamplingParams(**kwargs)
    assert says in str(err.value)


def test_sampling_params_normalize_what_they_accept():
    assert SamplingParams(stop="abc").stop == ("abc",)  # ONE stop string, not three
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
    sp = SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), seed=np.int32(3))
    assert (type(sp.top_k), type(sp.temperature), type(sp.seed)) == (int, float, int)
    assert SamplingParams(temperature=1).temperature == 1.0 and SamplingParams(seed=-(2**70))


REQUEST_CASES = [  # (keyword arguments, what the RequestError says)
    (dict(prompt=5), "prompt=5"),
    (dict(prompt=b"hi"), "prompt=b'hi'"),
    (dict(prompt=["a"]), "prompt=['a']"),
    (dict(prompt_token_ids="abc"), "prompt_token_ids='abc'"),
    (dict(prompt_token_ids=[1, "2"]), "prompt_token_ids=[1, '2']"),
    (dict(prompt_token_ids=[1, 2.0]), "prompt_token_ids=[1, 2.0]"),
    (dict(prompt_token_ids=[True]), "prompt_token_ids=[True]"),
    (dict(prompt="a", prompt_token_ids=[1]), "not both"),
    (dict(prompt="a", sampling={"temperature": 1}), "sampling={'temperature': 1}"),
    (dict(prompt="a", priority=1.5), "priority=1.5"),
    (dict(prompt="a", priority=True), "priority=True"),
    (dict(prompt="a", priority=2**40), "priority=1099511627776"),
    (dict(prompt="a", streaming="yes"), "streaming='yes'"),
    (dict(prompt="a", apply_chat_template=1), "apply_chat_template=1"),
    (dict(prompt="a", metadata=[]), "metadata=[]"),
]


@pytest.mark.parametrize(("kwargs", "says"), REQUEST_CASES, ids=[c[1] for c in REQUEST_CASES])
def test_requests_refuse_bad_fields_naming_them(kwargs, says):
    with pytest.raises(RequestError) as err:
        Request(**kwargs)
    assert says in str(err.value)


@pytest.fixture(scope="module")
def llm(engine):
    from llmc import LLM

    with LLM(engine, device="cpu") as llm:
        yield llm


GENERATE_ERRORS = [  # prompts LLM.generate turns into an error output (the others run)
    ([1, 300], "prompt token id 300 is outside the vocabulary"),
    ([-4], "prompt token id -4 is outside the vocabulary"),
    ("a\ud800b", "lone surrogate"),
    ("", "the prompt is empty"),
    ([], "the prompt is empty"),
]


@pytest.mark.parametrize(("prompt", "says"), GENERATE_ERRORS, ids=[c[1] for c in GENERATE_ERRORS])
def test_generate_fails_a_bad_prompt_alone(llm, prompt, says):
    good, bad, good2 = llm.generate(
        [[5, 6], prompt, "ok"], SamplingParams(max_new_tokens=2, ignore_eos=True)
    )
    assert good.ok and good2.ok and len(good.token_ids) == 2
    assert bad.finish_reason is FinishReason.ERROR and says in bad.error
    assert bad.error_code == RequestError.exit_code
    assert bad.error.count(f"request {bad.request_id}:") == 1


GENERATE_RAISES = [  # arguments LLM.generate refuses before anything is enqueued
    (dict(prompts=5), RequestError, "prompt=5"),
    (dict(prompts="a", sampling_params={"temperature": 1}), RequestError, "sampling="),
    (dict(prompts="a", priority=True), RequestError, "priority=True"),
    (dict(prompts=["a", "b"], sampling_params=[SamplingParams()]), ConfigError, "1 sampling"),
    (dict(prompts=[[1, "x"]]), RequestError, "prompt_token_ids=[1, 'x']"),
    (dict(prompts="a", apply_chat_template="yes"), RequestError, "apply_chat_template='yes'"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "says"), GENERATE_RAISES, ids=[c[2] for c in GENERATE_RAISES]
)
def test_generate_refuses_bad_arguments(llm, kwargs, error, says):
    with pytest.raises(error) as err:
        llm.generate(**kwargs)
    assert says in str(err.value)
    assert llm.generate("ok", SamplingParams(max_new_tokens=1))[0].ok  # still serving


def test_a_stop_token_id_outside_the_vocabulary_fails_its_request(llm):
    [out] = llm.generate("a", SamplingParams(stop_token_ids=[99999]))
    assert not out.ok and "stop_token_ids 99999 is outside the vocabulary" in out.error


def test_leaving_a_stream_cancels_it_while_the_stream_is_kept(llm):
    async def leave_early():
        stream = llm.generate_async("hello", SamplingParams(max_new_tokens=40, ignore_eos=True))
        async for first in stream:  # noqa: B007 (used after the loop)
            break
        for _ in range(200):  # the cancel applies at the next step
            await asyncio.sleep(0.01)
            rec = next(x for x in llm.request_records if x.request_id == first.request_id)
            if rec.finish_reason is not None:
                break
        return stream, rec

    stream, rec = asyncio.run(leave_early())
    assert stream is not None and rec.finish_reason == "cancelled" and rec.num_output_tokens < 40
    kv = llm.kv_stats()
    assert kv.free_blocks == kv.total_blocks


# ---- chat templates: bounded in time and size, a failure is the request's -------------------
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}"
TEMPLATE_CASES = [  # (template, what the RequestError says)
    (LOOP + "{% endfor %}{% endfor %}", "ran longer than 0.3 s (chat_timeout_s)"),
    (LOOP + "{{ 'x' * 1000 }}{% endfor %}{% endfor %}", "more than 100000 characters"),
    ("{{ 'x' * 10**10 }}", "builds more than 100000 characters"),
    ("{{ [1] * 10**10 }}", "builds more than 100000 characters"),
    ("{{ 2 ** 100000000 }}", "** 100000000 (too large)"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ messages[5].content }}", "failed"),
    ("{{ range(10**12) | list }}", "failed"),
    ("{{ ''.__class__.__mro__ }}", "failed"),
]


@pytest.mark.parametrize(("template", "says"), TEMPLATE_CASES, ids=[c[1] for c in TEMPLATE_CASES])
def test_a_hostile_chat_template_fails_the_request(engine, template, says):
    import time

    from llmc.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(engine)
    tok.chat_template, tok.chat_timeout_s, tok.chat_max_chars = template, 0.3, 100_000
    t0 = time.perf_counter()
    with pytest.raises(RequestError) as err:
        tok.apply_chat_template("hi")
    assert says in str(err.value) and time.perf_counter() - t0 < 5


def test_chat_messages_must_be_role_dicts(engine):
    from llmc.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(engine)
    tok.chat_template = "{{ messages[0].content }}"
    assert tok.apply_chat_template("hi", tokenize=False) == "hi"
    with pytest.raises(RequestError, match="role/content dicts"):
        tok.apply_chat_template([5], tokenize=False)
