"""``llmc build --tp_size N``: per-rank weight files that put back together (along the split
axes, by the Megatron rule written out here, not by llmc's own layout code) are the
tp_size-1 engine's weights bit for bit; per-rank plans and their KV capacity; the manifest;
bad inputs with their exit codes."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers.checkpoints import TINY_LLAMA
from llmc.base.errors import EngineError
from llmc.cli.main import app
from llmc.compiler import builder
from llmc.compiler.build_config import BuildConfig
from llmc.compiler.builder import build
from llmc.compiler.dummy import dummy_weights
from llmc.compiler.engine_files import sha256_file
from llmc.compiler.engine_format import load_engine
from llmc.compiler.spec import ModelSpec


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setattr(builder, "detect_gpu", lambda: None)


def _build(ckpt, out, tp: int, **kw):
    cfg = BuildConfig(
        checkpoint_dir=str(ckpt),
        output_dir=str(out),
        tp_size=tp,
        dtype="float32",
        target="cpu",
        max_seq_len=128,
        max_num_tokens=64,
        **kw,
    )
    return build(cfg)


def _assemble(spec: ModelSpec, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole model's tensors from the ranks' (Megatron: q/k/v and gate/up by rows per
    rank, o/down by columns, the rest replicated; a KV head held by several ranks is taken
    once, and every copy must be equal)."""
    n, hd = len(ranks), spec.head_dim
    hq, kv = spec.num_heads // n, spec.num_kv_heads
    kvr = max(1, kv // n)  # KV heads per rank
    ir = spec.intermediate_size // n
    out: dict[str, torch.Tensor] = {}
    for name, t0 in ranks[0].items():
        parts = [r[name] for r in ranks]
        if name.endswith(("qkv_proj", "qkv_bias")):
            qs = [p[: hq * hd] for p in parts]
            ks = [p[hq * hd : (hq + kvr) * hd] for p in parts]
            vs = [p[(hq + kvr) * hd :] for p in parts]
            if kv < n:  # rank r holds KV head r * kv // n; its copies are equal
                owners = [r * kv // n for r in range(n)]
                for r, head in enumerate(owners):
                    first = owners.index(head)
                    assert torch.equal(ks[r], ks[first]) and torch.equal(vs[r], vs[first])
                ks = [ks[owners.index(h)] for h in range(kv)]
                vs = [vs[owners.index(h)] for h in range(kv)]
            out[name] = torch.cat([*qs, *ks, *vs])
        elif name.endswith("gate_up_proj"):
            out[name] = torch.cat([p[:ir] for p in parts] + [p[ir:] for p in parts])
        elif name.endswith(("o_proj", "down_proj")):
            out[name] = torch.cat(parts, dim=1)
        else:
            assert all(torch.equal(p, t0) for p in parts), name  # replicated
            out[name] = t0
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_files_put_together_are_the_tp1_weights(request, tmp_path, fixture, tp):
    ckpt = request.getfixturevalue(fixture)
    _build(ckpt, tmp_path / "tp1", 1)
    res = _build(ckpt, tmp_path / f"tp{tp}", tp)
    whole = load_file(tmp_path / "tp1" / "weights.safetensors")
    ranks = [load_file(tmp_path / f"tp{tp}" / f"weights.rank{r}.safetensors") for r in range(tp)]
    assert not (tmp_path / f"tp{tp}" / "weights.safetensors").exists()
    spec = res.spec
    h, hd = spec.hidden_size, spec.head_dim
    kv_rank = max(1, spec.num_kv_heads // tp)  # tp 4 > 2 KV heads: each replicated twice
    assert ranks[0]["layers.0.qkv_proj"].shape == ((spec.num_heads // tp + 2 * kv_rank) * hd, h)
    assert ranks[0]["layers.0.down_proj"].shape == (h, spec.intermediate_size // tp)
    got = _assemble(spec, ranks)
    assert got.keys() == whole.keys()
    for name, t in whole.items():
        assert torch.equal(got[name], t), name
    if fixture == "tiny_qwen2_dir":
        assert "layers.0.qkv_bias" in ranks[0]


def test_manifest_plans_and_loading_per_rank(tiny_llama_dir, tmp_path):
    res = _build(tiny_llama_dir, tmp_path / "e", 2)
    d = tmp_path / "e"
    m = json.loads((d / "manifest.json").read_text())
    assert m["build"]["tp_size"] == 2 and m["build_config"]["tp_size"] == 2
    tp = m["tensor_parallel"]
    assert tp["tp_size"] == 2
    assert [(r["weights"], r["plan"]) for r in tp["ranks"]] == [
        ("weights.rank0.safetensors", "plan.rank0.json"),
        ("weights.rank1.safetensors", "plan.rank1.json"),
    ]
    for r in tp["ranks"]:  # checksums as for any engine file
        for f in (r["weights"], r["plan"]):
            assert m["files"][f] == sha256_file(d / f)
    assert tp["rank_model"]["num_heads"] == TINY_LLAMA["num_attention_heads"] // 2
    assert len(res.plans) == 2
    # each rank's plan: its own weights (half the split tensors), its KV heads per token
    whole = _build(tiny_llama_dir, tmp_path / "one", 1).plan
    p = res.plans[1]
    assert p.kv_bytes_per_token * 2 == whole.kv_bytes_per_token
    split = sum(n for k, n in whole.weight_bytes.items() if k.endswith(("_proj",)))
    assert p.weight_bytes_total == whole.weight_bytes_total - split // 2
    for rank in (0, 1):
        eng = load_engine(d, rank=rank)
        assert eng.plan == res.plans[rank] and eng.rank == rank
        w = eng.load_weights()
        assert torch.equal(
            w["layers.1.o_proj"],
            load_file(d / f"weights.rank{rank}.safetensors")["layers.1.o_proj"],
        )
    with pytest.raises(EngineError, match="rank 2 is outside the engine's tp_size 2"):
        load_engine(d, rank=2)


def test_dummy_ranks_are_cuts_of_the_dummy_model(tmp_path):
    model = {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}
    cfg = BuildConfig(
        output_dir=str(tmp_path / "e"), load_format="dummy", dtype="float32", target="cpu",
        tp_size=2, dummy_seed=3, max_seq_len=128, max_num_tokens=64,
    )  # fmt: skip
    build(cfg, model_config=model)
    assert not list((tmp_path / "e").glob("*.safetensors"))
    ranks = [load_engine(tmp_path / "e", rank=r).load_weights() for r in (0, 1)]
    spec = ModelSpec.from_hf_config(model)
    whole = dummy_weights(spec, "float32", 3)
    got = _assemble(spec, ranks)
    assert all(torch.equal(got[k], v) for k, v in whole.items())


def test_a_tampered_tp_size_is_refused(tiny_llama_dir, tmp_path):
    _build(tiny_llama_dir, tmp_path / "e", 2)
    path = tmp_path / "e" / "manifest.json"
    m = json.loads(path.read_text())
    m["build"]["tp_size"] = 8  # the tiny model has 4 heads
    path.write_text(json.dumps(m))
    with pytest.raises(EngineError, match=r"tp_size 8 is larger than .* \(4\)"):
        load_engine(tmp_path / "e", verify_checksums=False)
    m["build"]["tp_size"] = 1  # the section and the files say 2
    path.write_text(json.dumps(m))
    with pytest.raises(EngineError, match="tensor_parallel section"):
        load_engine(tmp_path / "e", verify_checksums=False)


# ---- the CLI ----------------------------------------------------------------------------
def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def fails(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.stderr, result.stdout)
    assert "Traceback" not in result.stderr and result.stdout == ""
    for f in fragments:
        assert f in result.stderr, (f, result.stderr)


def _model_yaml(tmp_path, **over):
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump({**TINY_LLAMA, "architectures": ["LlamaForCausalLM"], **over}))
    return p


def _dry(tmp_path, *args, **over):
    return run(
        "build", "--dry_run", "--load_format", "dummy", "--target", "cpu",
        "--model_config", _model_yaml(tmp_path, **over), "--max_seq_len", "128", *args,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "over", "code", "fragment"),
    [
        (("--tp_size", "3"), {}, 3, "tp_size must be a power of two (1, 2, 4, 8 …), got 3"),
        (("--tp_size", "0"), {}, 3, "got 0"),
        (("--tp-size", "-2"), {}, 3, "got -2"),
        (("--tp_size", "8"), {}, 3, "tp_size 8 is larger than the model's num_attention_heads (4)"),
        (
            ("--tp_size", "4"),
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48},
            3,
            "num_attention_heads (6) is not divisible by tp_size 4",
        ),
        (
            ("--tp_size", "2"),
            {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48},
            3,
            "num_key_value_heads (3) and tp_size 2",
        ),
        (
            ("--tp_size", "4"),
            {"intermediate_size": 162},
            3,
            "intermediate_size (162) is not divisible by tp_size 4",
        ),
        (
            ("--tp_size", "2", "--quantization", "int4_wo"),
            {},
            5,
            "--quantization int4_wo with --tp_size 2 is not supported",
        ),
        (
            ("--tp_size", "2", "--quantization", "fp8"),
            {},
            5,
            "--quantization fp8 with --tp_size 2 is not supported",
        ),
        (
            ("--tp_size", "2", "--kv_cache_dtype", "fp8"),
            {},
            5,
            "--kv_cache_dtype fp8 with --tp_size 2 is not supported",
        ),
        (("--tp_size", "two"), {}, 2, "tp_size"),
    ],
)
def test_bad_tp_inputs(tmp_path, args, over, code, fragment):
    fails(_dry(tmp_path, *args, **over), code, fragment)


def test_yaml_tp_size_of_the_wrong_type(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"build": {"tp_size": "2"}}))
    fails(_dry(tmp_path, "--profile", prof), 2, "tp_size must be a int, got '2'")


def test_dry_run_of_llama3_70b_over_two_ranks():
    r = run("build", "--profile", "llama3-70b", "--dry_run", "--tp_size", "2", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["build"]["tp_size"] == 2 and len(d["rank_plans"]) == 2
    h, v, layers, inter, hd = 8192, 128256, 80, 28672, 128
    per_layer = (32 + 2 * 4) * hd * h + h * 32 * hd + 2 * (inter // 2) * h + h * inter // 2
    weights = 2 * (2 * v * h + layers * (per_layer + 2 * h) + h)  # bfloat16
    for plan in d["rank_plans"]:
        assert plan["weight_bytes_total"] == weights
        assert plan["kv_bytes_per_token"] == 2 * layers * 4 * hd * 2  # 4 KV heads per rank
        cap = plan["capacity"]
        assert cap["device_memory_bytes"] == 139 << 30
        free = cap["device_memory_bytes"] - weights - plan["workspace_bytes"]
        blocks = int(free * 0.9) // (plan["kv_bytes_per_token"] * 32)
        assert cap["kv_tokens"] == blocks * 32 > 400_000
    text = run("build", "--profile", "llama3-70b", "--dry_run")
    assert text.exit_code == 0, text.stderr
    out = text.stdout
    assert "memory plan per rank (tp_size 2)" in out and "rank 1" in out
    assert "each rank: 32 q heads, 4 KV heads, MLP 14336" in out
    assert f"{d['rank_plans'][1]['capacity']['kv_tokens']:,} tokens" in out


def test_tp1_engine_files_are_unchanged(tiny_llama_dir, tmp_path):
    _build(tiny_llama_dir, tmp_path / "e", 1)
    names = {p.name for p in (tmp_path / "e").iterdir()}
    assert {"weights.safetensors", "plan.json"} <= names
    assert not any("rank" in n for n in names)
