// gemv_fp8.cu: fused small-batch (M = 1..8 token rows) decode GEMVs on FP8 weights (W8A8),
// memory-bound on the weights (e4m3, one byte each, [rows, K] row-major).
//
// Three kernels, each instantiated for M = 1..8 (extern "C" names end in _m1 .. _m8):
//   gemv8_norm_mM       out[m, n] = round(acc[m, n] * xs[m] * ws[n] (+ bias[n]))        (qkv)
//   gemv8_norm_silu_mM  W = [2I, K] gate | up: act[m, j] = round(round(silu(round(g))) *
//                       round(u)), g / u = the rows j / I + j as above (no bias)   (gate_up)
//   gemv8_add_mM        residual[m, n] = round(residual[m, n] + round(acc * xs * ws))
//                                                                            (o_proj, down)
// acc[m, n] = sum_k qx[m, k] * qw[n, k] over e4m3 codes (exact products, float32 sums);
// qx, xs = the per-row dynamic e4m3 quantization of the kernel's input, done in the
// prologue (amax floored at 1e-12, inv = 448 / amax, sat + RNE, xs = amax / 448): of
// round(x * rsqrt(mean(x^2) + eps) * norm_w) for the norm kernels, of x for gemv8_add.
// These are the compositions of llmc.cuda.reference_fp8 (norm_linear_fp8,
// norm_gate_up_silu_fp8, linear_residual_add_fp8); only the order of the float32 sums differs.
//
// Dot products on tensor cores: mma.m16n8k16 f16 x f16 -> f32 (sm_90 has no fp8 mma.sync;
// ptxas lowers the e4m3 one to exactly this); e4m3 -> f16 is exact, so are the products.
// A *tile* is 16 weight rows (gate_up: gate rows j0..j0+7 and up rows I+j0..I+j0+7), a
// k-step 64 columns, the 8 token rows the mma's n (rows m >= M read as zeros). Lane
// (g = lane / 4, t = lane % 4) loads columns 64 ks + 16 t .. +15 of tile rows g and g + 8
// (16-byte ld.global.nc.L1::no_allocate) and of token g's codes (16-byte LDS) and feeds
// them to four mmas as they lie in the registers: the sum over k does not care which column
// takes which mma slot, as long as weights and activations agree. Accumulator rows g / g + 8
// are tile rows g / g + 8, so gate and up of one output end in the same lane (no shuffle).
// Conversions per k-step and lane: row g and the activations by cvt.rn.f16x2.e4m3x2 (16),
// row g + 8 on the integer pipe (4 ops per f16x2, values times 2^-8, scaled back in the
// epilogue): Hopper's conversion pipe is slow; the two pipes run side by side.
//
// Work: tiles go round-robin over the CTAs (grid <= SMs, <= tiles; 512 threads = 16 warps,
// one CTA per SM). A CTA takes its tiles 16 at a time (a round); with c < 16 tiles in a
// round, 16 / c warps share each tile, each over a contiguous share of the k-steps, and add
// their sums through shared memory. A warp streams its share in batches of G8_U k-steps
// (8 weight loads in flight per lane), double-buffered in registers: the next batch is
// loaded before the current one is multiplied. The first batch is loaded, and the next two
// prefetched into L2, before the prologue, so the weight stream starts while the
// activations are being quantized.
//
// Prologue (every CTA, all 512 threads): rms scale per row (norm kernels), amax of the
// values to quantize, their e4m3 codes into shared memory at row stride S (from the host:
// K rounded up to 128, + 64, so the token rows of one LDS phase fall in different banks),
// zero-padded to whole k-steps. The *_scalar kernels (K % 16 != 0 or a misaligned base)
// load weights by bytes and x by elements: correct, slow.
//
// Launch: grid min(SMs, tiles), block 512, dynamic smem M * S bytes (the host runs the
// unfused ops when that exceeds its budget). Needs sm_89+ (e4m3 cvt); below, the kernels
// trap (FP8 engines are refused there before they run). A programmatic dependent launch
// when CudaBackend.pdl (cuda/pdl.cuh): the first batch's loads and the L2 prefetch come
// before pdl_wait(), the prologue (x) and every store after it.
//
// History: v1 (this; not yet measured on the H200).
#include "common.cuh"
#include "gemv_skeleton.cuh"
#include "pdl.cuh"

#define G8_THREADS 512
#define G8_WARPS GEMV_WARPS
#define G8_U 4  // k-steps (64 columns) per batch: 2 rows x 4 = 8 16-byte loads per lane

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define G8_NATIVE 0
#else
#define G8_NATIVE 1
#endif

struct G8Args {
    const scalar_t* x;       // [M, K]: residual (norm kernels) or activation (add kernel)
    const scalar_t* norm_w;  // [K] (norm kernels)
    float eps;
    const unsigned char* w;  // [rows, K] e4m3
    const float* w_scale;    // [rows]
    const scalar_t* bias;    // [N] or nullptr
    scalar_t* out;           // [M, N] out, [M, I] act, or the residual [M, N] (add)
    int n_out, K, S;         // N (I for gate_up), K, shared-memory row stride of the codes
};

// One 16-byte weight vector, streamed (not kept in L1).
__device__ __forceinline__ v4u ld_stream(const unsigned char* p) {
    v4u r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ void g8_prefetch_l2(const unsigned char* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Two e4m3 codes (low byte first) -> f16x2 (low half first), exact.
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2(unsigned short v) {
    unsigned int r = 0u;
#if G8_NATIVE
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
#else
    __trap();
#endif
    return r;
}

// Two floats -> two e4m3 codes (lo in the low byte): saturated to +-448, round to nearest
// even (__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3)).
__device__ __forceinline__ unsigned short f32x2_to_e4m3x2(float lo, float hi) {
    unsigned short r = 0;
#if G8_NATIVE
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#else
    __trap();
#endif
    return r;
}

// Four e4m3 codes (one word, byte i = element i) -> two f16x2 words holding the values times
// 2^-8, exactly, on the integer pipe: the e4m3 pattern s.eeee.mmm becomes the f16 pattern
// s.0eeee.mmm0000000 (e4m3 subnormals become f16 subnormals).
__device__ __forceinline__ void e4m3x4_to_f16x2_scaled(unsigned int x, unsigned int& lo,
                                                       unsigned int& hi) {
    const unsigned int a = __byte_perm(x, 0u, 0x1404), b = __byte_perm(x, 0u, 0x3424);
    lo = ((a >> 1) & 0x3fff3fffu) | (a & 0x80008000u);
    hi = ((b >> 1) & 0x3fff3fffu) | (b & 0x80008000u);
}

// d += A (16 x 16, row-major fragments) * B (16 x 8, column fragments), float32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned int (&a)[4],
                                        const unsigned int (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One k-step of one lane: wlo / whi = its 16 columns of tile rows g / g + 8, xv the same
// columns of token g. Word j of each feeds mma j (columns 4j .. 4j + 3 of the lane's 16).
__device__ __forceinline__ void kstep_mma(float (&acc)[4], const v4u& wlo, const v4u& whi,
                                          const v4u& xv) {
    const unsigned int wl[4] = {wlo.x, wlo.y, wlo.z, wlo.w};
    const unsigned int wh[4] = {whi.x, whi.y, whi.z, whi.w};
    const unsigned int xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        unsigned int a[4], b[2];
        a[0] = e4m3x2_to_f16x2((unsigned short)(wl[j] & 0xffffu));
        a[2] = e4m3x2_to_f16x2((unsigned short)(wl[j] >> 16));
        e4m3x4_to_f16x2_scaled(wh[j], a[1], a[3]);
        b[0] = e4m3x2_to_f16x2((unsigned short)(xw[j] & 0xffffu));
        b[1] = e4m3x2_to_f16x2((unsigned short)(xw[j] >> 16));
        mma_f16(acc, a, b);
    }
}

// 16 weight bytes at column k of a row (zeros past K).
template <bool VECTOR>
__device__ __forceinline__ v4u load_w16(const unsigned char* p, int k, int K) {
    if constexpr (VECTOR) {
        if (k < K) return ld_stream(p);  // K % 16 == 0: all 16 columns or none
        return v4u{0u, 0u, 0u, 0u};
    } else {
        unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            if (k + e < K) w[e >> 2] |= (unsigned int)p[e] << (8 * (e & 3));
        }
        return v4u{w[0], w[1], w[2], w[3]};
    }
}

// The work split (tiles, rounds, split-K): cuda/gemv_skeleton.cuh.

// Batch of n (<= G8_U) k-steps from k-step kb: rows g, g + 8 of the lane's columns.
template <bool VECTOR>
__device__ __forceinline__ void load_batch(v4u (&r)[G8_U][2], const unsigned char* w0,
                                           const unsigned char* w1, int kb, int n, int t4,
                                           int K) {
#pragma unroll
    for (int u = 0; u < G8_U; ++u) {
        const int k = (kb + u) * 64 + 16 * t4;  // w0, w1 already point at column 16 * t4
        if (u < n) {
            r[u][0] = load_w16<VECTOR>(w0 + (kb + u) * 64, k, K);
            r[u][1] = load_w16<VECTOR>(w1 + (kb + u) * 64, k, K);
        } else {
            r[u][0] = r[u][1] = v4u{0u, 0u, 0u, 0u};
        }
    }
}

__device__ __forceinline__ void mma_batch(float (&acc)[4], const v4u (&r)[G8_U][2],
                                          const unsigned char* xrow, bool has_row, int kb,
                                          int n) {
#pragma unroll
    for (int u = 0; u < G8_U; ++u) {
        if (u < n) {  // warp-uniform: the mma runs converged
            v4u xv = v4u{0u, 0u, 0u, 0u};
            if (has_row) xv = *reinterpret_cast<const v4u*>(xrow + (kb + u) * 64);
            kstep_mma(acc, r[u][0], r[u][1], xv);
        }
    }
}

// The warp's k-steps [s0, s1) (s0 < s1), batch A already loaded when `preloaded`.
template <bool VECTOR>
__device__ __forceinline__ void stream_tile(float (&acc)[4], v4u (&A)[G8_U][2],
                                            v4u (&B)[G8_U][2], const unsigned char* w0,
                                            const unsigned char* w1, const unsigned char* xrow,
                                            bool has_row, int s0, int s1, bool preloaded,
                                            int t4, int K) {
    int kb = s0;
    if (!preloaded) load_batch<VECTOR>(A, w0, w1, kb, min(G8_U, s1 - kb), t4, K);
    while (true) {  // two batches per trip: A and B swap roles without register moves
        int next = min(G8_U, s1 - kb - G8_U);  // k-steps of the batch after (<= 0: none)
        if (next > 0) load_batch<VECTOR>(B, w0, w1, kb + G8_U, next, t4, K);
        mma_batch(acc, A, xrow, has_row, kb, min(G8_U, s1 - kb));
        kb += G8_U;
        if (kb >= s1) break;
        next = min(G8_U, s1 - kb - G8_U);
        if (next > 0) load_batch<VECTOR>(A, w0, w1, kb + G8_U, next, t4, K);
        mma_batch(acc, B, xrow, has_row, kb, min(G8_U, s1 - kb));
        kb += G8_U;
        if (kb >= s1) break;
    }
}

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

// Quantize the M rows into xq (codes) and xscale (xs per row); ends with a barrier.
template <int M, int MODE, int VW>
__device__ __forceinline__ void g8_prologue(const G8Args& a, unsigned char* xq, float* xscale,
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

__device__ __forceinline__ float g8_silu(float g) { return g / (1.f + expf(-g)); }

// Outputs of one tile from a lane's accumulator: acc[0..1] = row g, tokens 2 t4 and
// 2 t4 + 1; acc[2..3] = row g + 8 (times 2^-8: its weights took the integer conversion).
template <int M, int MODE>
__device__ __forceinline__ void g8_store(const G8Args& a, const float (&acc)[4], int tile,
                                         const float* xscale, int g, int t4) {
    const int n_out = a.n_out;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int m = 2 * t4 + e;
        if (m >= M) continue;
        const float xs = xscale[m], lo = acc[e], hi = acc[2 + e] * 256.f;
        if constexpr (MODE == 1) {
            const int j = tile * 8 + g;
            if (j >= n_out) continue;
            const float gv = to_float(from_float(__fmul_rn(__fmul_rn(lo, xs), a.w_scale[j])));
            const float uv =
                to_float(from_float(__fmul_rn(__fmul_rn(hi, xs), a.w_scale[n_out + j])));
            a.out[(long long)m * n_out + j] = from_float(to_float(from_float(g8_silu(gv))) * uv);
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = tile * 16 + 8 * h + g;
                if (n >= n_out) continue;
                float y = __fmul_rn(__fmul_rn(h ? hi : lo, xs), a.w_scale[n]);
                scalar_t* o = a.out + (long long)m * n_out + n;
                if constexpr (MODE == 0) {
                    if (a.bias != nullptr) y += to_float(a.bias[n]);
                    *o = from_float(y);
                } else {
                    *o = from_float(to_float(*o) + to_float(from_float(y)));
                }
            }
        }
    }
}

template <int M, int MODE, bool VECTOR>
__device__ __forceinline__ void gemv8_body(const G8Args& a) {
    constexpr int VW = VECTOR ? VEC : 1;  // activation elements per prologue load
    extern __shared__ v4u g8_smem[];
    unsigned char* xq = reinterpret_cast<unsigned char*>(g8_smem);
    __shared__ float part[G8_WARPS][4][32];  // split-K partial sums [warp][value][lane]
    __shared__ float red[G8_WARPS][M];
    __shared__ float tot[M];
    __shared__ float xscale[M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    const int K = a.K, n_out = a.n_out;
    const int tiles = MODE == 1 ? (n_out + 7) / 8 : (n_out + 15) / 16;
    const int ksteps = (K + 63) / 64;
    pdl_trigger();  // the next kernel may launch (llmc.cuda.pdl_launch)
    const int c = gemv_cta_tiles(tiles);
    if (c <= 0) {  // the host keeps grid <= tiles; CTA-uniform
        pdl_wait();
        return;
    }
    const unsigned char* xrow = xq + g * a.S + 16 * t4;

    v4u A[G8_U][2], B[G8_U][2];
    GemvWork w = gemv_work(0, c, ksteps, warp);
    const unsigned char* w0 =
        a.w + (long long)gemv_tile_row<MODE>(w.tile, g, n_out) * K + 16 * t4;
    const unsigned char* w1 =
        a.w + (long long)gemv_tile_row<MODE>(w.tile, g + 8, n_out) * K + 16 * t4;
    if (w.active && w.s0 < w.s1) {  // start the weight stream before the prologue
        load_batch<VECTOR>(A, w0, w1, w.s0, min(G8_U, w.s1 - w.s0), t4, K);
        const unsigned char* rp =
            a.w + (long long)gemv_tile_row<MODE>(w.tile, lane & 15, n_out) * K;
        const int beg = 64 * (w.s0 + G8_U), end = min(min(64 * w.s1, K), beg + 64 * 2 * G8_U);
        for (int off = beg + 128 * (lane >> 4); off < end; off += 256) g8_prefetch_l2(rp + off);
    }
    pdl_wait();  // x and the outputs: the previous kernel's (the weights were not)
    g8_prologue<M, MODE, VW>(a, xq, xscale, red, tot);

    for (int r = 0; r * G8_WARPS < c; ++r) {
        if (r > 0) {
            w = gemv_work(r, c, ksteps, warp);
            w0 = a.w + (long long)gemv_tile_row<MODE>(w.tile, g, n_out) * K + 16 * t4;
            w1 = a.w + (long long)gemv_tile_row<MODE>(w.tile, g + 8, n_out) * K + 16 * t4;
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (w.active && w.s0 < w.s1) {
            stream_tile<VECTOR>(acc, A, B, w0, w1, xrow, g < M, w.s0, w.s1, r == 0, t4, K);
        }
        gemv_split_add(acc, part, w, warp, lane);  // the other warps' shares
        if (w.active && w.part == 0) g8_store<M, MODE>(a, acc, w.tile, xscale, g, t4);
        gemv_split_done(w);
    }
}

// Kernels of one M; SUFFIX "" = 16-byte vectors, _scalar = byte loads.
#define G8_KERNELS(M, VECTOR, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(G8_THREADS, 1) gemv8_norm_m##M##SUFFIX(      \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ norm_w, float eps,        \
        const unsigned char* __restrict__ w, const float* __restrict__ w_scale,                \
        const scalar_t* __restrict__ bias, scalar_t* __restrict__ out, int N, int K, int S) {  \
        gemv8_body<M, 0, VECTOR>(G8Args{x, norm_w, eps, w, w_scale, bias, out, N, K, S});      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(G8_THREADS, 1) gemv8_norm_silu_m##M##SUFFIX( \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ norm_w, float eps,        \
        const unsigned char* __restrict__ w, const float* __restrict__ w_scale,                \
        scalar_t* __restrict__ out, int I, int K, int S) {                                     \
        gemv8_body<M, 1, VECTOR>(G8Args{x, norm_w, eps, w, w_scale, nullptr, out, I, K, S});   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(G8_THREADS, 1) gemv8_add_m##M##SUFFIX(       \
        const scalar_t* __restrict__ x, const unsigned char* __restrict__ w,                   \
        const float* __restrict__ w_scale, scalar_t* __restrict__ residual, int N, int K,      \
        int S) {                                                                               \
        gemv8_body<M, 2, VECTOR>(                                                              \
            G8Args{x, nullptr, 0.f, w, w_scale, nullptr, residual, N, K, S});                  \
    }

#define G8_INSTANTIATE(M) G8_KERNELS(M, true, ) G8_KERNELS(M, false, _scalar)

G8_INSTANTIATE(1)
G8_INSTANTIATE(2)
G8_INSTANTIATE(3)
G8_INSTANTIATE(4)
G8_INSTANTIATE(5)
G8_INSTANTIATE(6)
G8_INSTANTIATE(7)
G8_INSTANTIATE(8)
