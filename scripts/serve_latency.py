"""CPU proxy of issue 15's concurrency-1 TTFT gap: the same engine and prompts in-process and
through ``llmc serve``, the difference, and where the served first token's time went.

HTTP work is host work, so its cost on this CPU stands in for the H200 host's. The script:

1. builds a tiny float32 CPU engine (2 layers, hidden 64, dummy weights: a step is a few
   ms of host work) unless ``--engine_dir`` is given;
2. alternates ``--rounds`` times: in-process (``llmc.LLM`` + ``run_workload``, the path of
   ``llmc bench``), then HTTP (``run_http_workload`` against one ``llmc serve`` process
   started on a free 127.0.0.1 port with the same runtime flags), each ``--requests``
   streamed requests of ``--isl`` / ``--osl`` tokens at concurrency 1 (new prompts each
   round, the same for both);
3. prints TTFT p50 / mean of both (the median over rounds), their difference, the server's
   first-token stages (``llmc_first_token_stage_seconds``: admit / queue / compute /
   deliver, means and bucket-interpolated medians of the HTTP requests) and what is left:
   the client's share (its TTFT minus the server's arrival → first chunk).

    PYTHONSAFEPATH=1 .venv/bin/python scripts/serve_latency.py --rounds 8 --requests 25

``--json FILE`` writes every number. On a shared box, short alternating rounds see the same
load: the difference reported is the median of the rounds' differences (p50 and p10).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, for serve_summary

from serve_summary import hist_median, hist_minus, parse_histograms  # noqa: E402

from llmc.runtime.bench.benchmark import run_workload
from llmc.runtime.bench.http_driver import Endpoint, run_http_workload
from llmc.runtime.bench.workload import ArrivalSpec, SyntheticSpec, synthetic_workload

STAGES = ("admit", "queue", "compute", "deliver")
TINY_PROFILE = """\
description: serve_latency.py's tiny engine (dummy weights)
model:
  architectures: [LlamaForCausalLM]
  model_type: llama
  vocab_size: 256
  hidden_size: 64
  intermediate_size: 160
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  max_position_embeddings: 512
  rms_norm_eps: 1.0e-5
  rope_theta: 10000.0
  tie_word_embeddings: false
  bos_token_id: 1
  eos_token_id: 2
build:
  load_format: dummy
  dummy_seed: 0
  dtype: float32
  target: cpu
  max_batch_size: 8
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: 512
  tokens_per_block: 16
"""


def _llmc(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmc.cli.main", *args]


def build_tiny(directory: Path) -> Path:
    profile = directory / "tiny.yaml"
    profile.write_text(TINY_PROFILE)
    out = directory / "engine"
    cmd = _llmc("build", "--profile", str(profile), "--output_dir", str(out), "--force")
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if done.returncode:
        raise RuntimeError(f"llmc build failed:\n{done.stderr[-2000:]}")
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}


class Server:
    """One ``llmc serve`` process on a free 127.0.0.1 port."""

    def __init__(self, engine_dir: Path, flags: list[str]) -> None:
        cmd = _llmc("serve", "--engine", f"tiny={engine_dir}", "--port", "0", *flags)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=_env())
        self.port = 0
        deadline = time.monotonic() + 120
        assert self.proc.stderr is not None
        while not self.port and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"llmc serve exited with {self.proc.wait()}")
            if "listening on http://" in line:
                self.port = int(line.rsplit(":", 1)[1])
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("llmc serve did not get ready")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            return r.read().decode()

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ttfts(records: list[Any]) -> list[float]:
    return [r.first_token_time - r.arrival_time for r in records if r.first_token_time]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from llmc.api import LLM
    from llmc.compiler.engine_format import load_engine
    from llmc.runtime.engine_runtime import RuntimeConfig

    torch.set_num_threads(1)
    engine = Path(args.engine_dir) if args.engine_dir else build_tiny(Path(tempfile.mkdtemp()))
    vocab = load_engine(str(engine), verify_checksums=False).spec.vocab_size

    def workload(seed: int) -> tuple[list[Any], list[Any]]:  # new prompts each round: no
        n = args.requests + 4  # prefix-cache hits from an earlier round
        spec = SyntheticSpec(num_requests=n, isl=args.isl, osl=args.osl, seed=seed)
        reqs = synthetic_workload(spec, vocab)
        return reqs[:4], reqs[4:]

    c1 = ArrivalSpec(mode="concurrency", concurrency=1)
    llm = LLM(str(engine), runtime_config=RuntimeConfig(device="cpu"))
    server = Server(engine, ["--device", "cpu"])
    endpoint = Endpoint(server.url("/v1"), "tiny", plain_http=args.client == "plain")
    rounds: list[dict[str, Any]] = []
    try:
        for i in range(args.rounds):
            warm, reqs = workload(1000 + i)
            inproc = run_workload(llm, reqs, c1, warmup=warm)
            run_http_workload(endpoint, warm, c1)  # warm-up apart: the scrapes see none of it
            scrape = parse_histograms(server.metrics())
            before = scrape.get("llmc_first_token_stage_seconds", {})
            served_before = scrape.get("llmc_time_to_first_token_seconds", {})
            http = run_http_workload(endpoint, reqs, c1)
            text = server.metrics()
            now = parse_histograms(text)
            stages = now["llmc_first_token_stage_seconds"]
            served = hist_minus(now["llmc_time_to_first_token_seconds"][""], served_before.get(""))
            t_in, t_http = _ttfts(inproc.requests), _ttfts(http.requests)
            row = {
                "inproc_p10_ms": _pct(t_in, 0.1) * 1e3,
                "http_p10_ms": _pct(t_http, 0.1) * 1e3,
                "inproc_p50_ms": statistics.median(t_in) * 1e3,
                "inproc_mean_ms": statistics.mean(t_in) * 1e3,
                "http_p50_ms": statistics.median(t_http) * 1e3,
                "http_mean_ms": statistics.mean(t_http) * 1e3,
                "server_ttft_mean_ms": served["sum"] / max(1, served["count"]) * 1e3,
                "server_ttft_p50_ms": (hist_median(served) or 0.0) * 1e3,
            }
            for s in STAGES:
                h = hist_minus(stages[s], before.get(s))
                row[f"{s}_mean_ms"] = h["sum"] / max(1, h["count"]) * 1e3
                row[f"{s}_p50_ms"] = (hist_median(h) or 0.0) * 1e3
            row["gap_p50_ms"] = row["http_p50_ms"] - row["inproc_p50_ms"]
            row["gap_p10_ms"] = row["http_p10_ms"] - row["inproc_p10_ms"]
            row["client_mean_ms"] = row["http_mean_ms"] - row["server_ttft_mean_ms"]
            rounds.append(row)
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    finally:
        llm.shutdown()
        rc = server.stop()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {"engine_dir": str(engine), "server_exit": rc, "rounds": rounds, "median": med}


def report(result: dict[str, Any]) -> None:
    m = result["median"]
    print("\nmedian over rounds (ms)")
    print(f"  TTFT p50  in-process {m['inproc_p50_ms']:.3f}   HTTP {m['http_p50_ms']:.3f}   "
          f"difference {m['gap_p50_ms']:+.3f}")  # fmt: skip
    print(f"  TTFT p10  in-process {m['inproc_p10_ms']:.3f}   HTTP {m['http_p10_ms']:.3f}   "
          f"difference {m['gap_p10_ms']:+.3f}")  # fmt: skip
    print(f"  TTFT mean in-process {m['inproc_mean_ms']:.3f}   HTTP {m['http_mean_ms']:.3f}   "
          f"server arrival -> first chunk {m['server_ttft_mean_ms']:.3f}")  # fmt: skip
    print("  server stages (mean / p50): " + "  ".join(
        f"{s} {m[f'{s}_mean_ms']:.3f} / {m[f'{s}_p50_ms']:.3f}" for s in STAGES
    ))  # fmt: skip
    print(f"  client + wire (HTTP TTFT mean - server's): {m['client_mean_ms']:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine_dir", help="an engine to use (default: build a tiny one)")
    ap.add_argument("--requests", type=int, default=25)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--client",
        choices=("plain", "aiohttp"),
        default="plain",
        help="the bench driver's HTTP client (Endpoint.plain_http)",
    )
    ap.add_argument("--json", help="write every number to this file")
    args = ap.parse_args()
    result = run(args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
