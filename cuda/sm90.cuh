// sm90.cuh: Hopper (sm_90a) primitives of the wgmma kernels, as inline PTX (no CUDA headers,
// so the same text compiles under nvcc and NVRTC): shared-memory descriptors (128-byte
// swizzle), mbarriers, named barriers, cp.async (and its groups), wgmma m64nNk16 with fp32 accumulators
// (A from shared memory or registers), and register pinning around asynchronous wgmma.
// Inlined by llmc.cuda.kernels.source like common.cuh; needs LLMC_DTYPE (1 f16, 2 bf16).
#pragma once

#if LLMC_DTYPE == 2
#define AB "bf16"
#else
#define AB "f16"
#endif

typedef unsigned long long u64;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride
// byte offsets (all >> 4), layout type 1 (SWIZZLE_128B) in bits 62-63, base offset 0 (every
// tile starts 1024-aligned).
__device__ __forceinline__ u64 make_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}

// ---- mbarriers, named barriers, async copies ----------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives when every cp.async this thread issued so far has landed (counts as one arrival).
__device__ __forceinline__ void mbar_arrive_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(unsigned bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
// Waits for the phase of parity `parity` to complete. Watchdog: a wait of more than 2^31 SM
// cycles (~1 s; real waits last microseconds) traps, so that a pipeline bug ends the launch
// with an error instead of hanging the GPU (32-bit clock: one register).
__device__ __forceinline__ unsigned sm_clock() {
    unsigned c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c));
    return c;
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    if (mbar_try_wait(bar, parity)) return;
    const unsigned c0 = sm_clock();
    bool ok;
    while (!(ok = mbar_try_wait(bar, parity)) && sm_clock() - c0 <= 0x80000000u) {
    }
    if (!ok) asm volatile("trap;");  // after the loop: a trap inside it costs spills
}
// Shared memory written through the generic proxy (cp.async, st.shared), read next by wgmma
// (async proxy).
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void named_sync(unsigned id) {
    asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_arrive(unsigned id) {
    asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(bytes)
                 : "memory");
}

// cp.async groups: commit this thread's copies so far; wait until at most N groups are pending.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- wgmma ---------------------------------------------------------------------------
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pin register values to this point of the program (accumulators / A operands of wgmma are
// read and written asynchronously between issue and wait).
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

#define ACC32 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define ACC64 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define F4(a, i) "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3])
#define F16(a, i) F4(a, i), F4(a, i + 4), F4(a, i + 8), F4(a, i + 12)
#define F32(a) F16(a, 0), F16(a, 16)
#define F64(a) F16(a, 0), F16(a, 16), F16(a, 32), F16(a, 48)

// S (64 x 128, fp32) = A (64 x 16, smem desc) * B (16 x 128, smem desc); both K-major.
// scale_d 0 overwrites S (first k-step), 1 accumulates.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 a, u64 b, int scale_d) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " ACC64
                 ", %64, %65, p, 1, 1, 0, 0; }"
                 : F64(d)
                 : "l"(a), "l"(b), "r"(scale_d));
}
// O (64 x HD) += A (64 x 16, registers) * B (16 x HD, smem desc, MN-major: imm-trans-b 1).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const unsigned (&a)[4], u64 b) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " " ACC64
                 ", {%64,%65,%66,%67}, %68, p, 1, 1, 1; }"
                 : F64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const unsigned (&a)[4], u64 b) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " " ACC32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1, 1; }"
                 : F32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
