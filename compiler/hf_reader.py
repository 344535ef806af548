"""HuggingFace checkpoint directories: config.json, safetensors (single or sharded), tokenizer.

What this module owns: finding and reading the files of an HF model directory, and turning
every way they can be broken (missing, truncated, not JSON, an index naming a shard that is
absent or a tensor that its shard lacks, a tensor in two shards) into a CheckpointError that
names the file. Tensors keep the dtype they were stored in.

Tokenizer files are returned as bytes: ``tokenizer.json`` and ``tokenizer_config.json`` are
required; ``generation_config.json`` and ``special_tokens_map.json`` are copied when present.
A ``chat_template.jinja`` (how transformers 5 saves a template) is folded into
``tokenizer_config.json``'s ``chat_template`` so that one file carries it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.input_bounds import MAX_TENSORS, config_int

if TYPE_CHECKING:  # safetensors makes the tensors; importing this module needs no torch
    import torch

T = TypeVar("T")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json", "special_tokens_map.json")
TOKENIZER_FILES = REQUIRED_TOKENIZER_FILES + OPTIONAL_FILES
"""What the engine takes from an HF directory besides config and weights."""


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid JSON file ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: JSON nested too deeply") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """``read_json`` of a file whose top level must be an object (CheckpointError else)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: checkpoint directory does not exist")
    return read_json_object(d / "config.json")


def read_generation_eos(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids of generation_config.json (transformers' generate stops on these), or ()."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = read_json_object(path).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(config_int(e, "eos_token_id", str(path)) for e in _as_list(eos))


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def shard_map(model_dir: str | Path) -> dict[Path, list[str] | None]:
    """Safetensors files of the checkpoint → tensor names the index assigns them (None: all)."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map'")
        if len(weight_map) > MAX_TENSORS:
            raise CheckpointError(
                f"{index}: {len(weight_map)} tensors exceed llmc's limit of {MAX_TENSORS}"
            )
        shards: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            shards.setdefault(_shard_path(d, index, name, shard), []).append(name)  # type: ignore[union-attr]
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard named in {index.name} is missing")
        return shards
    if (d / SINGLE_FILE).is_file():
        return {d / SINGLE_FILE: None}
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise UnsupportedError(
            f"{d}: only safetensors checkpoints are supported (found PyTorch .bin/.pt files); "
            "convert with transformers' save_pretrained(safe_serialization=True)"
        )
    raise CheckpointError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _shard_path(d: Path, index: Path, name: str, shard: Any) -> Path:
    """The file an index entry names: a plain file name inside the checkpoint directory."""
    if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in ("..", "."):
        raise CheckpointError(
            f"{index}: tensor {name[:80]!r} names shard {str(shard)[:80]!r}; a shard must be a "
            "file name inside the checkpoint directory"
        )
    return d / shard


def _open(shard: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(shard), framework="pt")
    except Exception as e:  # SafetensorError / OSError: truncated, corrupt header, ...
        raise CheckpointError(f"{shard}: cannot read safetensors file ({e})") from None


def _read_tensors(model_dir: str | Path, read: Callable[[Path, Any, str], T]) -> dict[str, T]:
    """``read(shard, handle, name)`` for every tensor of every shard, by name.

    Each shard must hold every tensor the index names for it, and no name may appear in two
    shards (CheckpointError otherwise).
    """
    out: dict[str, T] = {}
    for shard, names in shard_map(model_dir).items():
        with _open(shard) as f:
            keys = list(f.keys())
            absent = sorted(set(names or ()) - set(keys))
            if absent:
                name = absent[0]
                raise CheckpointError(f"{shard}: tensor {name!r} named in the index is not in it")
            for k in keys:
                if k in out:
                    raise CheckpointError(f"{shard}: tensor {k!r} also appears in another shard")
                out[k] = read(shard, f, k)
    return out


def hf_tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor, from the safetensors headers only (no data read)."""
    return _read_tensors(model_dir, lambda shard, f, k: tuple(f.get_slice(k).get_shape()))


def load_hf_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, in its stored dtype."""

    def read(shard: Path, f: Any, k: str) -> torch.Tensor:
        try:
            return f.get_tensor(k)
        except Exception as e:
            raise CheckpointError(f"{shard}: cannot read tensor {k!r} ({e})") from None

    return _read_tensors(model_dir, read)


def read_tokenizer_files(model_dir: str | Path) -> dict[str, bytes]:
    d = Path(model_dir)
    files: dict[str, bytes] = {}
    for name in REQUIRED_TOKENIZER_FILES:
        if not (d / name).is_file():
            raise CheckpointError(f"{d / name} is missing (the engine needs the tokenizer)")
    tok_cfg = read_json_object(d / "tokenizer_config.json")
    check_tokenizer(d / "tokenizer.json")
    template = d / "chat_template.jinja"
    if "chat_template" not in tok_cfg and template.is_file():
        tok_cfg["chat_template"] = _read_text(template)
    check_chat_template(tok_cfg.get("chat_template"), d / "tokenizer_config.json")
    files["tokenizer.json"] = (d / "tokenizer.json").read_bytes()
    files["tokenizer_config.json"] = json.dumps(tok_cfg, indent=2, ensure_ascii=False).encode()
    for name in OPTIONAL_FILES:
        if (d / name).is_file():
            files[name] = (d / name).read_bytes()
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None


def check_tokenizer(path: Path) -> None:
    """Load ``tokenizer.json`` once, as the engine will: one that does not load is refused at
    build time rather than by every later run."""
    from tokenizers import Tokenizer

    read_json_object(path)
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception for a bad model section
        reason = " ".join(str(e).split())[:200]
        raise CheckpointError(f"{path}: the tokenizer does not load ({reason})") from None


def check_chat_template(template: Any, where: Path) -> None:
    """A chat template is absent, a string, or transformers' list of named templates."""
    if template is None or isinstance(template, str):
        return
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("template"), str) for t in template
    ):
        return
    raise CheckpointError(
        f"{where}: chat_template must be a string (or a list of named templates), "
        f"got {type(template).__name__}"
    )
