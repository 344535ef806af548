// pdl.cuh: programmatic dependent launch (sm_90), the device side. A kernel launched with
// the programmatic-serialization attribute (llmc.cuda.pdl_launch) may start while the
// kernel before it in the stream still runs: once every CTA of that kernel has called
// pdl_trigger() (or exited), the next kernel's CTAs take whatever room the SMs have.
//   pdl_trigger()  lets the next kernel launch; called first thing by the kernels that come
//                  before a PDL launch (the decode step's GEMVs, attention, embedding).
//                  Safe anywhere: it orders nothing and is a no-op when no one waits.
//   pdl_wait()     blocks until the kernel before has completed and its memory is visible;
//                  a PDL-launched kernel calls it, in every CTA, before it reads anything
//                  an earlier kernel wrote or writes anything an earlier kernel reads. Before
//                  it, only reads of memory no kernel of the step writes (the weights).
//                  Returns at once in a kernel launched without the attribute.
// The weight stream of a GEMV thus starts under the previous kernel's tail (and, behind
// attention, which leaves most SMs idle at small batches, under all of it).
// No-ops below sm_90 and under LLMC_HOST_EMULATION.
#pragma once

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(LLMC_HOST_EMULATION)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(LLMC_HOST_EMULATION)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
