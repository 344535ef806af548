"""``llmc calibrate`` on a tiny Llama engine with an fp8 KV cache: the scales it stores are
the observed ranges / 448 (checked against ranges computed here from the engine's own
qkv projections), the engine still loads (checksums renewed) and records the calibration,
both flag spellings; every bad input with its exit code, nothing written then."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from helpers.engines import SMALL_LIMITS
from llmc.cli.main import app
from llmc.compiler.engine_format import WEIGHTS, load_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom.\n" * 6


@pytest.fixture(scope="module")
def built(tiny_engine, tiny_llama_dir):
    return tiny_engine(tiny_llama_dir, kv_cache_dtype="fp8", **SMALL_LIMITS)


@pytest.fixture()
def engine(built, tmp_path):
    """A private copy (calibration rewrites the engine)."""
    return shutil.copytree(built, tmp_path / "engine")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def calibrate(*args: object):
    return CliRunner().invoke(app, ["calibrate", *map(str, args)])


def _scales(engine) -> torch.Tensor:
    w = load_engine(engine).load_weights()
    return torch.stack([w[f"layers.{i}.kv_scale"] for i in range(2)])


def test_scales_are_the_observed_ranges_over_448(engine, text):
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
    from llmc.runtime.kv_calibration import observe

    assert torch.equal(_scales(engine), torch.ones(2, 2))
    res = calibrate("--engine_dir", engine, "--text-file", text, "--window", "16", "--json", "-")
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["previous"] == [[1.0, 1.0]] * 2 and out["windows"] >= 2
    stored = _scales(engine)
    assert torch.equal(stored, torch.tensor(out["scales"], dtype=torch.float32))
    manifest = load_engine(engine).manifest  # loads: every checksum renewed
    assert manifest["calibration"]["kv_cache"]["method"] == "max"
    # the same ranges, observed again on the calibrated engine, from the raw projections
    rt = EngineRuntime.load(engine, RuntimeConfig(device="cpu", backend="torch"))
    ids = rt.tokenizer.encode(TEXT)[: out["tokens"]]
    obs = observe(rt, [ids[b : b + 16] for b in range(0, len(ids), 16)])
    again = torch.tensor([obs.k_amax, obs.v_amax]).T / 448
    torch.testing.assert_close(stored, again.float(), rtol=0.15, atol=0)
    assert (stored > 0).all() and (stored < 1).all()


def test_observer_bounds_rotated_keys(tiny_engine, tiny_llama_dir):
    """The k range is the largest rotation-pair norm: >= every rotated k the cache holds."""
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
    from llmc.runtime.kv_calibration import observe

    engine = tiny_engine(tiny_llama_dir, **SMALL_LIMITS)  # float32 KV: exact values
    rt = EngineRuntime.load(engine, RuntimeConfig(device="cpu", backend="torch"))
    ids = rt.tokenizer.encode(TEXT)[:48]
    obs = observe(rt, [ids])
    for i in range(rt.runner.spec.num_layers):
        k, v = rt.runner.kv_cache.layer(i)
        written_k, written_v = k.abs().max().item(), v.abs().max().item()
        assert written_k <= obs.k_amax[i] * (1 + 1e-6) and written_k >= obs.k_amax[i] / 2**0.5
        assert written_v == pytest.approx(obs.v_amax[i], rel=1e-6)
    assert obs.rows == len(ids)


def test_bad_inputs_write_nothing(built, tiny_engine, tiny_llama_dir, engine, text, tmp_path):
    before = (engine / WEIGHTS).read_bytes()
    no_fp8 = tiny_engine(tiny_llama_dir, **SMALL_LIMITS)
    cases = [
        (("--text_file", text), 2, "--engine_dir is required"),
        (("--engine_dir", engine), 2, "--text_file is required"),
        (("--engine_dir", engine, "--text_file", tmp_path / "missing.txt"), 2, "cannot be read"),
        (("--engine_dir", no_fp8, "--text_file", text), 3, "not fp8"),
        (("--engine_dir", engine, "--text_file", text, "--num_tokens", "0"), 3, "--num_tokens 0"),
        (("--engine_dir", tmp_path, "--text_file", text), 7, ""),
    ]
    for args, code, needle in cases:
        res = calibrate(*args)
        assert res.exit_code == code, (args, res.output)
        assert needle in res.output and "Traceback" not in res.output, res.output
    assert (engine / WEIGHTS).read_bytes() == before
