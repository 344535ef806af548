"""FP8 accuracy of a real model on CPU: SmolLM2-135M (from its GGUF) built as float32,
bfloat16, fp8 weights, fp8 KV cache and both (the fp8 engines in bfloat16 activations), run
on the torch reference backend.

For each engine: greedy tokens of a few prompts against the float32 engine's (the share of
positions that agree, and the tokens up to the first difference), and, where this llmc has
``llmc eval``, the perplexity over a text file (default: the GPL-3 text), each beside the
bf16 engine's.

    PYTHONSAFEPATH=1 .venv/bin/python scripts/fp8_accuracy.py --out /tmp/fp8_acc
    PYTHONSAFEPATH=1 .venv/bin/python scripts/fp8_accuracy.py --out /tmp/fp8_acc --eval \
        --text_file /usr/share/common-licenses/GPL-3 --json /tmp/fp8_acc/result.json

Builds are reused when the engine directory exists (``--rebuild`` to force). A new fp8 KV
engine is calibrated (``llmc calibrate``: k/v scales and smooth K's k_mean) over
``--calib_file`` (default the Apache-2.0 text: not the scored one); ``--no_calibrate``
keeps the build's scales of 1.0 and zero k_mean.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = {  # name → build settings (scripts/eval_smollm2.sh's limits)
    # quantization "none": the default "auto" would keep the GGUF's Q4_1 blocks native
    "float32": dict(dtype="float32", quantization="none"),
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "fp8 weights": dict(dtype="bfloat16", quantization="fp8"),
    "fp8 KV": dict(dtype="bfloat16", quantization="none", kv_cache_dtype="fp8"),
    "fp8 weights + KV": dict(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8"),
}
PROMPTS = (
    "The capital of France is",
    "Here is a Python function that reverses a string:\n",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
)


def build_engines(gguf: Path, out: Path, rebuild: bool, calib_file: Path | None) -> dict[str, Path]:
    from llmc.compiler.build_config import BuildConfig
    from llmc.compiler.builder import build

    dirs = {}
    for name, settings in ENGINES.items():
        d = out / name.replace(" ", "_").replace("+", "and")
        if rebuild or not (d / "manifest.json").is_file():
            cfg = BuildConfig(  # the smollm2-135m profile's limits: eval windows of 1536
                checkpoint_dir=str(gguf), output_dir=str(d), target="cpu", max_batch_size=64,
                max_input_len=1536, max_seq_len=2048, max_num_tokens=2048, tokens_per_block=32,
                force=True, **settings,
            )  # fmt: skip
            t0 = time.perf_counter()
            build(cfg)
            print(f"built {name} in {time.perf_counter() - t0:.1f} s: {d}", file=sys.stderr)
            if calib_file is not None and settings.get("kv_cache_dtype") == "fp8":
                calibrate(d, calib_file)
        dirs[name] = d
    return dirs


def calibrate(engine: Path, calib_file: Path) -> None:
    """``llmc calibrate --engine_dir engine --text_file calib_file --device cpu``."""
    cmd = [sys.executable, "-m", "llmc.cli.main", "calibrate", "--engine_dir", str(engine)]
    res = subprocess.run(
        [*cmd, "--text_file", str(calib_file), "--device", "cpu", "--json", "-"],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"llmc calibrate failed on {engine}: {res.stderr[-2000:]}")
    print(f"calibrated {engine} on {calib_file}", file=sys.stderr)


def greedy(engine: Path, max_new: int) -> list[list[int]]:
    from llmc import LLM, SamplingParams

    with LLM(engine_dir=str(engine), device="cpu") as llm:
        outs = llm.generate(list(PROMPTS), SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    return [o.token_ids for o in outs]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    same = sum(a == b for x, y in zip(ours, ref, strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(y) for y in ref)
    prefix = []
    for x, y in zip(ours, ref, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(y))
        prefix.append(n)
    return {"positions_agree": same / total, "common_prefix": prefix, "tokens": total}


def perplexity(engine: Path, text_file: Path) -> dict[str, Any] | None:
    """``llmc eval``'s JSON, or None where this llmc has no eval command."""
    cmd = [sys.executable, "-m", "llmc.cli.main", "eval", "--engine_dir", str(engine)]
    res = subprocess.run(
        [*cmd, "--text_file", str(text_file), "--device", "cpu", "--json", "-"],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        if "No such command" in res.stderr:
            return None
        raise SystemExit(f"llmc eval failed on {engine}: {res.stderr[-2000:]}")
    return json.loads(res.stdout)


def find_perplexity(doc: Any) -> float | None:
    """The first number under a key named 'perplexity' in ``llmc eval``'s JSON."""
    if isinstance(doc, dict):
        if isinstance(doc.get("perplexity"), int | float):
            return float(doc["perplexity"])
        doc = list(doc.values())
    if isinstance(doc, list):
        for v in doc:
            found = find_perplexity(v)
            if found is not None:
                return found
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the cached SmolLM2 GGUF")
    p.add_argument("--out", type=Path, required=True, help="directory of the engines")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--eval", action="store_true", help="perplexity through `llmc eval`")
    p.add_argument("--text_file", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--calib_file", type=Path, default=Path("/usr/share/common-licenses/Apache-2.0"))
    p.add_argument("--no_calibrate", action="store_true", help="fp8 KV engines as built")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args()
    import torch

    from llmc.compiler.model_cache import smollm2_gguf

    torch.manual_seed(0)
    gguf = args.gguf or smollm2_gguf()
    if args.rebuild and args.out.exists():
        shutil.rmtree(args.out)
    calib = None if args.no_calibrate else args.calib_file
    dirs = build_engines(gguf, args.out, args.rebuild, calib)
    tokens = {}
    for name, d in dirs.items():
        t0 = time.perf_counter()
        tokens[name] = greedy(d, args.max_new_tokens)
        print(f"ran {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rows: dict[str, dict[str, Any]] = {}
    for n, t in tokens.items():
        rows[n] = agreement(t, tokens["float32"])
    for name, d in dirs.items():
        rows[name]["vs_bf16"] = agreement(tokens[name], tokens["bfloat16"])["positions_agree"]
        if args.eval:
            rows[name]["eval"] = perplexity(d, args.text_file)
    print(f"{'engine':<18} {'agree vs fp32':>13} {'vs bf16':>8}  common prefix  perplexity")
    base = find_perplexity(rows["bfloat16"].get("eval"))
    for name, r in rows.items():
        ppl = find_perplexity(r.get("eval"))
        rel = f" ({ppl / base - 1:+.2%} vs bf16)" if ppl is not None and base else ""
        print(
            f"{name:<18} {r['positions_agree']:>13.1%} {r['vs_bf16']:>8.1%}  "
            f"{r['common_prefix']}  {'-' if ppl is None else f'{ppl:.4f}'}{rel}"
        )
    if args.json:
        args.json.write_text(json.dumps({"prompts": PROMPTS, "tokens": tokens, "rows": rows}))


if __name__ == "__main__":
    main()
