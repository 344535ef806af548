"""llmc.base.errors: one exit code per error class, declared once, looked up both ways."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmc.base import errors
from llmc.base.errors import BenchFailure, ConfigError, LlmcError, UsageError, error_class

README = Path(__file__).resolve().parents[2] / "README.md"


def _classes() -> list[type[LlmcError]]:
    return [getattr(errors, n) for n in errors.__all__ if n[0].isupper() and n != "LlmcError"]


def test_each_class_has_its_own_code():
    codes = [cls.exit_code for cls in _classes()]
    assert LlmcError.exit_code == 1
    assert sorted(codes) == list(range(2, 2 + len(codes)))
    assert UsageError.exit_code == 2 and BenchFailure.exit_code == 9


def test_error_class_inverts_exit_code():
    for cls in _classes():
        assert error_class(cls.exit_code) is cls
    assert error_class(1) is LlmcError
    assert error_class(None) is LlmcError
    assert error_class(99) is LlmcError


def test_a_taken_code_is_refused():
    with pytest.raises(TypeError, match=r"exit code 3 is taken \(ConfigError\)"):

        class Again(LlmcError, exit_code=3):
            pass

    with pytest.raises(TypeError, match="exit code 1 is taken"):

        class Internal(LlmcError, exit_code=1):
            pass

    assert error_class(3) is ConfigError


def test_a_subclass_without_code_shares_its_parents():
    class TooBig(ConfigError):
        pass

    assert TooBig.exit_code == ConfigError.exit_code
    assert error_class(ConfigError.exit_code) is ConfigError


def test_readme_documents_every_code():
    table = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", README.read_text(), re.M))
    assert set(table) == {"0", "1"} | {str(cls.exit_code) for cls in _classes()}


def test_check_positive_ints_names_the_first_bad_value():
    from llmc.base.errors import check_positive_ints

    check_positive_ints({"a": 1, "b": 7}, "cfg", ConfigError)
    with pytest.raises(ConfigError, match=r"^cfg: b must be a positive integer, got 0$"):
        check_positive_ints({"a": 1, "b": 0, "c": -1}, "cfg", ConfigError)
    with pytest.raises(UsageError, match="a must be a positive integer, got '2'"):
        check_positive_ints({"a": "2"}, "cfg", UsageError)


def test_model_and_kernel_configs_share_the_rule():
    from llmc.base.errors import UnsupportedError
    from llmc.cuda.kernels import KernelConfig

    with pytest.raises(UnsupportedError, match="kernel config: num_kv_heads must be a positive"):
        KernelConfig("float32", 64, 4, 0)


def test_bad_value_errors_are_value_errors_with_their_codes():
    """What code ported from vLLM / TensorRT-LLM catches; the exit codes stay the classes'."""
    from llmc.base.errors import RequestError

    for cls, code in ((ConfigError, 3), (RequestError, 8)):
        assert issubclass(cls, ValueError) and issubclass(cls, LlmcError)
        assert cls.exit_code == code and error_class(code) is cls
        with pytest.raises(ValueError, match="bad"):
            raise cls("bad")
    assert not issubclass(UsageError, ValueError) and not issubclass(BenchFailure, ValueError)
