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


def _options():
    """(command, option) of every registered command. By ``param_type_name``: typer 0.29
    vendors click (``typer._click``), so its options are not ``click.Option``s."""
    import typer.main

    for name, cmd in typer.main.get_command(app).commands.items():
        for param in cmd.params:
            if param.param_type_name == "option" and param.name != "help":
                yield name, param


@pytest.mark.parametrize("command", ["build", "import", "run", "bench", "profile", "eval",
                                     "calibrate", "compare", "serve"])  # fmt: skip
def test_every_flag_says_its_default_and_takes_both_spellings(command):
    """Each option of each command says its default (or that it is required) in its help,
    and a multi-word flag is accepted with dashes and with underscores."""
    options = [p for name, p in _options() if name == command]
    assert options or command == "compare", command  # (compare: arguments and --json only)
    for p in options:
        assert p.help and ("Default" in p.help or "Required" in p.help), (command, p.opts)
        names = set(p.opts)
        assert any("_" in n for n in names) == any("-" in n[2:] for n in names), names
