"""CUDA kernels (one .cu per family), launch wrappers, torch references, micro-benchmarks."""
