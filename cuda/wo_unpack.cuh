// wo_unpack.cuh: the arithmetic of cuda/gemv_wo.cu's codes (its header comment has the
// design): the scale modes, the PTX helpers (host stand-ins under LLMC_HOST_EMULATION: the
// emulated tests compile this as host C++), the staged-activation layout and its dtype, the
// unpacking constants and the 4-bit / 8-bit unpacking into mma operands (plain and biased).
// Included by cuda/wo_codes.cuh (the kernel arguments, the work split, the k-step).
#pragma once
#include "common.cuh"

#define WO_ROW 0
#define WO_KSTEP 1
#define WO_DEQ 2

// ---- PTX helpers (host stand-ins under LLMC_HOST_EMULATION) ---------------------------
__device__ __forceinline__ v4u wo_ld16(const unsigned char* p) {
    v4u r;
#ifdef LLMC_HOST_EMULATION
    r = *reinterpret_cast<const v4u*>(p);
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
#endif
    return r;
}

// One raw scale / offset (f32 bits, or f16 bits in the low half).
__device__ __forceinline__ unsigned int wo_ld_scale(const unsigned char* row, int gi, bool f32) {
#ifdef LLMC_HOST_EMULATION
    if (f32) return *reinterpret_cast<const unsigned int*>(row + 4 * (long long)gi);
    return *reinterpret_cast<const unsigned short*>(row + 2 * (long long)gi);
#else
    unsigned int r;
    if (f32) {
        asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(r) : "l"(row + 4 * (long long)gi));
    } else {
        unsigned short h;
        asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(h) : "l"(row + 2 * (long long)gi));
        r = h;
    }
    return r;
#endif
}

__device__ __forceinline__ void wo_prefetch(const unsigned char* p) {
#ifdef LLMC_HOST_EMULATION
    (void)p;
#else
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

__device__ __forceinline__ float wo_h2f(unsigned int h) {
#ifdef LLMC_HOST_EMULATION
    return emu_half_to_float((unsigned short)h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#endif
}

__device__ __forceinline__ float wo_scale(unsigned int raw, bool f32) {
    return f32 ? __uint_as_float(raw) : wo_h2f(raw);
}

// d = a * b + c on two 16-bit values of the activation dtype, rounded once each.
__device__ __forceinline__ unsigned int wo_fma2(unsigned int a, unsigned int b, unsigned int c) {
#ifdef LLMC_HOST_EMULATION
    auto lo = [](unsigned int v) { return to_float((unsigned short)(v & 0xffffu)); };
    auto hi = [](unsigned int v) { return to_float((unsigned short)(v >> 16)); };
    const double l = (double)lo(a) * lo(b) + lo(c), h = (double)hi(a) * hi(b) + hi(c);
    return pack2((float)l, (float)h);
#else
    unsigned int d;
#if LLMC_DTYPE == 1
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
    return d;
#endif
}

// d += A (16 x 16) * B (16 x 8), float32 accumulation, operands f16 (F16) or bf16.
template <bool F16>
__device__ __forceinline__ void wo_mma_t(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
#ifdef LLMC_HOST_EMULATION
    emu_mma16816(d, a, b0, b1, F16 ? 0 : 1);
#else
    if constexpr (F16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#endif
}

// The mma on operands in the activation dtype.
__device__ __forceinline__ void wo_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                       unsigned int b1) {
    wo_mma_t<LLMC_DTYPE == 1>(d, a, b0, b1);
}

// The same mma on f16 operands whatever the build's dtype (the biased 8-bit codes).
__device__ __forceinline__ void wo_mma_h(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
    wo_mma_t<true>(d, a, b0, b1);
}

// float -> f16 bits (round to nearest even), whatever the build's dtype.
__device__ __forceinline__ unsigned short wo_f2h(float f) {
#ifdef LLMC_HOST_EMULATION
    return emu_float_to_half(f);
#else
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#endif
}

// ---- layout ---------------------------------------------------------------------------
template <int BITS>
__host__ __device__ constexpr int wo_vb() {  // columns per 16-byte code vector
    return BITS == 4 ? 32 : 16;
}
template <int BITS>
__host__ __device__ constexpr int wo_ks() {  // columns per k-step (4 lanes x VB)
    return 4 * wo_vb<BITS>();
}

// 8-bit codes of the row / kstep modes are unpacked biased: one prmt a pair makes the f16
// values 1024 + q (bf16 has no exact 8-bit magic), so their mmas run on f16 operands and the
// activations are staged as f16 (exact for |x| < 65504; gemv_wo.cu's prologue scales the
// staged rows by a power of two where a value is larger). (magic + code_zero) times the
// activation sums comes off the mma sums, as for the 4-bit kstep mode.
template <int BITS, int SMODE>
__host__ __device__ constexpr bool wo_biased8() {
    return BITS == 8 && SMODE != WO_DEQ;
}

// Whether the staged activations are f16 (else the build's 16-bit dtype).
template <int BITS, int SMODE>
__host__ __device__ constexpr bool wo_x16() {
    return LLMC_DTYPE == 1 || wo_biased8<BITS, SMODE>();
}

// Byte offset of column c in a staged activation row (the pair order of the header).
template <int BITS>
__device__ __forceinline__ int wo_xoff(int c) {
    constexpr int KS = wo_ks<BITS>();
    const int ks = c / KS, r = c - ks * KS;
    if constexpr (BITS == 4) {  // [ks][word w][lane t][pair j][half]: 256 bytes per k-step
        const int t = r >> 5, w = (r >> 3) & 3, e = r & 7;
        return ks * 256 + w * 64 + t * 16 + (e & 3) * 4 + (e >> 2) * 2;
    } else {  // [ks][q][lane t][8 natural columns]: 128 bytes per k-step
        const int t = r >> 4, q = (r >> 3) & 1, e = r & 7;
        return ks * 128 + q * 64 + t * 16 + e * 2;
    }
}

// Constants of the code unpacking (16-bit pairs of the activation dtype).
struct WoConst {
    unsigned int one, nz;    // 1.0 | 1.0, -(magic + code_zero) twice
    unsigned int sixteenth, nz16;  // f16 4-bit odd pairs: 1/16 twice, -(64 + code_zero) twice
    unsigned int magic2;     // 4-bit: the magic exponent twice (0x4300 bf16, 0x6400 f16)
    float fz;                // 8-bit: 2^23 + code_zero
    float mz;                // 4-bit kstep: magic + code_zero (the bias of the biased codes)
    float mz8;               // biased 8-bit codes: 1024 + code_zero
};

__device__ __forceinline__ WoConst wo_const(int code_zero) {
    WoConst c;
    c.one = pack2(1.f, 1.f);
#if LLMC_DTYPE == 1
    const float magic = 1024.f;
#else
    const float magic = 128.f;
#endif
    const float nz = -(magic + (float)code_zero);
    c.nz = pack2(nz, nz);
    c.sixteenth = pack2(0.0625f, 0.0625f);
    const float nz16 = -(64.f + (float)code_zero);
    c.nz16 = pack2(nz16, nz16);
    c.fz = 8388608.f + (float)code_zero;
#if LLMC_DTYPE == 1
    c.magic2 = 0x64006400u;
#else
    c.magic2 = 0x43004300u;
#endif
    c.mz = magic + (float)code_zero;
    c.mz8 = 1024.f + (float)code_zero;
    return c;
}

// (a & m) | c in one lop3 (the compiler splits the two immediates into two ops).
__device__ __forceinline__ unsigned int wo_and_or(unsigned int a, unsigned int m, unsigned int c) {
#ifdef LLMC_HOST_EMULATION
    return (a & m) | c;
#else
    unsigned int d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(m), "r"(c));
    return d;
#endif
}

// 4-bit code word -> the pairs (j, j + 4) of magic + q, j = 0..3 (exact: 128 + q in bf16,
// 1024 + q in f16): one shift and one lop3 a pair, no subtraction. The kstep mode takes
// (magic + code_zero) times the k-step's activation sum off the mma sums instead.
__device__ __forceinline__ void wo_unpack4_biased(unsigned int wd, const WoConst& k,
                                                  unsigned int (&p)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = wo_and_or(wd >> (4 * j), 0x000f000fu, k.magic2);
}

// 4-bit code word -> the pairs (j, j + 4) of q - code_zero, j = 0..3 (exact).
__device__ __forceinline__ void wo_unpack4(unsigned int wd, const WoConst& k, unsigned int (&p)[4]) {
#if LLMC_DTYPE == 1
    const unsigned int w8 = wd >> 8;
    p[0] = wo_fma2((wd & 0x000f000fu) | 0x64006400u, k.one, k.nz);
    p[1] = wo_fma2((wd & 0x00f000f0u) | 0x64006400u, k.sixteenth, k.nz16);
    p[2] = wo_fma2((w8 & 0x000f000fu) | 0x64006400u, k.one, k.nz);
    p[3] = wo_fma2((w8 & 0x00f000f0u) | 0x64006400u, k.sixteenth, k.nz16);
#else
    unsigned int b[4];
    wo_unpack4_biased(wd, k, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = wo_fma2(b[j], k.one, k.nz);
#endif
}

// 8-bit code word -> four floats q - code_zero (exact).
__device__ __forceinline__ void wo_unpack8(unsigned int wd, const WoConst& k, float (&f)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = __uint_as_float(__byte_perm(wd, 0x4b000000u, 0x7440 + e)) - k.fz;
}

// 8-bit code word -> the f16 pairs (1024 + q0, 1024 + q1), (1024 + q2, 1024 + q3) (exact).
__device__ __forceinline__ void wo_unpack8_biased(unsigned int wd, unsigned int (&p)[2]) {
    p[0] = __byte_perm(wd, 0x64646464u, 0x4140);
    p[1] = __byte_perm(wd, 0x64646464u, 0x4342);
}
