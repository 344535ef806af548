// common.cuh: dtype plumbing shared by every llmc kernel (no CUDA headers needed, so the
// same text compiles under nvcc and NVRTC).
//
// Macros set by llmc.cuda.kernels (defaults here so that a bare `nvcc -cubin` compiles):
//   LLMC_DTYPE    0 = float32, 1 = float16, 2 = bfloat16 (activation / weight / KV dtype)
//   HEAD_DIM, NUM_Q_HEADS, NUM_KV_HEADS   model constants of the attention kernels
// 16-bit values are stored as unsigned short and converted with PTX cvt instructions;
// all arithmetic is float32.
#pragma once

#ifndef LLMC_DTYPE
#define LLMC_DTYPE 2
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef NUM_Q_HEADS
#define NUM_Q_HEADS 32
#endif
#ifndef NUM_KV_HEADS
#define NUM_KV_HEADS 8
#endif

// 16- and 8-byte vectors (own types: NVRTC needs no CUDA headers).
struct alignas(16) v4u {
    unsigned int x, y, z, w;
};
struct alignas(8) v2u {
    unsigned int x, y;
};

#define LLMC_NEG_INF (__int_as_float(0xff800000))

#if LLMC_DTYPE == 0
typedef float scalar_t;
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float from_float(float x) { return x; }
#else
typedef unsigned short scalar_t;
__device__ __forceinline__ float to_float(unsigned short x) {
#if LLMC_DTYPE == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#else
    return __uint_as_float(((unsigned int)x) << 16);
#endif
}
__device__ __forceinline__ unsigned short from_float(float f) {
    unsigned short r;
#if LLMC_DTYPE == 1
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}
// Two floats -> one 32-bit register of two 16-bit values (lo in the low half).
__device__ __forceinline__ unsigned int pack2(float lo, float hi) {
    unsigned int r;
#if LLMC_DTYPE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

// Elements of scalar_t in one 16-byte vector.
#define VEC ((int)(16 / sizeof(scalar_t)))

// Load / store N consecutive elements as floats, with the widest access N allows
// (callers guarantee alignment to N * sizeof(scalar_t) bytes when that is 4, 8 or 16).
template <int N>
__device__ __forceinline__ void load_vec(const scalar_t* p, float* f) {
    constexpr int bytes = N * (int)sizeof(scalar_t);
    if constexpr (bytes == 16 || bytes == 8 || bytes == 4) {
        constexpr int words = bytes / 4;
        unsigned int w[words];
        if constexpr (words == 4) {
            v4u v = *reinterpret_cast<const v4u*>(p);
            w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
        } else if constexpr (words == 2) {
            v2u v = *reinterpret_cast<const v2u*>(p);
            w[0] = v.x; w[1] = v.y;
        } else {
            w[0] = *reinterpret_cast<const unsigned int*>(p);
        }
#pragma unroll
        for (int i = 0; i < words; ++i) {
#if LLMC_DTYPE == 0
            f[i] = __uint_as_float(w[i]);
#else
            f[2 * i] = to_float((unsigned short)(w[i] & 0xffffu));
            f[2 * i + 1] = to_float((unsigned short)(w[i] >> 16));
#endif
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = to_float(p[i]);
    }
}

template <int N>
__device__ __forceinline__ void store_vec(scalar_t* p, const float* f) {
    constexpr int bytes = N * (int)sizeof(scalar_t);
    if constexpr (bytes == 16 || bytes == 8 || bytes == 4) {
        constexpr int words = bytes / 4;
        unsigned int w[words];
#pragma unroll
        for (int i = 0; i < words; ++i) {
#if LLMC_DTYPE == 0
            w[i] = __float_as_uint(f[i]);
#else
            w[i] = pack2(f[2 * i], f[2 * i + 1]);
#endif
        }
        if constexpr (words == 4) {
            *reinterpret_cast<v4u*>(p) = v4u{w[0], w[1], w[2], w[3]};
        } else if constexpr (words == 2) {
            *reinterpret_cast<v2u*>(p) = v2u{w[0], w[1]};
        } else {
            *reinterpret_cast<unsigned int*>(p) = w[0];
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = from_float(f[i]);
    }
}

// Largest element count n <= 16 bytes that divides `count` (for vector widths of a
// compile-time row length).
__host__ __device__ constexpr int vec_width_for(int count) {
    return (count % VEC == 0) ? VEC
         : (count % (VEC / 2 > 0 ? VEC / 2 : 1) == 0) ? (VEC / 2 > 0 ? VEC / 2 : 1)
         : (count % (VEC / 4 > 0 ? VEC / 4 : 1) == 0) ? (VEC / 4 > 0 ? VEC / 4 : 1)
         : 1;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reduction over the block (any blockDim multiple of 32, <= 1024) by WARP_OP (warp_sum,
// warp_max) with its identity; every thread gets the result. `scratch` holds 33 floats of
// shared memory; safe to call repeatedly.
template <float (*WARP_OP)(float)>
__device__ __forceinline__ float block_reduce(float v, float identity, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = WARP_OP(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? scratch[lane] : identity;
        t = WARP_OP(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    return scratch[32];
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    return block_reduce<warp_sum>(v, 0.f, scratch);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    return block_reduce<warp_max>(v, LLMC_NEG_INF, scratch);
}
