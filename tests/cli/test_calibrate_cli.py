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
    smoothed = [obs.smoothed_k_amax(i) for i in range(2)]  # smooth K: max |k - k_mean|
    again = torch.tensor([smoothed, obs.v_amax]).T / 448
    torch.testing.assert_close(stored, again.float(), rtol=0.15, atol=0)
    assert (stored > 0).all() and (stored < 1).all()
    assert out["smooth_k"] and manifest["calibration"]["kv_cache"]["smooth_k"]
    assert len(out["k_amax_unsmoothed"]) == 2 and min(out["k_amax_unsmoothed"]) > 0


def _k_means(engine) -> torch.Tensor:
    w = load_engine(engine).load_weights()
    return torch.stack([w[f"layers.{i}.k_mean"] for i in range(2)])


def test_k_mean_is_the_mean_rotated_key_and_no_smooth_k_zeroes_it(engine, text):
    """The stored k_mean is the mean of the keys the cache held (after RoPE), per KV head and
    channel: checked against a float32-KV run of the same prompts; --no_smooth_k stores
    zeros and the rotation-pair bound of k."""
    from llmc.runtime.engine_runtime import EngineRuntime, RuntimeConfig
    from llmc.runtime.kv_calibration import observe

    assert not _k_means(engine).any()  # built: smooth K off
    res = calibrate("--engine_dir", engine, "--text_file", text, "--window", "64", "--json", "-")
    assert res.exit_code == 0, res.stderr
    means = _k_means(engine)
    rt = EngineRuntime.load(engine, RuntimeConfig(device="cpu", backend="torch"))
    ids = rt.tokenizer.encode(TEXT)[: json.loads(res.stdout)["tokens"]]
    captured: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    inner = rt.runner.layers.backend
    layer_of = {rt.runner.kv_cache.layer(i)[0].data_ptr(): i for i in range(2)}
    spec = rt.runner.spec

    class Capture:  # the rotated k each layer writes, from the reference's own rotation
        def __getattr__(self, name):
            return getattr(inner, name)

        def rope_and_cache_write(self, qkv, positions, cos, sin, k_cache, v, slots, *rest, **kw):
            from llmc.cuda import reference as ref

            nq, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
            k = qkv[:, nq * hd : (nq + nkv) * hd].reshape(-1, nkv, hd)
            c, s = cos.index_select(0, positions), sin.index_select(0, positions)
            captured[layer_of[k_cache.data_ptr()]].append(ref.apply_rope(k, c, s)[slots >= 0])
            return inner.rope_and_cache_write(
                qkv, positions, cos, sin, k_cache, v, slots, *rest, **kw
            )

    rt.runner.layers.backend = Capture()
    obs = observe(rt, [ids[b : b + 64] for b in range(0, len(ids), 64)])
    rt.runner.layers.backend = inner
    for i in range(2):  # the observer's mean is the mean of what the cache was given
        torch.testing.assert_close(obs.k_mean(i), torch.cat(captured[i]).mean(0))
    # layer 0's keys do not depend on the cache: the stored mean is theirs (layer 1's input
    # carries layer 0's fp8 rounding, which calibration changed)
    torch.testing.assert_close(means[0], obs.k_mean(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(means[1], obs.k_mean(1), rtol=0, atol=0.05)
    assert means.abs().max() > 0.01
    del rt
    res = calibrate("--engine_dir", engine, "--text_file", text, "--window", "64",
                    "--no_smooth_k", "--json", "-")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert not _k_means(engine).any() and not json.loads(res.stdout)["smooth_k"]
    want = torch.tensor(obs.k_amax) / 448
    torch.testing.assert_close(_scales(engine)[:, 0], want.float(), rtol=0.15, atol=0)


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


def test_a_format_2_engine_with_an_fp8_kv_cache_is_refused_with_its_rebuild(engine):
    from llmc.base.errors import EngineError

    m = json.loads((engine / "manifest.json").read_text())
    m["format_version"] = 2
    (engine / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        EngineError, match="format version 2: its fp8 KV cache has no smooth-K"
    ) as e:
        load_engine(engine)
    assert "llmc build --checkpoint_dir" in str(e.value)
    r = CliRunner().invoke(app, ["run", "--engine_dir", str(engine), "--prompt", "hello"])
    assert r.exit_code == 7 and "smooth-K" in r.output and "Traceback" not in r.output
