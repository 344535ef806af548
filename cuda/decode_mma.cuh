// decode_mma.cuh: the tensor-core pass of one decode-attention CTA over its keys
// (mma.sync m16n8k16, fp16 / bf16 operands, float32 accumulation), for 16-bit dtypes with
// HD % 16 == 0 (an e4m3 cache: HD % 32 == 0), HD <= 128 and G <= 8 query heads per kv head.  Included
// by decode_attention.cu after its NQ / NKV / HD / G macros; same contract as
// attend_cta_simt (decode_cta.cuh): each warp's (max, sum, unnormalised acc) per head into
// sm_ml / sm_acc.
//
// Why: one K or V element feeds G fused multiply-adds; at 64 x 4,096 the CUDA-core pass
// spends ~5 instructions per bf16 element (~10 per e4m3 element with its conversion), so
// an e4m3 cache could not be read at HBM speed with float32 FMAs.  Here one mma does
// 16 x 8 x 16 of them.
//
// Warp w owns the 16-key tiles w, w + NWARPS, ... of [kbeg, kend) with its own online
// softmax (log2 domain; q pre-scaled by scale_log2).  Per tile (g = lane / 4, t = lane % 4):
//   S = Q K^T      M = 16 rows: the G heads (rows >= G are zero), N = 8 keys (two n-tiles),
//                  K = 16 head dims per step (HD / 16 steps);
//   O^T = V^T P^T  M = 16 head dims per m-tile (HD / 16 of them), N = 8: the heads,
//                  K = the tile's 16 keys.
// P^T's B fragment IS S's C fragment (lane (g, t) holds head g, keys 2t, 2t+1 of each
// n-tile), so P never moves between lanes; only the rescale factor of heads 2t, 2t+1 is
// fetched with two shuffles.  Head dims are permuted (any bijection works for a dot product,
// Q and K use the same one) so that every lane loads contiguous chunks straight from the
// paged cache into registers:
//   K: lane (g, t) holds key g of each n-tile, dims [t HD/4, (t+1) HD/4); step ks uses dims
//      t HD/4 + 4 ks + {0, 1} (b0) and + {2, 3} (b1);
//   V: lane (g, t) holds keys 2t, 2t+1, 2t+8, 2t+9, dims [g HD/8, (g+1) HD/8); m-tile mt's
//      rows g and g + 8 are dims g HD/8 + 2 mt and + 1 (A fragments by byte permutes).
// e4m3 codes become fp16 exactly (cvt.rn.f16x2.e4m3x2): an fp8 cache runs fp16 mma (q
// rounded to fp16 after the scaling, P in fp16) whatever the activation dtype.
// Loads run STAGES tiles ahead in registers (no shared memory, no barrier in the loop).
#pragma once

// (head_dim <= 128: a 16-key tile of a lane is 64 registers at 128; at 256 the double
// buffer alone would take every register)
#define MMA_DECODE_16 (LLMC_DTYPE != 0 && HD % 16 == 0 && HD <= 128 && G <= 8)
#define MMA_DECODE_FP8 (LLMC_DTYPE != 0 && HD % 32 == 0 && HD <= 128 && G <= 8)

#if MMA_DECODE_16 || MMA_DECODE_FP8

#ifndef LLMC_HOST_EMULATION
// D = A B + D, fp16 (F16) or bf16 operands.
template <bool F16>
__device__ __forceinline__ void mma_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                          unsigned a3, unsigned b0, unsigned b1) {
    if constexpr (F16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}
// Two floats -> one fp16x2 / bf16x2 operand register (lo in the low half).
template <bool F16>
__device__ __forceinline__ unsigned pack_op(float lo, float hi) {
    unsigned r;
    if constexpr (F16) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}
#endif

// The registers of one 16-key tile of one lane (see the header for which keys and dims).
template <typename cache_t>
struct MmaTile {
    static constexpr int EB = (int)sizeof(cache_t);
    static constexpr int KW = HD / 4 * EB / 4;  // words of a lane's K chunk
    static constexpr int VW = HD / 8 * EB / 4;  // words of a lane's V chunk
    unsigned k[2][KW];
    unsigned v[4][VW];
};

// Cache row (slot * NKV + kvh) * HD offset of key j of the sequence.
template <bool POW2>
__device__ __forceinline__ long long key_offset(const int* __restrict__ bt, int block_size,
                                                int bs_shift, int kvh, int j) {
    const int bi = POW2 ? (j >> bs_shift) : (j / block_size);
    const int bo = j - bi * block_size;
    return (((long long)bt[bi] * block_size + bo) * NKV + kvh) * HD;
}

// Load the tile of keys [base, base + 16) (keys >= kend: zeros).
template <bool POW2, typename cache_t>
__device__ __forceinline__ void mma_load_tile(MmaTile<cache_t>& tl,
                                              const cache_t* __restrict__ k_cache,
                                              const cache_t* __restrict__ v_cache,
                                              const int* __restrict__ bt, int block_size,
                                              int bs_shift, int kvh, int base, int kend) {
    using T = MmaTile<cache_t>;
    const int lane = threadIdx.x & 31, g8 = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        const int j = base + nt * 8 + g8;
        if (j < kend) {
            load_words<T::KW>(k_cache + key_offset<POW2>(bt, block_size, bs_shift, kvh, j) +
                                  tq * (HD / 4),
                              tl.k[nt]);
        } else {
#pragma unroll
            for (int i = 0; i < T::KW; ++i) tl.k[nt][i] = 0u;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int j = base + 2 * tq + (i & 1) + (i >> 1) * 8;
        if (j < kend) {
            load_words<T::VW>(v_cache + key_offset<POW2>(bt, block_size, bs_shift, kvh, j) +
                                  g8 * (HD / 8),
                              tl.v[i]);
        } else {
#pragma unroll
            for (int w = 0; w < T::VW; ++w) tl.v[i][w] = 0u;
        }
    }
}

// Online softmax + P.V of one tile for this lane's rows (heads) / columns (heads 2t, 2t+1).
template <typename cache_t, bool F16>
__device__ __forceinline__ void mma_tile(const MmaTile<cache_t>& tl, const unsigned (&qa)[HD / 16][2],
                                         int base, int kend, float& m, float& l,
                                         float (&o)[HD / 16][4]) {
    constexpr bool FP8 = sizeof(cache_t) == 1;
    const int lane = threadIdx.x & 31, tq = lane & 3;
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            unsigned b0, b1;
            if constexpr (FP8) {
                fp8x4_to_half2x2(tl.k[nt][ks], b0, b1);
            } else {
                b0 = tl.k[nt][2 * ks];
                b1 = tl.k[nt][2 * ks + 1];
            }
            mma_16816<F16>(s[nt], qa[ks][0], 0u, qa[ks][1], 0u, b0, b1);
        }
    }
    // row g (head g): s[nt][0], s[nt][1] are keys base + 8 nt + 2t, + 1
    float mx = LLMC_NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            if (base + 8 * nt + 2 * tq + e >= kend) s[nt][e] = LLMC_NEG_INF;
            mx = fmaxf(mx, s[nt][e]);
        }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);
    const float mu = mn == LLMC_NEG_INF ? 0.f : mn;
    const float alpha = exp2f(m - mu);
    m = mn;
    float p[2][2], psum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            p[nt][e] = exp2f(s[nt][e] - mu);
            psum += p[nt][e];
        }
    }
    l = l * alpha + psum;
    // O^T columns are heads 2t and 2t + 1: their factors live in lanes 8t and 8t + 4
    const float a_lo = __shfl_sync(0xffffffffu, alpha, 8 * tq);
    const float a_hi = __shfl_sync(0xffffffffu, alpha, 8 * tq + 4);
    const unsigned pb0 = pack_op<F16>(p[0][0], p[0][1]), pb1 = pack_op<F16>(p[1][0], p[1][1]);
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
        o[mt][0] *= a_lo;
        o[mt][1] *= a_hi;
        o[mt][2] *= a_lo;
        o[mt][3] *= a_hi;
        unsigned a[4];
        if constexpr (FP8) {
            // word mt / 2 of a key holds dims 4 (mt / 2) .. + 3: bytes 0, 1 for even mt
            const unsigned sel = (mt & 1) ? 0x7362u : 0x5140u;
            fp8x4_to_half2x2(__byte_perm(tl.v[0][mt >> 1], tl.v[1][mt >> 1], sel), a[0], a[1]);
            fp8x4_to_half2x2(__byte_perm(tl.v[2][mt >> 1], tl.v[3][mt >> 1], sel), a[2], a[3]);
        } else {
            a[0] = __byte_perm(tl.v[0][mt], tl.v[1][mt], 0x5410u);
            a[1] = __byte_perm(tl.v[0][mt], tl.v[1][mt], 0x7632u);
            a[2] = __byte_perm(tl.v[2][mt], tl.v[3][mt], 0x5410u);
            a[3] = __byte_perm(tl.v[2][mt], tl.v[3][mt], 0x7632u);
        }
        mma_16816<F16>(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
    }
}

// Tiles held in registers ahead of the one being computed, per cache element size.
template <typename cache_t>
__host__ __device__ constexpr int mma_stages() {
    return sizeof(cache_t) == 1 ? 3 : 2;
}

template <bool POW2, int NWARPS, typename cache_t, bool F16>
__device__ __forceinline__ void mma_keys(const cache_t* __restrict__ k_cache,
                                         const cache_t* __restrict__ v_cache,
                                         const int* __restrict__ bt, int block_size,
                                         int bs_shift, int kvh, int kbeg, int kend,
                                         const unsigned (&qa)[HD / 16][2], float& m, float& l,
                                         float (&o)[HD / 16][4]) {
    constexpr int S = mma_stages<cache_t>();
    constexpr int step = 16 * NWARPS;  // keys between a warp's consecutive tiles
    const int warp = threadIdx.x >> 5;
    MmaTile<cache_t> buf[S];
    int base = kbeg + 16 * warp;
#pragma unroll
    for (int st = 0; st < S; ++st)
        mma_load_tile<POW2>(buf[st], k_cache, v_cache, bt, block_size, bs_shift, kvh,
                            base + st * step, kend);
    while (base < kend) {
#pragma unroll
        for (int st = 0; st < S; ++st) {
            if (base < kend) {  // warp-uniform
                mma_tile<cache_t, F16>(buf[st], qa, base, kend, m, l, o);
                mma_load_tile<POW2>(buf[st], k_cache, v_cache, bt, block_size, bs_shift, kvh,
                                    base + S * step, kend);
            }
            base += step;
        }
    }
}

template <int NWARPS, typename cache_t>
__device__ __forceinline__ void attend_cta_mma(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ bt, int block_size,
    int bs_shift, int t, int kvh, float scale_log2, int kbeg, int kend,
    float (&sm_ml)[NWARPS][G][2], float (&sm_acc)[NWARPS][G][HD]) {
    constexpr bool F16 = sizeof(cache_t) == 1 || LLMC_DTYPE == 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    // A fragments of Q: row g (head g; zero rows past G), dims t HD/4 + 4 ks + {0,1}, {2,3}
    unsigned qa[HD / 16][2];
    {
        constexpr int n = HD / 4, dv = vec_width_for(n);
        float f[n];
        if (g8 < G) {
            const scalar_t* qr = q + ((long long)t * NQ + kvh * G + g8) * HD + tq * n;
#pragma unroll
            for (int d = 0; d < n; d += dv) load_vec<dv>(qr + d, f + d);
        } else {
#pragma unroll
            for (int d = 0; d < n; ++d) f[d] = 0.f;
        }
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
            qa[ks][0] = pack_op<F16>(f[4 * ks] * scale_log2, f[4 * ks + 1] * scale_log2);
            qa[ks][1] = pack_op<F16>(f[4 * ks + 2] * scale_log2, f[4 * ks + 3] * scale_log2);
        }
    }
    float m = LLMC_NEG_INF, l = 0.f, o[HD / 16][4];
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    if (bs_shift >= 0)
        mma_keys<true, NWARPS, cache_t, F16>(k_cache, v_cache, bt, block_size, bs_shift, kvh,
                                             kbeg, kend, qa, m, l, o);
    else
        mma_keys<false, NWARPS, cache_t, F16>(k_cache, v_cache, bt, block_size, bs_shift, kvh,
                                              kbeg, kend, qa, m, l, o);
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (tq == 0 && g8 < G) {
        sm_ml[warp][g8][0] = m;
        sm_ml[warp][g8][1] = l;
    }
    const int h0 = 2 * tq, h1 = 2 * tq + 1;
#pragma unroll
    for (int mt = 0; mt < HD / 16; ++mt) {
        const int d0 = g8 * (HD / 8) + 2 * mt;
        if (h0 < G) {
            sm_acc[warp][h0][d0] = o[mt][0];
            sm_acc[warp][h0][d0 + 1] = o[mt][2];
        }
        if (h1 < G) {
            sm_acc[warp][h1][d0] = o[mt][1];
            sm_acc[warp][h1][d0 + 1] = o[mt][3];
        }
    }
}

#endif  // MMA_DECODE_16 || MMA_DECODE_FP8
