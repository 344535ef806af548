"""``llmc run`` with conversations (``--system``, ``--messages_file``, JSONL ``messages``) and
with ``--logprobs K`` / ``--prompt_logprobs K`` / ``--min_tokens`` / ``--max_tokens``: the
token ids of the chat template (transformers' ``apply_chat_template``), the logprob entries
with texts in the JSON and the report, bad lines failing alone."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = dict(max_seq_len=64, max_input_len=40, max_batch_size=4, max_num_tokens=64,
              tokens_per_block=8)  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_engine, tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, **LIMITS)


def run_json(*args: str, code: int = 0) -> dict:
    res = CliRunner().invoke(app, ["run", *args, "--json"])
    assert res.exit_code == code, res.stderr
    return json.loads(res.stdout)


def hf_chat_ids(ckpt, messages) -> list[int]:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    return list(ref["input_ids"] if isinstance(ref, Mapping) else ref)


def prompt_ids(out: dict) -> int:
    return out["timings"]["num_prompt_tokens"]


def test_system_prompt_and_messages_file(engine, tiny_llama_dir, tmp_path):
    system = {"role": "system", "content": "Be brief."}
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ]
    f = tmp_path / "chats.jsonl"
    f.write_text(
        json.dumps(turns) + "\n\n" + json.dumps([system, *turns[:1]]) + "\n"
        + "not json\n" + json.dumps([{"role": "user", "content": 5}]) + "\n"
        + json.dumps({"role": "user"}) + "\n" + "[[[1]]]\n" + "[]\n"
    )  # fmt: skip
    args = ("--engine_dir", str(engine), "--max_tokens", "2", "--ignore_eos")
    doc = run_json(*args, "--messages_file", str(f), "--system", "Be brief.", code=8)
    outs = doc["outputs"]
    assert len(outs) == 7 and outs[0]["prompt"] == "And now?"
    assert prompt_ids(outs[0]) == len(hf_chat_ids(tiny_llama_dir, [system, *turns]))
    assert prompt_ids(outs[1]) == len(hf_chat_ids(tiny_llama_dir, [system, turns[0]]))
    assert outs[2]["error"].startswith(f"{f}:4: not valid JSON")
    assert f"{f}:5: " in outs[3]["error"]
    assert "'content' must be a string, got int" in outs[3]["error"]
    for i, line in ((4, 6), (5, 7), (6, 8)):
        assert f"{f}:{line}: a line must be a JSON list of {{role, content}}" in outs[i]["error"]
    plain = run_json(*args, "--prompt", "Hi", "--system", "Be brief.")["outputs"][0]
    assert prompt_ids(plain) == len(hf_chat_ids(tiny_llama_dir, [system, turns[0]]))
    tok = Tokenizer.from_dir(tiny_llama_dir)
    assert prompt_ids(plain) == len(tok.apply_chat_template([system, turns[0]]))


def test_jsonl_messages_and_limit_names(engine, tiny_llama_dir, tmp_path):
    f = tmp_path / "in.jsonl"
    conv = [{"role": "user", "content": "Hey"}]
    f.write_text(
        json.dumps({"messages": conv, "max_tokens": 3}) + "\n"
        + json.dumps({"prompt": "x", "max_new_tokens": 2}) + "\n"
        + json.dumps({"prompt": "x", "messages": conv}) + "\n"
    )  # fmt: skip
    args = ("--engine_dir", str(engine), "--max_new_tokens", "5", "--ignore_eos")
    outs = run_json(*args, "--input_file", str(f), code=8)["outputs"]
    assert len(outs[0]["token_ids"]) == 3 and len(outs[1]["token_ids"]) == 2
    assert prompt_ids(outs[0]) == len(hf_chat_ids(tiny_llama_dir, conv))
    assert "give one of prompt, messages, not both" in outs[2]["error"]
    res = CliRunner().invoke(app, ["run", *args, "--prompt", "a", "--max_tokens", "3"])
    assert res.exit_code == 8 and "max_new_tokens=5 and max_tokens=3 differ" in res.stderr
    res = CliRunner().invoke(app, ["run", *args, "--prompt", "a", "--messages_file", str(f)])
    assert res.exit_code == 2 and "--prompt and --messages_file were both given" in res.stderr


def test_logprobs_and_prompt_logprobs_in_json_and_report(engine, tiny_llama_dir):
    tok = Tokenizer.from_dir(tiny_llama_dir)
    args = ("--engine_dir", str(engine), "--prompt", "hello", "--max_tokens", "3",
            "--ignore_eos", "--logprobs", "2", "--prompt_logprobs", "1")  # fmt: skip
    out = run_json(*args)["outputs"][0]
    assert len(out["logprobs"]) == 3 and len(out["prompt_logprobs"]) == len(tok.encode("hello"))
    assert out["prompt_logprobs"][0] is None
    for tid, e in zip(out["token_ids"], out["logprobs"], strict=True):
        assert e["token_id"] == tid and e["token"] == tok.token_text(tid) and e["rank"] == 1
        assert [t["token"] for t in e["top"]] == [tok.token_text(t["token_id"]) for t in e["top"]]
        assert len(e["top"]) == 2 and e["top"][0]["logprob"] == e["logprob"]  # greedy
    for e in out["prompt_logprobs"][1:]:
        assert e["logprob"] <= 0 and e["rank"] >= 1 and len(e["top"]) == 1
        assert e["token"] == tok.token_text(e["token_id"])
    res = CliRunner().invoke(app, ["run", *args])
    assert res.exit_code == 0, res.stderr
    assert "request 0: generated logprobs" in res.stdout
    assert "request 0: prompt logprobs" in res.stdout and "rank" in res.stdout


def test_min_tokens_flag(engine):
    base = ("--engine_dir", str(engine), "--prompt", "hello", "--max_tokens", "6")
    first = run_json(*base, "--ignore_eos")["outputs"][0]["token_ids"][0]
    stopped = run_json(*base, "--stop_token_ids", str(first))["outputs"][0]
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = run_json(*base, "--stop_token_ids", str(first), "--min_tokens", "4")["outputs"][0]
    assert len(held["token_ids"]) >= 4 and first not in held["token_ids"][:4]


def test_logit_bias_flag(engine):
    base = ("--engine_dir", str(engine), "--prompt", "hello", "--max_tokens", "5", "--ignore_eos")
    free = run_json(*base)["outputs"][0]["token_ids"]
    lift = 7 if free[0] != 7 else 11
    out = run_json(*base, "--logit_bias", f"{free[0]}:-100,{lift}:100")["outputs"][0]
    assert out["token_ids"] == [lift] * 5
    again = run_json(*base, "--logit_bias", f"{free[0]}:-100", "--logit_bias", f"{lift}:100")
    assert again["outputs"][0]["token_ids"] == [lift] * 5  # repeated = comma-separated
