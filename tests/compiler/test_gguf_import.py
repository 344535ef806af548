"""GGUF import: SmolLM2 against transformers' own GGUF loader, tiny round trips, bad files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.gguf_files import TO_GGUF, write_gguf
from llmc.base.errors import CheckpointError, UnsupportedError
from llmc.compiler.checkpoint import load_checkpoint, read_model_spec
from llmc.compiler.gguf_header import TOKENIZER_ARRAYS, read_gguf_header
from llmc.compiler.gguf_reader import import_gguf

gguf = pytest.importorskip("gguf")  # a dependency of llmc; absent on the GPU image (cuda-only runs)

# ---- SmolLM2 (the real Q4_1/Q8_0 file) against transformers ----------------------------

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "héllo ünïcode: 日本語のテキスト, Ελληνικά, emoji 🤖🚀",
    "<|im_start|>user\nWhat's up?<|im_end|>\n",
    "I'm sure they'll've done it, isn't it",
    "def f(x):\n    return x ** 2  # comment",
]
CHAT = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in Japanese? 日本語で"},
]


class _FlatModel(torch.nn.Module):
    """A model's config and parameter names without its module tree.

    transformers' GGUF name mapping walks every submodule and rebuilds llama.cpp's name table
    for each (~400 times for SmolLM2); one flat level yields the same map in one pass.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.config, self._names = model.config, list(model.state_dict())

    def state_dict(self, *args, **kwargs):  # noqa: ARG002
        return dict.fromkeys(self._names)


@pytest.fixture(scope="module")
def transformers_gguf(smollm2_gguf):
    """transformers' GGUF loader (the path from_pretrained(gguf_file=...) takes for llama).

    Called directly (faster than from_pretrained, which the test below also checks).
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.LlamaConfig(num_hidden_layers=30)  # only for the GGUF → HF name map
    with torch.device("meta"):
        skeleton = _FlatModel(transformers.LlamaForCausalLM(cfg))
    return load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=skeleton)


def test_read_model_spec_is_fast(smollm2_gguf):
    t0 = time.perf_counter()
    spec, cfg = read_model_spec(smollm2_gguf)
    assert time.perf_counter() - t0 < 1.0
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.vocab_size, spec.intermediate_size, spec.head_dim) == (49152, 1536, 64)
    assert spec.tie_word_embeddings and spec.rope_theta == 100000.0 and spec.rms_norm_eps == 1e-5
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_config_matches_transformers(smollm2_hf_dir, transformers_gguf):
    ours = json.loads((smollm2_hf_dir / "config.json").read_text())
    ref = transformers_gguf["config"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == ref[key], key
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"], rel=1e-6)


def test_logits_match_transformers_gguf_loader(smollm2_hf_dir, transformers_gguf):
    """Proves the Q/K un-permutation: any row-order mistake changes the logits."""
    import transformers
    from transformers.initialization import no_init_weights

    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    ref_tensors = transformers_gguf["tensors"]
    mine = ours.state_dict()
    assert set(mine) == set(ref_tensors) | {"lm_head.weight"}  # tied
    assert all(torch.equal(mine[k], ref_tensors[k].float()) for k in ref_tensors)

    cfg = {k: v for k, v in transformers_gguf["config"].items() if not k.startswith("_")}
    with no_init_weights():
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    missing, unexpected = ref.load_state_dict(ref_tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    ref.tie_weights()
    ours.eval(), ref.eval()
    prompts = [
        [1, 4093, 198, 19556, 905, 30, 2, 198, 1, 520, 9531, 198, 33, 34, 35, 216],
        list(range(100, 40000, 2500)),
    ]
    with torch.no_grad():
        for ids in prompts:
            a = ours(torch.tensor([ids])).logits
            b = ref(torch.tensor([ids])).logits
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert a.abs().max() > 1  # not a degenerate model


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_gguf, smollm2_hf_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours_hf = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    raw = Tokenizer.from_file(str(smollm2_hf_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours_hf.encode(text) == ids, text
        assert raw.encode(text).ids == ids, text
        assert raw.decode(ids, skip_special_tokens=False) == ref.decode(ids) == text
    assert ref.encode("<|im_start|>")[0] == 1 and raw.encode("<|im_end|>").ids == [2]

    tok_cfg = json.loads((smollm2_hf_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    for gen in (True, False):
        text = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert ours_hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == text
        assert raw.encode(text).ids == ref.encode(text)
    gen_cfg = json.loads((smollm2_hf_dir / "generation_config.json").read_text())
    assert gen_cfg == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_import_refuses_non_empty_dir(smollm2_gguf, tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        import_gguf(smollm2_gguf, tmp_path)


# ---- tiny GGUF files written with gguf-py from the HF fixtures -----------------------------


@pytest.mark.parametrize("arch,fixture", [("llama", "tiny_llama_dir"), ("qwen2", "tiny_qwen2_dir")])
@pytest.mark.parametrize("qtype", [None, gguf.GGMLQuantizationType.Q8_0])
def test_tiny_round_trip(arch, fixture, qtype, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    ckpt = load_checkpoint(write_gguf(hf_dir, tmp_path / "m.gguf", arch, qtype))
    original = load_checkpoint(hf_dir)
    assert ckpt.source_format == "gguf"
    assert ckpt.spec == original.spec
    assert set(ckpt.tensors) == set(original.tensors)
    for name, t in original.tensors.items():
        want = t.float()
        if qtype is not None and t.ndim == 2:  # row-wise blocks commute with the row permutation
            want = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(want.numpy(), qtype), qtype)
            )
        assert ckpt.tensors[name].dtype == torch.float32
        assert torch.equal(ckpt.tensors[name], want), name


def test_tiny_tokenizer_matches_fixture_and_transformers(tiny_llama_dir, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    files = load_checkpoint(path).tokenizer_files
    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    fixture = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in ("hello there", "</s> x<s>y", " a  b\n", " the  tt"):
        assert ours.encode(text).ids == ref.encode(text), text
    assert ours.encode(" t").ids == [255]
    assert ours.encode("hello").ids == fixture.encode("hello").ids
    tok_cfg = json.loads(files["tokenizer_config.json"])
    assert tok_cfg["chat_template"].startswith("{% for m in messages %}")
    assert json.loads(files["generation_config.json"])["eos_token_id"] == 2


# ---- bad GGUF files ---------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tiny_llama_dir, tmp_path) -> Path:
    return write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")


@pytest.mark.parametrize(
    "cut,message",
    [
        (-100, "truncated GGUF: tensor 'output_norm.weight' needs bytes"),
        (60, "truncated or corrupt GGUF header"),
        (10, "too small"),
        (0, "too small"),
    ],
)
def test_truncated_gguf(tiny_gguf, cut, message):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:cut])
    for fn in (read_model_spec, load_checkpoint):
        with pytest.raises(CheckpointError, match=message) as e:
            fn(tiny_gguf)
        assert str(tiny_gguf) in str(e.value)


def test_not_gguf(tiny_gguf):
    tiny_gguf.write_bytes(b"NOPE" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(tiny_gguf)


def test_corrupt_array_length(tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    i = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4
    data[i : i + 8] = (10**15).to_bytes(8, "little")  # element count of the vocabulary
    tiny_gguf.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt GGUF"):
        read_model_spec(tiny_gguf)


def test_unsupported_architecture(tiny_llama_dir, tmp_path):
    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", arch="gemma")
    with pytest.raises(UnsupportedError, match="'gemma'"):
        read_model_spec(path)


def test_unexpected_missing_and_misshaped_tensors(tiny_llama_dir, tmp_path):
    def extra(w, t):
        t["model.layers.0.mlp.extra.weight"] = np.zeros(4, dtype=np.float32)

    TO_GGUF["mlp.extra"] = "ffn_extra"
    try:
        path = write_gguf(tiny_llama_dir, tmp_path / "a.gguf", edit=extra)
    finally:
        del TO_GGUF["mlp.extra"]
    with pytest.raises(CheckpointError, match="unexpected GGUF tensor 'blk.0.ffn_extra.weight'"):
        load_checkpoint(path)

    path = write_gguf(
        tiny_llama_dir,
        tmp_path / "b.gguf",
        edit=lambda w, t: t.pop("model.layers.1.mlp.up_proj.weight"),
    )
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_checkpoint(path)

    def reshape(w, t):
        t["model.norm.weight"] = np.ones(32, dtype=np.float32)

    path = write_gguf(tiny_llama_dir, tmp_path / "c.gguf", edit=reshape)
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \[32\]"):
        load_checkpoint(path)


def test_header_matches_gguf_reader(tiny_llama_dir, tmp_path):
    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    ref = gguf.GGUFReader(path)
    ours = read_gguf_header(path, TOKENIZER_ARRAYS)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for o, r in zip(ours.tensors, ref.tensors, strict=True):
        assert o.shape == tuple(reversed([int(d) for d in r.shape])), o.name
        assert (o.ggml_type, o.offset, o.nbytes) == (int(r.tensor_type), r.data_offset, r.n_bytes)


def _llama3_divisors(theta: float, head_dim: int, factor: float) -> np.ndarray:
    """rope_freqs as llama.cpp stores them, derived from transformers' own llama3 RoPE."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=1.0)
    rope.update(high_freq_factor=4.0, original_max_position_embeddings=8192)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=16384,
        rope_parameters=rope,
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (base / inv_freq).numpy().astype(np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tiny_llama_dir, tmp_path):
    from llmc.compiler.spec import RopeScaling

    divisors = _llama3_divisors(10000.0, 16, 8.0)
    assert 1.0 < divisors[-2] < 8.0 and divisors[-1] == 8.0  # all three regions present
    path = write_gguf(
        tiny_llama_dir,
        tmp_path / "m.gguf",
        edit=lambda w, t: w.add_tensor("rope_freqs.weight", divisors),
    )
    ckpt = load_checkpoint(path)
    assert ckpt.spec.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert "rope_freqs.weight" not in ckpt.tensors

    bad = divisors.copy()
    bad[-2] = 3.0
    path = write_gguf(
        tiny_llama_dir,
        tmp_path / "bad.gguf",
        edit=lambda w, t: w.add_tensor("rope_freqs.weight", bad),
    )
    with pytest.raises(UnsupportedError, match="rope_freqs"):
        read_model_spec(path)


def test_gguf_magic_without_suffix_and_nested_arrays(tiny_llama_dir, tmp_path):
    path = write_gguf(
        tiny_llama_dir,
        tmp_path / "model.bin",
        edit=lambda w, t: w.add_array("general.nested", [[1, 2], [3]]),
    )
    spec, _ = read_model_spec(path)
    assert spec.num_layers == 2
    header = read_gguf_header(path)
    assert header.metadata["general.nested"] == [[1, 2], [3]]


def test_failed_import_leaves_nothing(tiny_gguf, tmp_path):
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:-100])
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="truncated"):
        import_gguf(tiny_gguf, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


@pytest.mark.parametrize("arch,fixture", [("llama", "tiny_llama_dir"), ("qwen2", "tiny_qwen2_dir")])
def test_imported_tiny_dir_runs_in_transformers(arch, fixture, request, tmp_path):
    import transformers

    hf_dir = request.getfixturevalue(fixture)
    out = import_gguf(write_gguf(hf_dir, tmp_path / "m.gguf", arch), tmp_path / "imported")
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(ours) is type(ref)
    ids = torch.tensor([[1, 5, 9, 200, 17, 3, 77, 255]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("hello the world")) == "hello the world"


def test_corrupted_bytes_never_escape_as_raw_exceptions(tiny_gguf):
    """Flip bytes of the header/metadata at random: every failure is an LlmcError."""
    from llmc.base.errors import LlmcError

    data = tiny_gguf.read_bytes()
    header_end = data.index(b"output_norm.weight") + 64
    rng = np.random.default_rng(0)
    failures = 0
    for trial in range(150):
        bad = bytearray(data)
        for pos in rng.integers(4, header_end, size=1 + trial % 3):
            bad[pos] = int(rng.integers(0, 256))
        tiny_gguf.write_bytes(bytes(bad))
        try:
            load_checkpoint(tiny_gguf)
        except LlmcError:
            failures += 1
    assert failures > 50  # most corruptions are caught, none escape as another exception


def test_logits_match_from_pretrained_gguf_file(smollm2_hf_dir, smollm2_gguf):
    """The issue's reference, verbatim: the imported HF checkpoint run through transformers
    equals ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` on the GGUF itself."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_hf_dir, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 4093, 198, 19556, 905, 30, 2, 198, 1, 520, 9531, 198, 33, 34]])
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert a.abs().max() > 1


def test_import_into_empty_dir_and_force_replace(tiny_gguf, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    assert import_gguf(tiny_gguf, out) == out  # an empty directory is filled
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "model.safetensors" in names
    (out / "stale.txt").write_text("old")
    with pytest.raises(CheckpointError, match="not empty"):
        import_gguf(tiny_gguf, out)
    import_gguf(tiny_gguf, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == names  # replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp left


def test_header_counts_and_nesting_are_bounded(tiny_llama_dir, tmp_path):
    from llmc.compiler.input_bounds import MAX_GGUF_ARRAY_DEPTH

    path = write_gguf(
        tiny_llama_dir,
        tmp_path / "deep.gguf",
        edit=lambda w, t: w.add_array("general.deep", [[[[[1]]]]]),
    )
    with pytest.raises(CheckpointError, match=f"nested more than {MAX_GGUF_ARRAY_DEPTH} deep"):
        read_gguf_header(path)
    data = bytearray(path.read_bytes())
    data[8:16] = (10**15).to_bytes(8, "little")  # the tensor count
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="1000000000000000 tensors"):
        read_gguf_header(path)


def test_metadata_of_the_wrong_type_names_the_key(tiny_llama_dir, tmp_path):
    path = write_gguf(
        tiny_llama_dir,
        tmp_path / "m.gguf",
        edit=lambda w, t: w.add_string("llama.block_count", "2"),
    )
    # the writer keeps both block_count entries; the reader's dict keeps the last (a string)
    with pytest.raises(CheckpointError, match="llama.block_count must be an integer"):
        read_model_spec(path)
