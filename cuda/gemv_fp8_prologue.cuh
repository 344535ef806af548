// gemv_fp8_prologue.cuh: the prologue of cuda/gemv_fp8.cu (included there after its G8Args
// and f32x2_to_e4m3x2; no includes of its own): every CTA quantizes the M token rows it
// multiplies — the rms scale per row (norm kernels), the amax of the values to quantize,
// their e4m3 codes into shared memory (row stride S, zero-padded to whole k-steps) and the
// row scales amax / 448.
//
// Two forms, the same operations in the same order, so the same bits:
//   g8_prologue_passes  each of the (up to) three passes reads x (and norm_w) again from
//                       global memory (any M, any K);
//   g8_prologue_regs    M = 1, 16-byte vectors, K <= G8_REG_ITERS x 512 x VEC: the first
//                       pass keeps the thread's x vectors in registers as they were loaded,
//                       the amax pass replaces them by the rounded normed values (exact in
//                       16 bits), and the codes pass reads those: one global read of x and
//                       of norm_w instead of three and two, i.e. two L2 round trips fewer
//                       between pdl_wait() and the first mma of a batch-1 decode GEMV.
// g8_prologue picks (CTA-uniform: K and M are launch constants).
#pragma once

#define G8_REG_ITERS 4  // x vectors a thread may hold (K <= 16,384 for 16-bit activations)

// Per-row block reduction (sum, or max when MAX) of v[M]; every thread gets the totals.
// `red` [16][M] and `tot` [M] are shared scratch, safe to reuse by the next call.
template <int M, bool MAX>
__device__ __forceinline__ void reduce_rows(float (&v)[M], float (*red)[M], float* tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float s = MAX ? warp_max(v[m]) : warp_sum(v[m]);
        if (lane == 0) red[warp][m] = s;
    }
    __syncthreads();
    if (threadIdx.x < M) {
        const float* col = &red[0][threadIdx.x];
        float t = col[0];
#pragma unroll
        for (int w = 1; w < G8_WARPS; ++w) t = MAX ? fmaxf(t, col[w * M]) : t + col[w * M];
        tot[threadIdx.x] = t;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m) v[m] = tot[m];
}

// Vector i of the norm weight (norm kernels; unused by gemv8_add).
template <int MODE, int VW>
__device__ __forceinline__ void g8_norm_w(const G8Args& a, int i, float* nw) {
    if constexpr (MODE != 2) {
        load_vec<VW>(a.norm_w + i * VW, nw);
    } else {
#pragma unroll
        for (int e = 0; e < VW; ++e) nw[e] = 1.f;
    }
}

// Vector i of row m of what the prologue quantizes: the rms-normed row rounded to the
// dtype (rs = its rms scale, nw the norm weight vector), or x itself.
template <int MODE, int VW>
__device__ __forceinline__ void g8_values(const G8Args& a, int m, int i, float rs,
                                          const float* nw, float* f) {
    load_vec<VW>(a.x + (long long)m * a.K + i * VW, f);
    if constexpr (MODE != 2) {
#pragma unroll
        for (int e = 0; e < VW; ++e) f[e] = to_float(from_float(f[e] * rs * nw[e]));
    }
}

// Quantize the M rows into xq (codes) and xscale (xs per row), re-reading x from global
// memory in each pass; ends with a barrier.
template <int M, int MODE, int VW>
__device__ __forceinline__ void g8_prologue_passes(const G8Args& a, unsigned char* xq, float* xscale,
                                            float (*red)[M], float* tot) {
    const int K = a.K, nv = K / VW;
    float rs[M], v[M];
#pragma unroll
    for (int m = 0; m < M; ++m) rs[m] = 1.f, v[m] = 0.f;
    if constexpr (MODE != 2) {  // rms scale: float32 sum of squares
        for (int i = threadIdx.x; i < nv; i += G8_THREADS) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float f[VW];
                load_vec<VW>(a.x + (long long)m * K + i * VW, f);
#pragma unroll
                for (int e = 0; e < VW; ++e) v[m] += f[e] * f[e];
            }
        }
        reduce_rows<M, false>(v, red, tot);
#pragma unroll
        for (int m = 0; m < M; ++m) rs[m] = rsqrtf(v[m] / (float)K + a.eps), v[m] = 0.f;
    }
    for (int i = threadIdx.x; i < nv; i += G8_THREADS) {  // amax of what gets quantized
        float nw[VW];
        g8_norm_w<MODE, VW>(a, i, nw);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float f[VW];
            g8_values<MODE, VW>(a, m, i, rs[m], nw, f);
#pragma unroll
            for (int e = 0; e < VW; ++e) v[m] = fmaxf(v[m], fabsf(f[e]));
        }
    }
    reduce_rows<M, true>(v, red, tot);
    float inv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float amax = fmaxf(v[m], 1e-12f);
        inv[m] = 448.f / amax;
        if (threadIdx.x == m) xscale[m] = amax / 448.f;
    }
    for (int i = threadIdx.x; i < nv; i += G8_THREADS) {  // the codes
        float nw[VW];
        g8_norm_w<MODE, VW>(a, i, nw);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float f[VW];
            g8_values<MODE, VW>(a, m, i, rs[m], nw, f);
#pragma unroll
            for (int e = 0; e < VW; ++e) f[e] *= inv[m];
            unsigned char* q = xq + m * a.S + i * VW;
            if constexpr (VW == 1) {
                *q = (unsigned char)(f32x2_to_e4m3x2(f[0], 0.f) & 0xffu);
            } else {
                unsigned int wd[VW / 4];
#pragma unroll
                for (int p = 0; p < VW / 4; ++p) {
                    wd[p] = (unsigned int)f32x2_to_e4m3x2(f[4 * p], f[4 * p + 1]) |
                            ((unsigned int)f32x2_to_e4m3x2(f[4 * p + 2], f[4 * p + 3]) << 16);
                }
                if constexpr (VW == 8) {
                    *reinterpret_cast<v2u*>(q) = v2u{wd[0], wd[1]};
                } else {
                    *reinterpret_cast<unsigned int*>(q) = wd[0];
                }
            }
        }
    }
    const int pad = (K + 63) / 64 * 64 - K;  // zero codes up to whole k-steps
    for (int i = threadIdx.x; i < M * pad; i += G8_THREADS) xq[(i / pad) * a.S + K + i % pad] = 0;
    __syncthreads();
}

#if LLMC_DTYPE != 0  // the register form: 16-bit activations only
// Vector i of x as its raw 16-byte word (16-bit activations: VEC = 8 elements).
__device__ __forceinline__ v4u g8_raw_x(const scalar_t* p) {
    return *reinterpret_cast<const v4u*>(p);
}

// The 8 elements of a raw vector as floats / 8 floats (exact in 16 bits) as a raw vector.
__device__ __forceinline__ void g8_unpack8(const v4u& v, float* f) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = to_float((unsigned short)(w[i] & 0xffffu));
        f[2 * i + 1] = to_float((unsigned short)(w[i] >> 16));
    }
}

__device__ __forceinline__ v4u g8_pack8(const float* f) {
    return v4u{pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7])};
}

// The 8 codes of one vector of values times inv at xq + i * 8 (one 8-byte store).
__device__ __forceinline__ void g8_store_codes8(unsigned char* q, const float* f, float inv) {
    unsigned int wd[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        wd[p] = (unsigned int)f32x2_to_e4m3x2(f[4 * p] * inv, f[4 * p + 1] * inv) |
                ((unsigned int)f32x2_to_e4m3x2(f[4 * p + 2] * inv, f[4 * p + 3] * inv) << 16);
    }
    *reinterpret_cast<v2u*>(q) = v2u{wd[0], wd[1]};
}

// g8_prologue_passes for M = 1 with x held in registers (see the header).
template <int MODE>
__device__ __forceinline__ void g8_prologue_regs(const G8Args& a, unsigned char* xq,
                                                 float* xscale, float (*red)[1], float* tot) {
    constexpr int VW = 8;
    const int K = a.K, nv = K / VW;
    v4u xr[G8_REG_ITERS];  // raw x, then the rounded normed values (MODE != 2)
    float v[1] = {0.f};
    float rs = 1.f;
#pragma unroll
    for (int it = 0; it < G8_REG_ITERS; ++it) {
        const int i = threadIdx.x + it * G8_THREADS;
        xr[it] = v4u{0u, 0u, 0u, 0u};
        if (i < nv) xr[it] = g8_raw_x(a.x + i * VW);
    }
    if constexpr (MODE != 2) {  // rms scale: float32 sum of squares, in the passes' order
#pragma unroll
        for (int it = 0; it < G8_REG_ITERS; ++it) {
            if (threadIdx.x + it * G8_THREADS < nv) {
                float f[VW];
                g8_unpack8(xr[it], f);
#pragma unroll
                for (int e = 0; e < VW; ++e) v[0] += f[e] * f[e];
            }
        }
        reduce_rows<1, false>(v, red, tot);
        rs = rsqrtf(v[0] / (float)K + a.eps);
        v[0] = 0.f;
    }
#pragma unroll
    for (int it = 0; it < G8_REG_ITERS; ++it) {  // amax of what gets quantized
        const int i = threadIdx.x + it * G8_THREADS;
        if (i < nv) {
            float nw[VW], f[VW];
            g8_norm_w<MODE, VW>(a, i, nw);
            g8_unpack8(xr[it], f);
            if constexpr (MODE != 2) {
#pragma unroll
                for (int e = 0; e < VW; ++e) f[e] = to_float(from_float(f[e] * rs * nw[e]));
                xr[it] = g8_pack8(f);  // exact: the values are 16-bit already
            }
#pragma unroll
            for (int e = 0; e < VW; ++e) v[0] = fmaxf(v[0], fabsf(f[e]));
        }
    }
    reduce_rows<1, true>(v, red, tot);
    const float amax = fmaxf(v[0], 1e-12f), inv = 448.f / amax;
    if (threadIdx.x == 0) xscale[0] = amax / 448.f;
#pragma unroll
    for (int it = 0; it < G8_REG_ITERS; ++it) {  // the codes
        const int i = threadIdx.x + it * G8_THREADS;
        if (i < nv) {
            float f[VW];
            g8_unpack8(xr[it], f);
            g8_store_codes8(xq + i * VW, f, inv);
        }
    }
    const int pad = (K + 63) / 64 * 64 - K;  // zero codes up to whole k-steps
    for (int i = threadIdx.x; i < pad; i += G8_THREADS) xq[K + i] = 0;
    __syncthreads();
}
#endif  // LLMC_DTYPE != 0

// Whether g8_prologue_regs serves a launch (CTA-uniform).
template <int M, int VW>
__device__ __forceinline__ bool g8_regs_fit(int K) {
    return M == 1 && VW == 8 && LLMC_DTYPE != 0 && K / VW <= G8_REG_ITERS * G8_THREADS;
}

// Quantize the M rows into xq and xscale (g8_prologue_regs where it fits); ends with a
// barrier.
template <int M, int MODE, int VW>
__device__ __forceinline__ void g8_prologue(const G8Args& a, unsigned char* xq, float* xscale,
                                            float (*red)[M], float* tot) {
#if LLMC_DTYPE != 0 && !defined(G8_PROLOGUE_PASSES_ONLY)  // (the emulator tests' A / B)
    if constexpr (M == 1 && VW == 8) {
        if (g8_regs_fit<M, VW>(a.K)) {
            g8_prologue_regs<MODE>(a, xq, xscale, red, tot);
            return;
        }
    }
#endif
    g8_prologue_passes<M, MODE, VW>(a, xq, xscale, red, tot);
}
