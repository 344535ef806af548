// wo_prologue.cuh: the prologue of cuda/gemv_wo.cu (its header comment has the design): every
// CTA stages the M token rows it multiplies into shared memory as 16-bit values in the mma
// pair order — rms-normed and rounded for the norm kernels — zeroes the pad to whole k-steps,
// and (where the launch has biased codes or offsets) sums them per k-step (one shuffled
// atomic a k-step) or per row (warp sums added in warp order): deterministic, the same bits
// every run.
#pragma once
#include "wo_codes.cuh"

// ---- prologue ---------------------------------------------------------------------------
// Per-row block sums of v[8] (rows >= M zero); every thread gets the totals.
__device__ __forceinline__ void wo_reduce_rows(float (&v)[8], float (*red)[8], float* tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const float s = warp_sum(v[m]);
        if (lane == 0) red[warp][m] = s;
    }
    __syncthreads();
    if (threadIdx.x < 8) {
        float t = 0.f;
#pragma unroll
        for (int w = 0; w < WO_WARPS; ++w) t += red[w][threadIdx.x];
        tot[threadIdx.x] = t;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < 8; ++m) v[m] = tot[m];
}

// Two staged 16-bit values (lo, hi): f16 where X16, else the build's dtype. The values are
// already representable (rounded by the caller), so the conversion is exact.
template <bool X16>
__device__ __forceinline__ unsigned int wo_pack_x(float lo, float hi) {
    if constexpr (X16) return (unsigned int)wo_f2h(lo) | ((unsigned int)wo_f2h(hi) << 16);
    return pack2(lo, hi);
}

// Columns c0 .. c0 + VW - 1 of a staged row, in the pair order.
template <int BITS, int VW, bool X16>
__device__ __forceinline__ void wo_stage(unsigned char* row, int c0, const float (&f)[VW]) {
    if constexpr (VW == 8) {  // one code word (4-bit) or two (8-bit): 16 bytes
        v4u v;
        if constexpr (BITS == 4) {
            v = v4u{wo_pack_x<X16>(f[0], f[4]), wo_pack_x<X16>(f[1], f[5]),
                    wo_pack_x<X16>(f[2], f[6]), wo_pack_x<X16>(f[3], f[7])};
        } else {
            v = v4u{wo_pack_x<X16>(f[0], f[1]), wo_pack_x<X16>(f[2], f[3]),
                    wo_pack_x<X16>(f[4], f[5]), wo_pack_x<X16>(f[6], f[7])};
        }
        *reinterpret_cast<v4u*>(row + wo_xoff<BITS>(c0)) = v;
    } else {
#pragma unroll
        for (int e = 0; e < VW; ++e) {
            const unsigned short h = X16 ? wo_f2h(f[e]) : (unsigned short)from_float(f[e]);
            *reinterpret_cast<unsigned short*>(row + wo_xoff<BITS>(c0 + e)) = h;
        }
    }
}

// Stage the M rows (rms-normed and rounded for MODE 0 / 1) into xs as 16-bit values in the
// pair order, zero the pad, and (wo_has_sums) their sums per k-step / per row; ends with a
// barrier. Returns the factor the sums must be multiplied by: 1, or, where f16 staging of a
// bf16 build (wo_x16) meets a value of magnitude >= 32768, 2^e for the power of two 2^-e the
// CTA staged every row times (exact: a power of two), so that no staged value overflows.
template <int MODE, int BITS, int SMODE, int VW>
__device__ __forceinline__ float wo_prologue(const WoArgs& a, unsigned char* xs, float* xsum,
                                             int nsum, float (*red)[8], float* tot) {
    constexpr bool X16 = wo_x16<BITS, SMODE>();
    constexpr bool RESCALE = X16 && LLMC_DTYPE == 2;  // bf16 values past the f16 range
    constexpr int KS = wo_ks<BITS>();
    const int K = a.K, M = a.M, nv = K / VW;
    const int pad = (K + KS - 1) / KS * KS - K;
    for (int i = threadIdx.x; i < M * pad; i += WO_THREADS) {
        const int m = i / pad, c = K + i % pad;
        *reinterpret_cast<unsigned short*>(xs + m * a.S + wo_xoff<BITS>(c)) = 0;
    }
    float rs[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) rs[m] = 1.f;
    if constexpr (MODE == 0 || MODE == 1) {  // rms scale: float32 sum of squares
        float v[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = 0.f;
        for (int i = threadIdx.x; i < nv; i += WO_THREADS) {
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                if (m < M) {
                    float f[VW];
                    load_vec<VW>(a.x + (long long)m * K + i * VW, f);
#pragma unroll
                    for (int e = 0; e < VW; ++e) v[m] += f[e] * f[e];
                }
            }
        }
        wo_reduce_rows(v, red, tot);
#pragma unroll
        for (int m = 0; m < 8; ++m) rs[m] = rsqrtf(v[m] / (float)K + a.eps);
    }
    // Every lane of a warp makes the same trips (the sums are shuffled over the lanes that
    // share one: a whole k-step of a vector kernel, so one atomic per sum and its bits fixed).
    constexpr int SW = SMODE == WO_ROW ? 32 : (KS / VW < 32 ? KS / VW : 32);
    __shared__ unsigned int big_bits;  // RESCALE: the CTA's largest |value| (float bits)
    if (RESCALE && threadIdx.x == 0) big_bits = 0u;
    float xscale = 1.f, back = 1.f;
    float rsum[8];  // row mode: the warp's sums of x per row (lane-uniform), added in order
    for (int pass = 0; pass < 2; ++pass) {  // pass 1 only where RESCALE found a value
        float amax = 0.f;  // this thread's largest |value|
#pragma unroll
        for (int m = 0; m < 8; ++m) rsum[m] = 0.f;
        if (SMODE != WO_ROW && xsum != nullptr) {  // row mode writes its sums once, at the end
            for (int i = threadIdx.x; i < M * nsum; i += WO_THREADS) xsum[i] = 0.f;
            __syncthreads();  // the sums are zero before any thread adds to them
        }
        for (int i0 = 0; i0 < nv; i0 += WO_THREADS) {
            const int i = i0 + (int)threadIdx.x;
            const bool in = i < nv;
            float nw[VW];
#pragma unroll
            for (int e = 0; e < VW; ++e) nw[e] = 0.f;
            if constexpr (MODE == 0 || MODE == 1) {
                if (in) load_vec<VW>(a.norm_w + i * VW, nw);
            }
            const int c0 = i * VW;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                if (m >= M) continue;
                float f[VW];
#pragma unroll
                for (int e = 0; e < VW; ++e) f[e] = 0.f;
                if (in) load_vec<VW>(a.x + (long long)m * K + c0, f);
                if constexpr (MODE == 0 || MODE == 1) {
#pragma unroll
                    for (int e = 0; e < VW; ++e) f[e] = to_float(from_float(f[e] * rs[m] * nw[e]));
                }
                if constexpr (RESCALE) {  // the f16 values the mmas will see (the sums' too)
#pragma unroll
                    for (int e = 0; e < VW; ++e) {
                        amax = fmaxf(amax, fabsf(f[e]));
                        f[e] = wo_h2f(wo_f2h(f[e] * xscale));
                    }
                }
                if (in) wo_stage<BITS, VW, X16>(xs + m * a.S, c0, f);
                if (xsum != nullptr) {
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < VW; ++e) s += in ? f[e] : 0.f;
#pragma unroll
                    for (int o = SW / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                    if constexpr (SMODE == WO_ROW) {
                        rsum[m] += s;  // a float atomic per warp would add in any order
                    } else if (in && (threadIdx.x & (SW - 1)) == 0) {
                        atomicAdd(&xsum[m * nsum + c0 / KS], s);  // one per k-step: its bits fixed
                    }
                }
            }
        }
        if constexpr (!RESCALE) break;
        if (pass == 1) break;
        if (amax >= 32768.f) atomicMax(&big_bits, __float_as_uint(amax));
        __syncthreads();
        const unsigned int bits = big_bits;  // CTA-uniform
        if (bits == 0u) break;
        // stage again, times 2^-e: the largest value below 32768 (amax < 2^(e + 15))
        const int e = (int)((bits >> 23) & 0xffu) - 127 - 14;
        xscale = __uint_as_float((unsigned int)(127 - e) << 23);
        back = __uint_as_float((unsigned int)(127 + e) << 23);
        __syncthreads();  // every thread has read big_bits (the sums are re-zeroed next)
    }
    if constexpr (SMODE == WO_ROW) {  // the row sums in warp order: the same bits every run
        if (xsum != nullptr) {  // CTA-uniform
            if ((threadIdx.x & 31) == 0) {
#pragma unroll
                for (int m = 0; m < 8; ++m) red[threadIdx.x >> 5][m] = rsum[m];
            }
            __syncthreads();
            if ((int)threadIdx.x < M) {
                float t = 0.f;
                for (int w = 0; w < WO_WARPS; ++w) t += red[w][threadIdx.x];
                xsum[threadIdx.x] = t;
            }
        }
    }
    __syncthreads();
    return back;
}
