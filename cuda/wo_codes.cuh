// wo_codes.cuh: the code side of cuda/gemv_wo.cu (its header comment has the design):
// launch constants, kernel arguments, the work split (a lane's view of its tile, the batch
// loads, the L2 prefetch) and one k-step of a lane's two code vectors (scales applied per the
// scale mode); the unpacking arithmetic and PTX helpers are cuda/wo_unpack.cuh.
#pragma once
#include "common.cuh"
#include "gemv_skeleton.cuh"
#include "wo_unpack.cuh"

#define WO_THREADS 512
#define WO_WARPS GEMV_WARPS

#define WO_SCALE_F32 1  // flags
#define WO_OUT_F32 2
#define WO_PREFETCH 4  // L2 prefetch of the code vectors two batches ahead of the loads

#if LLMC_DTYPE == 0
#error "gemv_wo.cu: 16-bit activations only (float32 engines dequantize, llmc.cuda.gemv_wo_ops)"
#endif

// k-steps per batch (two batches in registers): 4 in row mode (2 rows x 4 = 8 16-byte code
// loads per lane, no scales to hold), 2 where each k-step carries its scales.
template <int SMODE>
__host__ __device__ constexpr int wo_u() {
    return SMODE == WO_ROW ? 4 : 2;
}

struct WoArgs {
    const scalar_t* x;        // [M, K]: residual (norm kernels) or activation
    const scalar_t* norm_w;   // [K] (norm kernels)
    float eps;
    const unsigned char* w;   // codes [rows, K / 2] or [rows, K]
    const void* scales;       // [rows, G] f16 or f32
    const void* offsets;      // [rows, G] like scales, or nullptr
    const scalar_t* bias;     // [N] or nullptr (norm, linear)
    void* out;                // [M, N] out, [M, I] act, residual [M, N]
    int n_out, K, M, S, gs, G, code_zero, flags;
};

// ---- work: cuda/gemv_skeleton.cuh -----------------------------------------------
// A lane's view of its tile: code rows g and g + 8 (at its 16-byte column of a k-step),
// scale / offset rows, the unpacking constants.
struct WoLane {
    const unsigned char* c[2];  // codes of rows g, g + 8 at byte 16 t of k-step 0
    const unsigned char* s[2];  // scale rows (bytes)
    const unsigned char* o[2];  // offset rows (nullptr: none)
    int t, K, rowbytes, gs, G;
    int gsh;  // log2(gs) when gs is a power of two (every layout llmc writes), else -1
    bool pow2;  // gsh >= 0 (a constant true in gemv_wo.cu's fixed-form stream)
    bool whole;  // rowbytes % 64 == 0: every k-step's vectors inside the row (ditto)
    bool f32, prefetch;
    bool has_o;  // offsets (o[h] non-null); gemv_wo.cu streams with f32 / has_o fixed
    WoConst k;
};

template <int BITS, int MODE>
__device__ __forceinline__ WoLane wo_lane(const WoArgs& a, int tile, int g, int t, WoConst k) {
    WoLane L;
    L.f32 = (a.flags & WO_SCALE_F32) != 0;
    L.rowbytes = BITS == 4 ? a.K / 2 : a.K;
    const long long gbytes = (long long)a.G * (L.f32 ? 4 : 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const long long row = gemv_tile_row<MODE>(tile, g + 8 * h, a.n_out);
        L.c[h] = a.w + row * L.rowbytes + 16 * t;
        L.s[h] = static_cast<const unsigned char*>(a.scales) + row * gbytes;
        L.o[h] = a.offsets ? static_cast<const unsigned char*>(a.offsets) + row * gbytes : nullptr;
    }
    L.has_o = a.offsets != nullptr;
    L.t = t, L.K = a.K, L.gs = a.gs, L.G = a.G, L.k = k;
    int sh = 0;
    while ((2 << sh) <= a.gs) ++sh;
    L.gsh = (1 << sh) == a.gs ? sh : -1;
    L.pow2 = L.gsh >= 0;
    L.whole = L.rowbytes % 64 == 0;
    L.prefetch = (a.flags & WO_PREFETCH) != 0;
    return L;
}

// 16 code bytes of k-step ks (zeros past the row).
template <bool VECTOR>
__device__ __forceinline__ v4u wo_load_codes(const WoLane& L, const unsigned char* p, int ks) {
    const int b = ks * 64 + 16 * L.t;  // byte of the row
    if constexpr (VECTOR) {
        if (L.whole || b < L.rowbytes) return wo_ld16(p + ks * 64);  // % 16 == 0: all or none
        return v4u{0u, 0u, 0u, 0u};
    } else {
        unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            if (b + e < L.rowbytes) w[e >> 2] |= (unsigned int)p[ks * 64 + e] << (8 * (e & 3));
        }
        return v4u{w[0], w[1], w[2], w[3]};
    }
}

// Raw scales of one batch entry: [row h][group A / B] (kstep: A only; row: none).
template <int SMODE>
struct WoScales {
    unsigned int s[2][SMODE == WO_DEQ ? 2 : 1];
    unsigned int o[2][SMODE == WO_DEQ ? 2 : 1];
};

template <int BITS, int SMODE>
struct WoBatch {
    v4u c[wo_u<SMODE>()][2];
    WoScales<SMODE> sc[wo_u<SMODE>()];
};

// Groups of the lane's columns at k-step ks (wo_load_batch, the ring): a (kstep: the k-step's), b.
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_groups(const WoLane& L, int ks, int& ga, int& gb) {
    constexpr int KS = wo_ks<BITS>(), VB = wo_vb<BITS>();
    const int c0 = ks * KS + (SMODE == WO_DEQ ? L.t * VB : 0), c1 = c0 + VB / 2;
    const bool sh = L.pow2;  // a shift, not a division (~25 instructions), per k-step
    ga = min(sh ? c0 >> L.gsh : c0 / L.gs, L.G - 1);
    gb = SMODE == WO_DEQ ? min(sh ? c1 >> L.gsh : c1 / L.gs, L.G - 1) : ga;
}

template <int BITS, int SMODE, bool VECTOR>
__device__ __forceinline__ void wo_load_batch(WoBatch<BITS, SMODE>& B, const WoLane& L, int kb,
                                              int n) {
#pragma unroll
    for (int u = 0; u < wo_u<SMODE>(); ++u) {
        if (u < n) {
            const int ks = kb + u;
#pragma unroll
            for (int h = 0; h < 2; ++h) B.c[u][h] = wo_load_codes<VECTOR>(L, L.c[h], ks);
            if constexpr (SMODE != WO_ROW) {
                int ga, gb;
                wo_groups<BITS, SMODE>(L, ks, ga, gb);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    B.sc[u].s[h][0] = wo_ld_scale(L.s[h], ga, L.f32);
                    B.sc[u].o[h][0] = L.has_o ? wo_ld_scale(L.o[h], ga, L.f32) : 0u;
                    if constexpr (SMODE == WO_DEQ) {
                        if (gb != ga) {
                            B.sc[u].s[h][1] = wo_ld_scale(L.s[h], gb, L.f32);
                            B.sc[u].o[h][1] = L.has_o ? wo_ld_scale(L.o[h], gb, L.f32) : 0u;
                        } else {
                            B.sc[u].s[h][1] = B.sc[u].s[h][0];
                            B.sc[u].o[h][1] = B.sc[u].o[h][0];
                        }
                    }
                }
            }
        }
    }
}

// L2 prefetch of the lane's code vectors of k-steps [kb, min(kb + wo_u<SMODE>(), s1)) (no registers
// held: more bytes in flight than the double-buffered loads alone).
template <int SMODE>
__device__ __forceinline__ void wo_prefetch_batch(const WoLane& L, int kb, int s1) {
    if (!L.prefetch) return;
#pragma unroll
    for (int u = 0; u < wo_u<SMODE>(); ++u) {
        const int ks = kb + u;
        if (ks < s1 && (L.whole || ks * 64 + 16 * L.t < L.rowbytes)) {
            wo_prefetch(L.c[0] + ks * 64);
            wo_prefetch(L.c[1] + ks * 64);
        }
    }
}

// The mmas of one k-step of a lane's two code vectors into acc.
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_kstep(float (&acc)[4], const v4u (&cv)[2],
                                         const WoScales<SMODE>& sc, const WoLane& L,
                                         const unsigned char* xk) {
    const unsigned int cw[2][4] = {{cv[0].x, cv[0].y, cv[0].z, cv[0].w},
                                   {cv[1].x, cv[1].y, cv[1].z, cv[1].w}};
    if constexpr (BITS == 4) {
        unsigned int s2[2][2], o2[2][2];  // deq: 16-bit scale / offset pairs [row][group]
        if constexpr (SMODE == WO_DEQ) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const float s = wo_scale(sc.s[h][q], L.f32);
                    const float o = L.has_o ? wo_scale(sc.o[h][q], L.f32) : 0.f;
                    s2[h][q] = pack2(s, s);
                    o2[h][q] = pack2(o, o);
                }
            }
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            unsigned int p[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (SMODE == WO_KSTEP) {
                    wo_unpack4_biased(cw[h][w], L.k, p[h]);
                } else {
                    wo_unpack4(cw[h][w], L.k, p[h]);
                }
                if constexpr (SMODE == WO_DEQ) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) p[h][j] = wo_fma2(p[h][j], s2[h][w >> 1], o2[h][w >> 1]);
                }
            }
            const v4u xv = *reinterpret_cast<const v4u*>(xk + w * 64);
            const unsigned int a0[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
            wo_mma(acc, a0, xv.x, xv.y);
            const unsigned int a1[4] = {p[0][2], p[1][2], p[0][3], p[1][3]};
            wo_mma(acc, a1, xv.z, xv.w);
        }
    } else {  // 8-bit: biased f16 codes (row, kstep) or dequantized floats (deq)
        float s[2] = {1.f, 1.f}, o[2] = {0.f, 0.f};
        if constexpr (SMODE == WO_DEQ) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                s[h] = wo_scale(sc.s[h][0], L.f32);
                o[h] = L.has_o ? wo_scale(sc.o[h][0], L.f32) : 0.f;
            }
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const v4u xv = *reinterpret_cast<const v4u*>(xk + q * 64);
            const unsigned int xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int ww = 0; ww < 2; ++ww) {
                const int w = 2 * q + ww;
                unsigned int p[2][2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if constexpr (wo_biased8<BITS, SMODE>()) {
                        wo_unpack8_biased(cw[h][w], p[h]);
                    } else {
                        float f[4];
                        wo_unpack8(cw[h][w], L.k, f);
#pragma unroll
                        for (int e = 0; e < 4; ++e) f[e] = fmaf(s[h], f[e], o[h]);
                        p[h][0] = pack2(f[0], f[1]);
                        p[h][1] = pack2(f[2], f[3]);
                    }
                }
                const unsigned int a[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
                if constexpr (wo_biased8<BITS, SMODE>()) {
                    wo_mma_h(acc, a, xw[2 * ww], xw[2 * ww + 1]);
                } else {
                    wo_mma(acc, a, xw[2 * ww], xw[2 * ww + 1]);
                }
            }
        }
    }
}

// Whether a launch stages activation sums: the offsets of the row / kstep modes, and every
// launch with biased codes (4-bit kstep, 8-bit row / kstep): llmc.cuda.gemv_wo_ops.wo_has_sums,
// the same rule.
template <int BITS, int SMODE>
__host__ __device__ constexpr bool wo_has_sums(bool offsets) {
    return SMODE != WO_DEQ && (offsets || SMODE == WO_KSTEP || BITS == 8);
}

// Shared per-k-step activation sums (offsets of the kstep mode, all of K for row mode).
struct WoSums {
    const float* xsum;  // [M][n] or nullptr
    int n, M;
};

// One k-step ks of a lane's two code vectors into tot, its scales applied per the scale
// mode (kstep: the k-step's mma sums scaled and added in float32, + o * sum of its x). The
// register stream (gemv_wo.cu) and the shared-memory ring (wo_ring.cuh) both call this, in
// the same k-step order: the same float32 operations, so the same bits.
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_mma_kstep(float (&tot)[4], const v4u (&cv)[2],
                                             const WoScales<SMODE>& sc, const WoLane& L,
                                             const unsigned char* xrow, int ks,
                                             const WoSums& xs, int t4) {
    const unsigned char* xk = xrow + ks * (wo_ks<BITS>() * 2);  // staged bytes per k-step
    if constexpr (SMODE == WO_KSTEP) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        wo_kstep<BITS, SMODE>(acc, cv, sc, L, xk);
        const float sg = wo_scale(sc.s[0][0], L.f32);
        const float s8 = wo_scale(sc.s[1][0], L.f32);
        tot[0] = fmaf(sg, acc[0], tot[0]);
        tot[1] = fmaf(sg, acc[1], tot[1]);
        tot[2] = fmaf(s8, acc[2], tot[2]);
        tot[3] = fmaf(s8, acc[3], tot[3]);
        if (xs.xsum != nullptr) {  // + (o - s (magic + z)) * (sum of the k-step's x), per token
            float og = L.has_o ? wo_scale(sc.o[0][0], L.f32) : 0.f;
            float o8 = L.has_o ? wo_scale(sc.o[1][0], L.f32) : 0.f;
            if constexpr (BITS == 4 || wo_biased8<BITS, SMODE>()) {  // the biased codes'
                const float mz = BITS == 4 ? L.k.mz : L.k.mz8;     // magic + code_zero
                og = fmaf(-sg, mz, og);
                o8 = fmaf(-s8, mz, o8);
            }
            const int m0 = min(2 * t4, xs.M - 1), m1 = min(2 * t4 + 1, xs.M - 1);
            const float x0 = xs.xsum[m0 * xs.n + ks], x1 = xs.xsum[m1 * xs.n + ks];
            tot[0] = fmaf(og, x0, tot[0]);
            tot[1] = fmaf(og, x1, tot[1]);
            tot[2] = fmaf(o8, x0, tot[2]);
            tot[3] = fmaf(o8, x1, tot[3]);
        }
    } else {
        wo_kstep<BITS, SMODE>(tot, cv, sc, L, xk);
    }
}
