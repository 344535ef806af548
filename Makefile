# llmc — one command per job. Every target sets up what it needs on a fresh machine.
PY        ?= python3
# Never put the working directory on sys.path: the top-level cuda/ folder would shadow
# NVIDIA's `cuda` package (which CuPy imports) when Python runs from the repo root.
export PYTHONSAFEPATH := 1
VENV      ?= .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
# CPU build of torch: an unpinned torch pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test lint fmt kernels model device-test device-wheels bench-h200 serve-h200 clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

model: $(STAMP)
	$(VPY) -m llmc.compiler.model_cache

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Every .cu file must compile for sm_90 (skipped with a message where nvcc is absent).
kernels: $(STAMP)
	$(VPY) -m llmc.cuda.compile_check

test: $(STAMP) model
	$(MAKE) lint
	$(MAKE) kernels
	$(VPY) -m pytest -q

demo: $(STAMP) model
	$(VENV)/bin/llmc build --checkpoint_dir "$$($(VPY) -m llmc.compiler.model_cache)" \
		--output_dir engines/smollm2 --dtype float32 --target cpu --force
	$(VENV)/bin/llmc run --engine_dir engines/smollm2 --chat \
		--prompt "What is the capital of France? Answer in one sentence." --max_new_tokens 48

# On the lent H200 (through the device tool): GPU tests and kernel benchmark, results under $$OUT.
device-test:
	bash scripts/device_test.sh

# Here (PyPI reachable): the wheels the GPU image lacks (FastAPI, uvicorn, gguf, ...) into .whl/
device-wheels:
	bash scripts/fetch_device_wheels.sh

bench-h200:
	bash scripts/bench_h200.sh

# On the lent H200: llmc serve + llmc bench --url against in-process bench (issue 15).
serve-h200:
	bash scripts/serve_h200.sh

clean:
	rm -rf $(VENV) engines build *.egg-info .pytest_cache .ruff_cache
