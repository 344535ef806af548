"""``llmc.runtime.bench.perplexity``: the windows of transformers' perplexity guide, the text
file checks, and the perplexity of the fp32 tiny Llama engine through ``llmc.LLM`` against
transformers' perplexity of the same checkpoint over the same windows (rtol 1e-4)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.engines import SMALL_LIMITS
from helpers.runner import load_hf
from llmc.base.errors import ConfigError, UsageError
from llmc.runtime.bench.perplexity import (
    MAX_TEXT_BYTES,
    EvalSettings,
    Window,
    evaluate,
    max_window,
    plan_windows,
    read_text,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GETTYSBURG = (  # public domain (Abraham Lincoln, 1863)
    "Four score and seven years ago our fathers brought forth on this continent, a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are created "
    "equal. Now we are engaged in a great civil war, testing whether that nation, or any "
    "nation so conceived and so dedicated, can long endure. We are met on a great "
    "battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is "
    "altogether fitting and proper that we should do this. But, in a larger sense, we can not "
    "dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave men, "
    "living and dead, who struggled here, have consecrated it, far above our poor power to add "
    "or detract. The world will little note, nor long remember what we say here, but it can "
    "never forget what they did here. It is for us the living, rather, to be dedicated here "
    "to the unfinished work which they who fought here have thus far so nobly advanced. It is "
    "rather for us to be here dedicated to the great task remaining before us -- that from "
    "these honored dead we take increased devotion to that cause for which they gave the last "
    "full measure of devotion -- that we here highly resolve that these dead shall not have "
    "died in vain -- that this nation, under God, shall have a new birth of freedom -- and "
    "that government of the people, by the people, for the people, shall not perish from the "
    "earth.\n"
)


# ---- windows ---------------------------------------------------------------------------
def test_non_overlapping_windows_score_all_but_each_first_token():
    assert plan_windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]


def test_a_last_window_of_one_token_scores_nothing_and_is_left_out():
    assert plan_windows(9, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5)]


def test_a_smaller_stride_scores_each_token_once_with_more_context():
    ws = plan_windows(10, 4, 2)
    assert ws == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    scored = [t for w in ws for t in range(w.first_scored, w.end)]
    assert scored == list(range(1, 10))  # every token but the first, once


def test_max_windows_bounds_the_run_and_one_window_can_cover_the_text():
    assert plan_windows(100, 10, 10, max_windows=2) == [Window(0, 10, 1), Window(10, 20, 11)]
    assert plan_windows(5, 10, 10) == [Window(0, 5, 1)]
    assert plan_windows(1, 10, 10) == []


def test_max_window_leaves_room_for_the_generated_token():
    from helpers.engines import make_limits

    lim = dict(max_batch_size=2, max_num_tokens=64, tokens_per_block=8)
    assert max_window(make_limits(max_seq_len=128, max_input_len=64, **lim)) == 64
    assert max_window(make_limits(max_seq_len=64, **lim)) == 63


@pytest.mark.parametrize(
    "field, value", [("window", 1), ("stride", 0), ("max_windows", 0), ("window", 2.5)]
)
def test_bad_settings_name_the_flag(field, value):
    with pytest.raises(ConfigError, match=f"--{field} {value!r}"):
        EvalSettings(text_file="x", **{field: value})


# ---- the text file ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "content, says",
    [
        (b"", "empty"),
        (b" \n\t\n", "empty"),
        (b"text\0more", "binary, not text (a NUL byte at offset 4)"),
        (b"caf\xe9 au lait", "not UTF-8 text (byte 3"),
    ],
    ids=["empty", "whitespace", "binary", "latin1"],
)
def test_unusable_text_files_are_usage_errors_naming_the_file(tmp_path, content, says):
    path = tmp_path / "text.txt"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=r"--text_file .*text\.txt: ") as err:
        read_text(str(path))
    assert says in str(err.value) and err.value.exit_code == 2


def test_missing_directory_and_oversized_text_files_are_refused(tmp_path):
    with pytest.raises(UsageError, match="cannot be read"):
        read_text(str(tmp_path / "absent.txt"))
    with pytest.raises(UsageError, match="not a regular file"):
        read_text(str(tmp_path))
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)  # sparse: no 64 MiB written
    with pytest.raises(UsageError, match="more than the"):
        read_text(str(big))
    good = tmp_path / "ok.txt"
    good.write_text("héllo\n", encoding="utf-8")
    assert read_text(str(good)) == ("héllo\n", 7)


# ---- against transformers ----------------------------------------------------------------
def hf_perplexity(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """(perplexity, tokens scored): the stride loop of transformers' perplexity guide, the
    model's own mean loss over each window's unmasked labels weighted by their count."""
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = torch.tensor([ids[begin:end]])
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        n = int((labels[:, 1:] != -100).sum())  # the model shifts the labels by one
        if n:
            with torch.no_grad():
                loss = model(input_ids, labels=labels).loss
            nll_sum += float(loss) * n
            count += n
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / count), count


@pytest.fixture(scope="module")
def llm(tiny_engine, tiny_llama_dir):
    from llmc import LLM

    with LLM(tiny_engine(tiny_llama_dir, **SMALL_LIMITS), device="cpu") as served:
        yield served


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "gettysburg.txt"
    path.write_text(GETTYSBURG, encoding="utf-8")
    return path


@pytest.mark.parametrize("window, stride", [(None, None), (48, 20)], ids=["default", "strided"])
def test_eval_equals_transformers_perplexity(llm, tiny_llama_dir, text_file, window, stride):
    result = evaluate(llm, EvalSettings(str(text_file), window=window, stride=stride))
    ids = llm.tokenizer.encode(GETTYSBURG)
    w = window or SMALL_LIMITS["max_input_len"]
    assert result.window == w and result.stride == (stride or w)
    assert result.text_tokens == len(ids) and result.text_bytes == len(GETTYSBURG.encode())
    ppl, count = hf_perplexity(load_hf(tiny_llama_dir), ids, w, stride or w)
    assert result.tokens_scored == count
    assert result.windows == len(plan_windows(len(ids), w, stride or w))
    assert result.perplexity == pytest.approx(ppl, rel=1e-4)
    assert result.nll_mean == pytest.approx(math.log(ppl), rel=1e-4)
    d = result.to_dict()
    assert (d["schema"], d["schema_version"]) == ("llmc.eval", 1)
    assert (d["perplexity"], d["tokens_scored"]) == (result.perplexity, count)
    # every window was enqueued before the first step ran (batched in flight)
    arrivals = [r.arrival_time for r in llm.request_records[-result.windows :]]
    steps = [st for st in llm.step_records if st.start_time >= min(arrivals)]
    assert max(arrivals) <= min(st.start_time for st in steps)
    if stride:  # 48-token windows in 64-token steps: a step holds two windows' chunks
        assert max(st.batch_size for st in steps) > 1


def test_eval_refuses_a_window_beyond_the_engine(llm, text_file):
    with pytest.raises(ConfigError, match=r"--window 65: .*max_input_len=64"):
        evaluate(llm, EvalSettings(str(text_file), window=65))
    with pytest.raises(ConfigError, match=r"--stride 9: .*at most the window"):
        evaluate(llm, EvalSettings(str(text_file), window=8, stride=9))


def test_eval_refuses_a_text_of_one_token(llm, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a", encoding="utf-8")
    with pytest.raises(UsageError, match="1 token"):
        evaluate(llm, EvalSettings(str(one)))


def test_max_windows_bounds_what_is_scored(llm, text_file):
    result = evaluate(llm, EvalSettings(str(text_file), window=16, max_windows=3))
    assert (result.windows, result.tokens_scored) == (3, 3 * 15)


def test_the_front_door_returns_prompt_logprobs_for_a_text_prompt(llm):
    from llmc import SamplingParams

    [out] = llm.generate("Four score", SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    assert out.ok and len(out.prompt_logprobs) == len(out.prompt_token_ids) > 2
    assert out.prompt_logprobs[0] is None
    for tok, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert e.token_id == tok and e.logprob <= 0 and e.rank >= 1 and len(e.top) == 2
