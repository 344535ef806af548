"""The ``llmc`` app itself: ``--version`` / ``-V``, and every command registered."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llmc.base.version import ENGINE_FORMAT_VERSION, __version__
from llmc.cli.main import app


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    r = CliRunner().invoke(app, [flag])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"llmc {__version__} (engine format {ENGINE_FORMAT_VERSION})\n"


def test_version_wins_over_a_command():
    r = CliRunner().invoke(app, ["--version", "build", "--no-such-flag"])
    assert r.exit_code == 0 and r.stdout.startswith("llmc ")


def test_version_imports_no_torch():
    """``llmc --version`` is instant: neither the app nor the flag imports torch."""
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from llmc.cli.main import app\n"
        "r = CliRunner().invoke(app, ['--version'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "none"


def test_every_command_is_registered():
    names = {c.name for c in app.registered_commands}
    assert names == {
        "build",
        "import",
        "run",
        "bench",
        "profile",
        "eval",
        "calibrate",
        "compare",
        "serve",
    }
