"""The sampling launch plan (llmc.cuda.sampling_ops) on the CPU: slice sizes, kernel choice."""

from __future__ import annotations

import pytest

from llmc.cuda.sampling_ops import SAMPLE_CLUSTER, sample_plan, sample_slice

BUDGET = 232448 - 8192  # the H200's opt-in shared memory less the kernel's static part


@pytest.mark.parametrize("v", [1, 3, 4, 31, 32, 33, 1000, 49152, 49157, 128256, 152064, 262144])
def test_slices_cover_the_row_in_aligned_pieces(v):
    n = sample_slice(v)
    assert n % 4 == 0 and SAMPLE_CLUSTER * n >= v
    assert SAMPLE_CLUSTER * (n - 4) < v  # no more than one vector of padding per slice


def test_plan_picks_the_cluster_kernel_when_slices_fit():
    assert sample_slice(128256) == 16032
    assert sample_plan(64, 128256, False, True, BUDGET) == (
        "sample_cluster_kernel", (SAMPLE_CLUSTER, 64), 4 * 16032,
    )  # fmt: skip
    assert sample_plan(3, 128256, True, True, BUDGET) == (
        "sample_cluster_kernel", (SAMPLE_CLUSTER, 3), 0,
    )  # fmt: skip


def test_plan_falls_back_to_one_cta_per_row():
    too_big = SAMPLE_CLUSTER * (BUDGET // 4 + 4)
    assert sample_plan(5, too_big, False, True, BUDGET) == ("sample_kernel", (5,), 0)
    assert sample_plan(5, too_big, True, True, BUDGET)[0] == "sample_cluster_kernel"  # greedy
    assert sample_plan(64, 128256, False, False, BUDGET) == ("sample_kernel", (64,), 0)
    assert sample_plan(70000, 1000, False, True, BUDGET) == ("sample_kernel", (70000,), 0)
