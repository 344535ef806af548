"""Plain helpers of the tests (functions and classes, never fixtures: those live in conftest).

tests/ is on ``sys.path`` (pytest's rootdir conftest), so a test imports these as
``from helpers.engines import make_limits``:

- ``helpers.attention``: paged-attention batches (metadata, shuffled block tables), rope
  tables and the relative error of the kernel tests (GPU and emulated);
- ``helpers.cuda_emulator``: a kernel family compiled as host C++ over
  tests/cuda/kernel_emulator.h and launched on CPU tensors;
- ``helpers.checkpoints``: tiny random HF checkpoints (Llama / Qwen2) and their tokenizer;
- ``helpers.engines``: the tiny CPU build config, EngineLimits for a test, spec + engine
  weights straight from a checkpoint;
- ``helpers.fakes``: the model-free engine core (a real Scheduler + KVCacheManager driven by a
  FakeRunner);
- ``helpers.gemv_launch``: the CudaBackend's fused gemv ops on the CPU with their launches
  recorded, and the kernels' C signatures read from the sources;
- ``helpers.runner``: ModelRunner set-ups, a hand-made scheduler loop (``drive``), the eager
  CUDA-graph stand-in and transformers references.
"""
