"""Shared fixtures of the whole suite; how the tests are laid out and how to add one.

Layout: one folder per source folder (tests/compiler, tests/runtime, tests/bench for the
measurement wing runtime/bench, tests/cuda, tests/cli, tests/base for llmc/base, tests/api for
llmc/api.py and llmc/profiler_api.py, tests/serve for llmc/serve); tests/test_layers.py walks
the package's imports.
Test module names are unique across folders (no ``__init__.py``: pytest puts each test's
folder on ``sys.path``).

Where things live:
- fixtures: here when more than one folder uses them, in a folder's conftest.py when only that
  folder does (tests/runtime/conftest.py); a test module never imports a fixture;
- plain helpers (functions, fakes, constants): the ``helpers`` package (tests/helpers/),
  imported as ``from helpers.engines import make_limits``, see its docstring.

Fixtures here:
- ``tiny_llama_dir`` / ``tiny_qwen2_dir`` (session): tiny random HF checkpoints;
- ``smollm2_gguf`` / ``smollm2_hf_dir`` (session): the real SmolLM2-135M (downloaded once into
  the model cache) and its import into a float32 HF directory;
- ``smollm2_4l_dir`` (session): SmolLM2's first 4 layers, a small model with real weights;
- ``tiny_engine`` (session): ``tiny_engine(checkpoint, **fields) -> engine dir``, a float32 CPU
  ``llmc build`` (``helpers.engines.tiny_build_config``), built once per distinct arguments
  in the session. Pass the limits your test depends on (``**SMALL_LIMITS`` when any small
  engine will do, so that tests share it). The directory is shared: copy it before you change
  a file in it;
- ``one_torch_thread`` (module; opt in with
  ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): one intra-op torch thread for
  modules that run tiny models op by op, the fast setting on the 2-core CI machine;
- ``small_ceilings`` (opt in the same way): hardware ceilings measured with small buffers into a
  private cache, for the modules that run ``llmc bench`` / ``llmc profile``.

Markers: ``cuda`` (needs an NVIDIA GPU with CuPy; deselected by default, run by
``make device-test``; selected where torch sees no GPU, skipped) and ``slow`` (more than a
few seconds on a 2-core CPU).

A new test: put it in the folder of the source it tests, take checkpoints and engines from the
fixtures above (never a hand-written ``BuildConfig(...)`` for a tiny engine), limits from
``helpers.engines.make_limits``, and mark it ``cuda`` if it needs the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import make_hf_checkpoint
from helpers.engines import tiny_build_config

pytest_plugins = ["helpers.failure_log"]  # LLMC_FAILED_LOG: failures named as they happen


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``cuda`` test where torch sees no CUDA GPU is skipped (``-m cuda`` on a CPU machine),
    before its fixtures build anything for the GPU."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs an NVIDIA GPU (torch sees none)")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from llmc.compiler.model_cache import smollm2_gguf as fetch

    return fetch()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 imported from its GGUF into a HF checkpoint directory (float32 safetensors)."""
    from llmc.compiler.gguf_reader import import_gguf

    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2_hf") / "model")


@pytest.fixture(scope="session")
def smollm2_4l_dir(smollm2_hf_dir, tmp_path_factory) -> Path:
    """SmolLM2's first 4 layers (real weights, float32): a small model whose greedy tokens
    mean something, for accuracy comparisons (fp8 against float32)."""
    from helpers.checkpoints import truncate_checkpoint

    return truncate_checkpoint(smollm2_hf_dir, tmp_path_factory.mktemp("smollm2_4l") / "m", 4)


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory) -> Callable[..., Path]:
    """``tiny_engine(checkpoint, **fields)``: the directory of a float32 CPU build of
    ``checkpoint`` with BuildConfig ``fields``; identical builds are made once a session."""
    from llmc.compiler.builder import build

    built: dict[str, Path] = {}

    def make(checkpoint: Path, **fields: Any) -> Path:
        config = tiny_build_config(checkpoint, **fields)
        key = json.dumps(config.to_dict(), sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp("tiny_engine") / "engine"
            assert build(config.replace(output_dir=str(out))).output_dir == out
            built[key] = out
        return built[key]

    return make


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run op by op: on a 2-core machine (often shared with other test
    processes) torch's intra-op threads only add synchronisation, so use one for the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_ceilings(tmp_path_factory, monkeypatch) -> None:
    """Ceilings measured with small buffers into a private cache (fast, still measured)."""
    import llmc.runtime.bench.ceilings as ceilings

    cache = tmp_path_factory.getbasetemp() / "llmc_cache"
    monkeypatch.setenv("LLMC_CACHE", str(cache))
    real = ceilings.measure
    monkeypatch.setattr(ceilings, "measure", lambda device, *a, **k: real(device, 16 << 20, 256))
