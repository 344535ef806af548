"""``llmc import``: a GGUF file → a HuggingFace checkpoint directory (atomically written).

The directory (config.json, model.safetensors in float32, tokenizer files, and the
``llmc_import.json`` marker by which a later ``--force`` knows the directory is one llmc
import wrote) can then be built with ``llmc build --checkpoint_dir DIR`` or loaded by
transformers. ``--force`` replaces only such a directory or an empty one (exit 3 otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmc.base.errors import UsageError
from llmc.cli.options import JSON_OPTION, err_console, handle_errors, option, print_json


def import_command(
    gguf: Annotated[
        str | None,
        option("gguf", "GGUF file to import. Default: none (required).", metavar="FILE"),
    ] = None,
    output_dir: Annotated[
        str | None,
        option(
            "output_dir",
            "HuggingFace checkpoint directory to write; refused if it exists unless --force. "
            "Default: none (required).",
            metavar="DIR",
        ),
    ] = None,
    force: Annotated[
        bool, option("force", "Replace an existing --output_dir. Default: off.")
    ] = False,
    json_out: Annotated[bool, JSON_OPTION] = False,
) -> None:
    """Convert a GGUF file into a HuggingFace checkpoint directory."""
    from llmc.compiler.gguf_reader import import_gguf
    from llmc.compiler.output_dir import check_output_dir

    if gguf is None or output_dir is None:
        missing = "--gguf" if gguf is None else "--output_dir"
        raise UsageError(
            f"llmc import needs {missing} (usage: llmc import --gguf FILE --output_dir DIR)"
        )
    out = Path(output_dir)
    check_output_dir(out, force, kind="import", inputs=[gguf])
    log = err_console()
    if not json_out:
        log.print(f"llmc import: {gguf} -> {out}", markup=False)
    import_gguf(gguf, out, force=force, report=lambda m: log.print(m, markup=False))
    files = sorted(p.name for p in out.iterdir())
    if json_out:
        print_json({"output_dir": str(out), "files": files})
    else:
        err_console().print(f"wrote {out}: {', '.join(files)}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("import")(handle_errors(import_command))
