"""tests/helpers/failure_log.py: failing node ids reach LLMC_FAILED_LOG as they happen."""

from __future__ import annotations

pytest_plugins = ["pytester"]


def test_failures_are_logged_by_node_id(pytester, monkeypatch, tmp_path):
    log = tmp_path / "failed.txt"
    monkeypatch.setenv("LLMC_FAILED_LOG", str(log))
    pytester.makepyfile(
        test_x="""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("setup fails")

        def test_ok():
            pass

        def test_bad():
            assert 1 == 2

        def test_setup(broken):
            pass
        """
    )
    result = pytester.runpytest("-p", "helpers.failure_log", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    assert log.read_text().splitlines() == [
        "test_x.py::test_bad call",
        "test_x.py::test_setup setup",
    ]
