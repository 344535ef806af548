// mma_sync.cuh: the PTX helpers of the mma.sync kernels (prefill_attention.cu, gemm_wo.cu):
// the shared-window address of a pointer, mma.sync m16n8k16 with float32 accumulators on the
// activation dtype's 16-bit operands (MMA_AB: bf16 for LLMC_DTYPE 2, else f16), ldmatrix x4
// (and .trans), cp.async 16-byte copies (zero-filled past ``bytes``) and their groups.
// Under LLMC_HOST_EMULATION the host stand-ins of the same names come from
// tests/cuda/kernel_emulator.h.
#pragma once

#ifndef LLMC_HOST_EMULATION
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// The PTX type of the 16-bit mma operands.
#if LLMC_DTYPE == 2
#define MMA_AB "bf16"
#else
#define MMA_AB "f16"
#endif

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void cp_async16(unsigned saddr, const void* g, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(g),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#endif  // LLMC_HOST_EMULATION
