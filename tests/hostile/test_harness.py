"""The hostile-input harness itself (tests/helpers/hostile.py): it runs a case in a bounded
child process and holds a failed command to its promises."""

from __future__ import annotations

import pytest

from helpers.hostile import Case, Outcome, assert_clean_failure, run_case


def test_a_missing_checkpoint_fails_cleanly(tmp_path):
    case = Case(
        "missing checkpoint",
        ["build", "--checkpoint_dir", "{tmp}/nope", "--dry_run"],
        exit_code=4,
        says=["{tmp}/nope"],
    )
    out = run_case(case, tmp=tmp_path)
    assert out.seconds < case.timeout_s


@pytest.mark.parametrize(
    "out",
    [
        Outcome(1, "", "Traceback (most recent call last):\n  ...\nValueError: x", 0.1),
        Outcome(4, "{}", "error: bad", 0.1),
        Outcome(3, "", "error: bad", 0.1),
        Outcome(4, "", "", 0.1),
    ],
)
def test_the_promises_are_checked(out):
    with pytest.raises(AssertionError):
        assert_clean_failure(out, 4, ["bad"])
