// fp8.cuh: float8_e4m3fn codes for llmc's FP8 kernels (activations quantized per row, the
// e4m3 KV cache).  No CUDA headers (NVRTC and nvcc compile the same text).
//
// Encode: saturate to +-448, round to nearest even (torch's clamp(-448, 448).to(e4m3fn),
// CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)): one
// `cvt.rn.satfinite.e4m3x2.f32` per two values on sm_89+, the same rounding in integer
// arithmetic elsewhere (fp8_encode_sw, also what the host emulator runs).
// Decode: exact (every e4m3 value is an fp16 value): `cvt.rn.f16x2.e4m3x2` on sm_89+, a
// bit shuffle elsewhere.
//
// Per-row recipe (llmc.cuda.reference_fp8): amax = max(max|x|, FP8_MIN_AMAX),
// inv = 448 / amax, codes = sat(x * inv), scale = amax / 448, rounded as the reference's
// torch ops round them: `448.0 / amax` is torch's reciprocal-then-multiply
// (fl(fl(1 / amax) * 448)), `amax / 448` a true division on the CPU (on CUDA torch
// multiplies by fl(1 / 448) instead: the GPU tests take the CPU reference); all IEEE
// round-to-nearest (__frcp_rn / __fmul_rn / __fdiv_rn, whatever the -prec-div / -fmad
// flags).
#pragma once

#define FP8_MAX 448.f
#define FP8_MIN_AMAX 1e-12f

typedef unsigned char fp8_t;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(LLMC_HOST_EMULATION)
#define LLMC_FP8_CVT 1
#else
#define LLMC_FP8_CVT 0
#endif

#ifndef LLMC_HOST_EMULATION
// fp16 bits -> float; fp16x2 bits times 256 (exact below 256 * 65504).
__device__ __forceinline__ float half_bits_to_float(unsigned h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
__device__ __forceinline__ unsigned fp16x2_times_256(unsigned h) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x5c005c00u));
    return r;
}
#endif

// e4m3 code of v with saturation and round-to-nearest-even (NaN -> 0x7f).
__device__ __forceinline__ unsigned fp8_encode_sw(float v) {
    const unsigned u = __float_as_uint(v);
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) return 0x7fu;  // NaN
    const float a = fminf(__uint_as_float(mag), FP8_MAX);
    if (a < 0.015625f) {  // below 2^-6: subnormal codes m * 2^-9 (m = 8 is the smallest normal)
        return sign | (unsigned)__float2int_rn(a * 512.f);
    }
    unsigned b = __float_as_uint(a);
    b += 0x7ffffu + ((b >> 20) & 1u);  // round the float32 mantissa to 3 bits, ties to even
    const unsigned e = (b >> 23) - 120u;  // float32 exponent 121..135 -> e4m3 exponent 1..15
    return sign | (e << 3) | ((b >> 20) & 7u);
}

// Two codes: byte 0 = lo, byte 1 = hi.
__device__ __forceinline__ unsigned fp8x2_encode(float lo, float hi) {
#if LLMC_FP8_CVT
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return fp8_encode_sw(lo) | (fp8_encode_sw(hi) << 8);
#endif
}

// Codes of f[0..N) * inv stored at p with the widest access N allows (p aligned to N bytes
// when N is 4, 8 or 16).
template <int N>
__device__ __forceinline__ void store_fp8(fp8_t* p, const float* f, float inv) {
    if constexpr (N % 4 == 0) {
        unsigned w[N / 4];
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            w[i] = fp8x2_encode(__fmul_rn(f[4 * i], inv), __fmul_rn(f[4 * i + 1], inv)) |
                   (fp8x2_encode(__fmul_rn(f[4 * i + 2], inv), __fmul_rn(f[4 * i + 3], inv))
                    << 16);
        }
        if constexpr (N == 16) {
            *reinterpret_cast<v4u*>(p) = v4u{w[0], w[1], w[2], w[3]};
        } else if constexpr (N == 8) {
            *reinterpret_cast<v2u*>(p) = v2u{w[0], w[1]};
        } else if constexpr (N == 4) {
            *reinterpret_cast<unsigned*>(p) = w[0];
        } else {
#pragma unroll
            for (int i = 0; i < N / 4; ++i) reinterpret_cast<unsigned*>(p)[i] = w[i];
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = (fp8_t)(fp8x2_encode(__fmul_rn(f[i], inv), 0.f) & 0xffu);
    }
}

// The row's (inv, scale) from this thread's partial amax (a block reduction; every thread
// gets the result; `scratch` as block_reduce's).
__device__ __forceinline__ float fp8_row_inv(float local_amax, float* scratch, float* scale) {
    const float amax = fmaxf(block_max(local_amax, scratch), FP8_MIN_AMAX);
    *scale = __fdiv_rn(amax, FP8_MAX);
    return __fmul_rn(__frcp_rn(amax), FP8_MAX);
}

// Per-row quantization of a row the CTA computes (one CTA per row): value(k, i, v) writes
// the N values of item i (a vector of N elements, or one element with N = 1) of the row's
// n items; k is the thread's register slot (0 .. VPT-1, i = threadIdx.x + k blockDim.x:
// a compile-time index once unrolled, so a caller may read its own register cache) or -1
// for the tail past VPT * blockDim items, which is computed twice (amax pass, store pass).
// Codes to q (item i at q + i * N), the row scale to *scale.
// With 16-bit activations and even N the register cache holds the values as dtype pairs
// (they are dtype values: x itself, or a kernel's output rounded to the dtype): half the
// registers of floats.
template <int VPT, int N, typename F>
__device__ __forceinline__ void quantize_row(const F& value, int n, fp8_t* __restrict__ q,
                                             float* __restrict__ scale, float* scratch) {
#if LLMC_DTYPE != 0
    constexpr bool PK = N % 2 == 0;
    unsigned packed[PK ? VPT : 1][N / 2 + 1];
#else
    constexpr bool PK = false;
#endif
    float cache[PK ? 1 : VPT][N];
    float amax = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) {
            float* v = cache[PK ? 0 : k];
            value(k, i, v);
#pragma unroll
            for (int e = 0; e < N; ++e) amax = fmaxf(amax, fabsf(v[e]));
#if LLMC_DTYPE != 0
            if constexpr (PK) {
#pragma unroll
                for (int e = 0; e < N / 2; ++e) packed[k][e] = pack2(v[2 * e], v[2 * e + 1]);
            }
#endif
        }
    }
    for (int i = threadIdx.x + VPT * blockDim.x; i < n; i += blockDim.x) {
        float v[N];
        value(-1, i, v);
#pragma unroll
        for (int e = 0; e < N; ++e) amax = fmaxf(amax, fabsf(v[e]));
    }
    float row_scale;
    const float inv = fp8_row_inv(amax, scratch, &row_scale);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) {
            float* v = cache[PK ? 0 : k];
#if LLMC_DTYPE != 0
            if constexpr (PK) {
#pragma unroll
                for (int e = 0; e < N / 2; ++e) {
                    v[2 * e] = to_float((unsigned short)(packed[k][e] & 0xffffu));
                    v[2 * e + 1] = to_float((unsigned short)(packed[k][e] >> 16));
                }
            }
#endif
            store_fp8<N>(q + i * N, v, inv);
        }
    }
    for (int i = threadIdx.x + VPT * blockDim.x; i < n; i += blockDim.x) {
        float v[N];
        value(-1, i, v);
        store_fp8<N>(q + i * N, v, inv);
    }
    if (threadIdx.x == 0) *scale = row_scale;
}

// Four codes (one 32-bit word, byte 0 first) -> two fp16x2 words (lo: bytes 0, 1; hi: 2, 3),
// exact.
__device__ __forceinline__ void fp8x4_to_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
#if LLMC_FP8_CVT
    asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n"
        " cvt.rn.f16x2.e4m3x2 %1, b; }"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#else
    // e4m3 bits s.eeee.mmm -> fp16 bits s.0eeee.mmm0000000 is the value / 256 (normals and
    // subnormals alike); the factor is restored exactly in fp16_times_256.
    const unsigned b02 = w & 0x00ff00ffu, b13 = (w >> 8) & 0x00ff00ffu;
    const unsigned h02 = ((b02 & 0x007f007fu) << 7) | ((b02 & 0x00800080u) << 8);
    const unsigned h13 = ((b13 & 0x007f007fu) << 7) | ((b13 & 0x00800080u) << 8);
    lo = fp16x2_times_256((h02 & 0xffffu) | (h13 << 16));
    hi = fp16x2_times_256((h02 >> 16) | (h13 & 0xffff0000u));
#endif
}

// Four codes -> their four float values (exact).
__device__ __forceinline__ void fp8x4_to_float(unsigned w, float* f) {
    unsigned lo, hi;
    fp8x4_to_half2x2(w, lo, hi);
    f[0] = half_bits_to_float(lo & 0xffffu);
    f[1] = half_bits_to_float(lo >> 16);
    f[2] = half_bits_to_float(hi & 0xffffu);
    f[3] = half_bits_to_float(hi >> 16);
}
