// wo_dequant.cuh: the PackedWeight dequantization formula (llmc.cuda.reference_wo), shared by
// wo_dequant.cu (rows into memory) and gemm_wo.cu (tiles into shared memory), bit-exact:
//   w[n, k] = fl32(fl32(s[n, g] * float(q[n, k] - code_zero)) + o[n, g]),  g = k / gs
// (__fmul_rn / __fadd_rn: never contracted into an FMA); the caller rounds once into its
// dtype. Scales / offsets are f16 or f32 (``f32``), read from global memory.
#pragma once
#include "common.cuh"

__device__ __forceinline__ float wod_scale(const void* p, long long i, bool f32) {
    if (f32) return static_cast<const float*>(p)[i];
    const unsigned short h = static_cast<const unsigned short*>(p)[i];
#ifdef LLMC_HOST_EMULATION
    return emu_half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ int wod_code(const unsigned char* row, int k, int bits) {
    if (bits == 8) return row[k];
    const int b = row[k >> 1];
    return (k & 1) ? (b >> 4) : (b & 15);
}

// The 8 codes of columns c0 .. c0 + 7 of one code row (c0 % 8 == 0: one 4-byte load of
// 4-bit codes, even k in the low nibble; one 8-byte load of 8-bit codes).
__device__ __forceinline__ void wod_codes8(const unsigned char* row, int c0, int bits,
                                           unsigned int (&q)[8]) {
    if (bits == 4) {
        const unsigned int w = *reinterpret_cast<const unsigned int*>(row + c0 / 2);
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = (w >> (4 * e)) & 15u;
    } else {
        const v2u w = *reinterpret_cast<const v2u*>(row + c0);
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = ((e < 4 ? w.x : w.y) >> (8 * (e & 3))) & 255u;
    }
}

// f[e] = q[e] - code_zero (wod_ints8), and the formula on q[e] with the group's scale s and
// offset o (wod_values8; has_o: offsets exist). q - code_zero as float without an int-to-float conversion (a quarter-rate instruction):
// 2^23 + q is the float of bits 0x4B000000 | q, and (2^23 + q) - (2^23 + code_zero) is
// exact (both terms and the small difference are representable).
__device__ __forceinline__ void wod_ints8(const unsigned int (&q)[8], int code_zero,
                                          float (&f)[8]) {
    const float zero = 8388608.f + (float)code_zero;
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = __fsub_rn(__uint_as_float(0x4B000000u | q[e]), zero);
}

__device__ __forceinline__ void wod_values8(const unsigned int (&q)[8], float s, float o,
                                            bool has_o, int code_zero, float (&f)[8]) {
    wod_ints8(q, code_zero, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float v = __fmul_rn(s, f[e]);
        f[e] = has_o ? __fadd_rn(v, o) : v;
    }
}
