"""``llmc build`` / ``llmc import`` through the CLI: every bad input → message + exit code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.compiler import builder


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def dry(*args: str):
    """A dry run with --json; returns the parsed result (asserting exit 0)."""
    r = run("build", "--dry_run", "--json", *args)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def assert_fails(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.stderr, result.stdout)
    err = result.stderr
    assert "Traceback" not in err and result.stdout == ""
    for f in fragments:
        assert f in err, (f, err)


@pytest.fixture
def ckpt(tiny_llama_dir, tmp_path):
    """A private copy of the tiny Llama checkpoint to break."""
    return shutil.copytree(tiny_llama_dir, tmp_path / "ckpt")


def _edit_tensors(ckpt, fn):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---- bad checkpoints --------------------------------------------------------------------
def test_missing_config_json(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    r = run("build", "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "e")
    assert_fails(r, 4, "config.json")


def test_wrong_shape_tensor(ckpt, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    _edit_tensors(ckpt, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    r = run("build", "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "e")
    assert_fails(r, 4, name, "[16, 64]", "expected [32, 64]")
    assert not (tmp_path / "e").exists()


def test_missing_tensor(ckpt, tmp_path):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    r = run("build", "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "e")
    assert_fails(r, 4, "model.layers.0.mlp.up_proj.weight", "missing")


def test_unexpected_tensor(ckpt, tmp_path):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(2)))
    r = run("build", "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "e")
    assert_fails(r, 4, "unexpected", "model.layers.9.extra.weight")


def test_truncated_safetensors(ckpt, tmp_path):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    r = run("build", "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "e")
    assert_fails(r, 4, "model.safetensors")
    assert not (tmp_path / "e").exists()


def test_truncated_gguf(smollm2_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    r = run("build", "--checkpoint_dir", bad, "--output_dir", tmp_path / "e")
    assert_fails(r, 4, "cut.gguf")


def test_unsupported_architecture(ckpt, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = run("build", "--checkpoint_dir", ckpt, "--output_dir", tmp_path / "e")
    assert_fails(r, 5, "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")


# ---- bad settings -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "code", "fragments"),
    [
        (["--max_input_len", "400", "--max_seq_len", "300"], 3, ["max_input_len (400)", "(300)"]),
        (["--max_input_len", "1000"], 3, ["max_input_len (1000)", "max_seq_len (512)"]),
        (["--max_num_tokens", "16", "--tokens_per_block", "32"], 3, ["tokens_per_block (32)"]),
        (
            ["--max_num_tokens", "256", "--no_chunked_prefill"],
            3,
            ["max_num_tokens (256)", "max_input_len (512)", "chunked prefill"],
        ),
        (["--max_batch_size", "0"], 3, ["max_batch_size must be a positive integer, got 0"]),
        (["--max_seq_len", "-4"], 3, ["max_seq_len must be a positive integer, got -4"]),
        (["--tokens_per_block", "0"], 3, ["tokens_per_block"]),
        (["--dtype", "float8"], 5, ["dtype 'float8'", "bfloat16"]),
        (["--dtype", "bfloat61"], 5, ["did you mean 'bfloat16'"]),
        (["--target", "tpu"], 5, ["target 'tpu'"]),
        (["--load_format", "npz"], 3, ["load_format 'npz'"]),
        (["--kv_cache_free_gpu_mem_fraction", "1.5"], 3, ["kv_cache_free_gpu_mem_fraction"]),
    ],
)
def test_bad_settings(tiny_llama_dir, args, code, fragments):
    r = run("build", "--dry_run", "--checkpoint_dir", tiny_llama_dir, *args)
    assert_fails(r, code, *fragments)


def test_unknown_flag_suggests(tiny_llama_dir):
    r = run("build", "--checkpoint_dir", tiny_llama_dir, "--max_num_token", "64")
    assert r.exit_code == 2
    assert "--max_num_token" in r.stderr and "--max_num_tokens" in r.stderr


def test_no_model_given(tmp_path):
    r = run("build", "--output_dir", tmp_path / "e")
    assert_fails(r, 3, "--checkpoint_dir")


def test_existing_output_dir_needs_force(tiny_llama_dir, tmp_path):
    (tmp_path / "e").mkdir()
    r = run("build", "--checkpoint_dir", tiny_llama_dir, "--output_dir", tmp_path / "e")
    assert_fails(r, 3, "already exists", "--force")


# ---- profiles ---------------------------------------------------------------------------
def test_yaml_not_a_mapping(tiny_llama_dir, tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("- just\n- a list\n")
    r = run("build", "--dry_run", "--checkpoint_dir", tiny_llama_dir, "--profile", p)
    assert_fails(r, 2, "p.yaml", "must be a mapping", "list")


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("build:\n  max_num_token: 64\n", ["max_num_token", "did you mean 'max_num_tokens'"]),
        ("biuld:\n  max_num_tokens: 64\n", ["biuld", "did you mean 'build'"]),
        ("build: [1, 2]\n", ["section 'build' must be a mapping"]),
        ("build:\n  max_batch_size: lots\n", ["max_batch_size must be a int, got 'lots'"]),
    ],
)
def test_bad_yaml_keys(tiny_llama_dir, tmp_path, text, fragments):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    r = run("build", "--dry_run", "--checkpoint_dir", tiny_llama_dir, "--profile", p)
    assert_fails(r, 2, *fragments)


def test_unknown_profile_name():
    r = run("build", "--dry_run", "--profile", "llama3-8c")
    assert_fails(r, 2, "llama3-8c", "did you mean 'llama3-8b'")


def test_precedence_cli_over_yaml_over_defaults(tiny_llama_dir, tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("build:\n  max_num_tokens: 128\n  max_batch_size: 4\n  dtype: float16\n")
    d = dry("--checkpoint_dir", tiny_llama_dir, "--profile", p, "--max_num_tokens", "256")
    b = d["build"]
    assert b["max_num_tokens"] == 256  # CLI
    assert b["max_batch_size"] == 4 and b["dtype"] == "float16"  # YAML
    assert b["tokens_per_block"] == 32 and b["max_seq_len"] == 512  # defaults / model


@pytest.mark.parametrize("flag", ["--max_num_tokens", "--max-num-tokens"])
def test_dash_and_underscore_spellings(tiny_llama_dir, flag):
    d = dry("--checkpoint-dir", tiny_llama_dir, flag, "96", "--tokens-per-block", "16")
    assert d["build"]["max_num_tokens"] == 96 and d["build"]["tokens_per_block"] == 16


# ---- output -----------------------------------------------------------------------------
def test_json_output_and_dry_run_writes_nothing(tiny_llama_dir, tmp_path):
    out = tmp_path / "e"
    r = run("build", "--dry_run", "--json", "--checkpoint_dir", tiny_llama_dir, "--output_dir", out)
    assert r.exit_code == 0
    d = json.loads(r.stdout)  # nothing but JSON on stdout
    assert d["dry_run"] is True and d["output_dir"] is None
    assert d["plan"]["workspace_bytes"] <= d["plan"]["naive_workspace_bytes"]
    assert "[plan]" in r.stderr  # progress went to stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_build_prints_tables_and_loads(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "e"
    r = run("build", "--checkpoint_dir", tiny_qwen2_dir, "--output_dir", out, "--gpu_memory_gb", 1)
    assert r.exit_code == 0, r.stderr
    for text in ("memory plan", "workspace (packed / naive)", "KV cache per token", "requests at"):
        assert text in r.stdout
    from llmc.compiler.engine_format import load_engine

    assert load_engine(out).spec.qkv_bias


def test_capacity_exit_code_before_weights(tiny_llama_dir, monkeypatch):
    import llmc.compiler.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda p: pytest.fail("read weights"))
    r = run("build", "--checkpoint_dir", tiny_llama_dir, "--gpu_memory_gb", "0.0001")
    assert_fails(r, 6, "does not fit", "--gpu_memory_gb")


def test_unexpected_error_is_one_line(tiny_llama_dir, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(builder, "plan_memory", boom)
    r = run("build", "--dry_run", "--checkpoint_dir", tiny_llama_dir)
    assert_fails(r, 1, "unexpected RuntimeError: kaboom", "LLMC_DEBUG=1")


def test_dummy_profile_dry_run_uses_its_model():
    d = dry("--profile", "smollm2-135m-dummy")
    assert d["model"]["hidden_size"] == 576 and d["model"]["tie_word_embeddings"] is True
    assert d["build"]["load_format"] == "dummy"


def test_llama3_8b_dry_run_under_5_seconds():
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "llmc.cli.main", "build", "--dry_run", "--profile", "llama3-8b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert "memory plan" in r.stdout and "128256" in r.stdout
    assert elapsed < 5, f"dry run took {elapsed:.1f} s"


@pytest.mark.parametrize("profile", ["llama3-8b", "smollm2-135m-dummy"])
def test_dry_run_does_not_import_torch(profile):
    """A dry run reads headers only: torch (most of the 5 s above on a loaded box) stays out."""
    code = (
        "import sys\n"
        "from llmc.cli.main import app\n"
        f"try:\n    app(['build', '--dry_run', '--profile', {profile!r}])\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("NO-TORCH"), r.stdout[-300:]


# ---- import -----------------------------------------------------------------------------
def test_import_refuses_bad_input(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF")
    r = run("import", "--gguf", bad, "--output-dir", tmp_path / "hf")
    assert_fails(r, 4, "x.gguf")
    assert not (tmp_path / "hf").exists()
    (tmp_path / "hf").mkdir()
    r = run("import", "--gguf", bad, "--output_dir", tmp_path / "hf")
    assert_fails(r, 3, "already exists")
    r = run("import", "--output_dir", tmp_path / "hf2")
    assert_fails(r, 2, "--gguf")
