// gemm_wo.cuh: the parts of the weight-only GEMMs (gemm_wo.cu: mma.sync, any sm_80+;
// gemm_wo_sm90.cu: wgmma, sm_90a) that do not depend on the tensor-core instruction:
// arguments, the grouped tile order, the cp.async staging of a k-tile (X rows and code
// rows), the dequantization of a code tile into the 16-bit W tile (wo_dequant.cuh's formula,
// rounded once) and the rounded-once output stores.
//
// Shared tiles are [rows][GW_BK = 64] 16-bit elements, in one of two layouts (SWZ):
//   false  row stride GW_LDS = 72 elements (144 bytes: the 8 rows of an ldmatrix phase fall
//          in distinct banks), 16-byte chunk c of row r at r * 144 + 16 c;
//   true   the wgmma 128-byte swizzle: row stride 128 bytes, chunk c of row r at
//          r * 128 + 16 (c ^ (r % 8)) (prefill_attention_sm90.cu's K-major tiles; base
//          1024-aligned).
// Code rows: [BN][GW_BK * BITS / 8] bytes, plain. The includer defines cp_async16(shared
// address, global pointer, bytes), cp_async_commit() and smem_addr(pointer) first.
#pragma once
#include "common.cuh"
#include "wo_dequant.cuh"

#define GW_THREADS 256
#define GW_BK 64
#define GW_LDS (GW_BK + 8)
#define GW_GROUP_M 8

struct GwArgs {
    const scalar_t* x;
    const unsigned char* codes;
    const void* scales;
    const void* offsets;
    const scalar_t* bias;
    void* out;
    int M, N, K, code_zero, gs, G, flags;
};

// Byte offset of 16-byte chunk c of row r in a shared tile.
template <bool SWZ>
__device__ __forceinline__ int gw_chunk(int r, int c) {
    return SWZ ? r * 128 + ((c ^ (r & 7)) << 4) : r * (GW_LDS * 2) + c * 16;
}

// This CTA's tile origin (m0, n0) in the grouped order: GW_GROUP_M M-tiles side by side per
// N-tile, so one N-tile's codes come from DRAM once and from L2 for the group's other tiles.
template <int BM, int BN>
__device__ __forceinline__ void gw_origin(const GwArgs& a, int& m0, int& n0) {
    const int tm = (a.M + BM - 1) / BM, tn = (a.N + BN - 1) / BN;
    const int pid = blockIdx.x, in_group = GW_GROUP_M * tn;
    const int first = (pid / in_group) * GW_GROUP_M, gsz = min(tm - first, GW_GROUP_M);
    m0 = (first + (pid % in_group) % gsz) * BM;
    n0 = ((pid % in_group) / gsz) * BN;
}

// The share of the cp.async staging of thread p of NT loading threads, computed once per CTA
// (gw_loader): X chunk i (i < BM * 8 / NT) is row m0 + p / 8 + (NT / 8) i, columns 8 (p % 8)
// .. + 7 of the k-tile; code chunk i (i < CI) is row n0 + p / CCH + (NT / CCH) i, 16 bytes at
// column (p % CCH) * KPC of the k-tile. Bit i of xok / cok: that row exists (and, for the
// codes, the chunk: BN * CCH may be below NT).
template <int BITS, int BM, int BN, int NT>
struct GwLoader {
    static constexpr int CB = GW_BK * BITS / 8, CCH = CB / 16, KPC = 128 / BITS;
    static constexpr int XI = BM * (GW_BK / 8) / NT, XR = NT / 8, CR = NT / CCH;
    static constexpr int CI = (BN * CCH + NT - 1) / NT;
    static_assert(BM * (GW_BK / 8) % NT == 0 && NT % CCH == 0, "whole X chunks per thread");
    const scalar_t* x;       // X chunk 0's first element in k-tile 0
    const unsigned char* c;  // code chunk 0's first byte in k-tile 0
    long long xstep, cstep;  // elements / bytes from chunk i to chunk i + 1
    int xk, ck;              // the chunks' first column within a k-tile
    unsigned xok, cok;
};

template <int BITS, int BM, int BN, int NT>
__device__ __forceinline__ GwLoader<BITS, BM, BN, NT> gw_loader(const GwArgs& a, int m0, int n0,
                                                                int p) {
    using L = GwLoader<BITS, BM, BN, NT>;
    L l;
    const int xr = p >> 3, cr = p / L::CCH;
    l.xk = (p & 7) * 8;
    l.ck = (p % L::CCH) * L::KPC;
    const long long rowbytes = (long long)a.K * BITS / 8;
    l.x = a.x + (long long)(m0 + xr) * a.K + l.xk;
    l.c = a.codes + (long long)(n0 + cr) * rowbytes + l.ck * BITS / 8;
    l.xstep = (long long)L::XR * a.K;
    l.cstep = (long long)L::CR * rowbytes;
    l.xok = l.cok = 0u;
#pragma unroll
    for (int i = 0; i < L::XI; ++i) l.xok |= (m0 + xr + L::XR * i < a.M ? 1u : 0u) << i;
#pragma unroll
    for (int i = 0; i < L::CI; ++i) {
        const bool chunk = p + i * NT < BN * L::CCH;
        l.cok |= (chunk && n0 + cr + L::CR * i < a.N ? 1u : 0u) << i;
    }
    return l;
}

// cp.async of k-tile kt by thread p of the loader: X rows [BM][GW_BK] into xd, code rows
// [BN][CB] into cd (zeros past M, N and K; K % 32 == 0, so a 16-byte chunk is all in or all
// out; a chunk's source is not read when it is out: size 0).
template <int BITS, int BM, int BN, bool SWZ, int NT>
__device__ __forceinline__ void gw_load(const GwArgs& a, const GwLoader<BITS, BM, BN, NT>& l,
                                        unsigned char* xd, unsigned char* cd, int kt, int p) {
    using L = GwLoader<BITS, BM, BN, NT>;
    const int k0 = kt * GW_BK;
    const bool xin = k0 + l.xk < a.K, cin = k0 + l.ck < a.K;
#pragma unroll
    for (int i = 0; i < L::XI; ++i) {
        const bool ok = xin && ((l.xok >> i) & 1u);
        const scalar_t* src = l.x + i * l.xstep + k0;
        cp_async16(smem_addr(xd + gw_chunk<SWZ>((p >> 3) + L::XR * i, p & 7)), src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < L::CI; ++i) {
        if (BN * L::CCH % NT != 0 && p + i * NT >= BN * L::CCH) break;
        const bool ok = cin && ((l.cok >> i) & 1u);
        const unsigned char* src = l.c + i * l.cstep + k0 * BITS / 8;
        const int r = p / L::CCH + L::CR * i;
        cp_async16(smem_addr(cd + r * L::CB + (p % L::CCH) * 16), src, ok ? 16 : 0);
    }
}

// One cp.async group: k-tile kt (when kt < KT) into slot kt % S of the X slots (xb bytes
// each) and code slots (cb bytes each); past KT an empty group keeps the count uniform.
template <int BITS, int BM, int BN, bool SWZ, int S>
__device__ __forceinline__ void gw_stage(const GwArgs& a, const GwLoader<BITS, BM, BN, GW_THREADS>& l,
                                         unsigned char* xsl, int xb, unsigned char* csl, int cb,
                                         int kt, int KT) {
    if (kt < KT) {
        const int sl = kt % S;
        gw_load<BITS, BM, BN, SWZ, GW_THREADS>(a, l, xsl + sl * xb, csl + sl * cb, kt, threadIdx.x);
    }
    cp_async_commit();
}

// The code tile cd of k-tile kt -> the 16-bit W tile ws [BN][GW_BK], in units of 8 columns
// of one group, by GW_THREADS threads: thread t (0 <= t < 256) takes the units of rows t / 8 + 32 i
// (i < GW_UPT(BN)), columns 8 (t % 8) .. + 7 — one code word (4-bit) or two (8-bit) from
// shared memory, one 16-byte shared store each. The unit's scale and offset come in a GwPre
// (gw_pre_load), loaded before the tile's turn so that their latency hides behind the
// previous tile's MMAs (gemm_wo_sm90.cu loads tile kt + 1's while tile kt is dequantized).
// flags & 4 (row-scaled: one group a row, no offsets, as int8_wo): the exact integers
// q - code_zero (|.| <= 255: exact in bf16 / f16), the row's scale applied to the float32
// sum in gw_store2 (fewer operations a weight, and no per-weight rounding).
// Past N and K the tile holds finite values that never count: the X columns past K are
// staged as zeros (gw_load) and the outputs of rows past N are never stored (gw_store2);
// gw_pre_load gives such units s = o = 0.
#define GW_UPT(BN) ((BN) * (GW_BK / 8) / GW_THREADS)

template <int BN>
struct GwPre {
    float s[GW_UPT(BN)], o[GW_UPT(BN)];
};

// The scale and offset (0 without offsets) of each of this thread's units of k-tile kt
// (0 past N and K; nothing for row-scaled layouts).
template <int BN>
__device__ __forceinline__ void gw_pre_load(const GwArgs& a, int n0, int kt, int t,
                                            GwPre<BN>& p) {
    static_assert(GW_UPT(BN) >= 1 && BN * (GW_BK / 8) % GW_THREADS == 0, "whole units");
    if ((a.flags & 4) != 0) return;
    const bool f32 = (a.flags & 1) != 0, has_o = a.offsets != nullptr;
    // group of column k: none (one group a row), a shift (power-of-two groups) or a division
    const int gsl = a.G == 1 ? 31 : (__popc(a.gs) == 1 ? __ffs(a.gs) - 1 : -1);
    const int k = kt * GW_BK + (t & 7) * 8;
    const int grp = gsl == 31 ? 0 : gsl >= 0 ? k >> gsl : k / a.gs;
#pragma unroll
    for (int i = 0; i < GW_UPT(BN); ++i) {
        const int n = n0 + (t >> 3) + 32 * i;
        const bool in = n < a.N && k < a.K;
        const long long gi = in ? (long long)n * a.G + grp : 0;
        p.s[i] = in ? wod_scale(a.scales, gi, f32) : 0.f;
        p.o[i] = in && has_o ? wod_scale(a.offsets, gi, f32) : 0.f;
    }
}

// f[e] = q - code_zero of columns c0 .. c0 + 7 of one code row, exact: each code placed in
// the low byte of the float 2^23 (one prmt; 4-bit codes first split into low and high
// nibbles, two ops a word) and 2^23 + code_zero subtracted (wod_ints8's identity).
template <int BITS>
__device__ __forceinline__ void gw_ints8(const unsigned char* row, int c0, float zq,
                                         float (&f)[8]) {
    constexpr unsigned int MAGIC = 0x4B000000u;  // bytes 4..7 of the prmt: 0, 0, 0, 0x4B
    if constexpr (BITS == 4) {
        const unsigned int w = *reinterpret_cast<const unsigned int*>(row + c0 / 2);
        const unsigned int lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const unsigned int b = __byte_perm(e & 1 ? hi : lo, MAGIC, 0x7540u + (e >> 1));
            f[e] = __fsub_rn(__uint_as_float(b), zq);
        }
    } else {
        const v2u w = *reinterpret_cast<const v2u*>(row + c0);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const unsigned int b = __byte_perm(e < 4 ? w.x : w.y, MAGIC, 0x7540u + (e & 3));
            f[e] = __fsub_rn(__uint_as_float(b), zq);
        }
    }
}

// The formula's forms, fixed per launch so the unit loop carries no branches:
enum GwForm {
    GW_INTS = 0,   // row-scaled: q - code_zero
    GW_SCALE = 1,  // no offsets: s * (q - z)
    GW_FMA = 2,    // f16 scales and offsets: s * (q - z) is exact in float32 (11 x 8 bits),
                   // so one fma rounds exactly where fmul then fadd would
    GW_MULADD = 3  // f32 scales and offsets: fmul, fadd (never contracted)
};

template <int BITS, int BN, bool SWZ, int FORM>
__device__ __forceinline__ void gw_dequant_units(const GwArgs& a, const unsigned char* cd,
                                                 unsigned char* ws, int t, const GwPre<BN>& p) {
    constexpr int CB = GW_BK * BITS / 8;
    const float zq = 8388608.f + (float)a.code_zero;
    const int c0 = (t & 7) * 8;
#pragma unroll
    for (int i = 0; i < GW_UPT(BN); ++i) {
        const int r = (t >> 3) + 32 * i;
        float f[8];
        gw_ints8<BITS>(cd + r * CB, c0, zq, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if constexpr (FORM == GW_SCALE) f[e] = __fmul_rn(p.s[i], f[e]);
            if constexpr (FORM == GW_FMA) f[e] = fmaf(p.s[i], f[e], p.o[i]);
            if constexpr (FORM == GW_MULADD) f[e] = __fadd_rn(__fmul_rn(p.s[i], f[e]), p.o[i]);
        }
        store_vec<8>(reinterpret_cast<scalar_t*>(ws + gw_chunk<SWZ>(r, t & 7)), f);
    }
}

template <int BITS, int BN, bool SWZ>
__device__ __forceinline__ void gw_dequant(const GwArgs& a, const unsigned char* cd,
                                           unsigned char* ws, int t, const GwPre<BN>& p) {
    if ((a.flags & 4) != 0) {
        gw_dequant_units<BITS, BN, SWZ, GW_INTS>(a, cd, ws, t, p);
    } else if (a.offsets == nullptr) {
        gw_dequant_units<BITS, BN, SWZ, GW_SCALE>(a, cd, ws, t, p);
    } else if ((a.flags & 1) == 0) {
        gw_dequant_units<BITS, BN, SWZ, GW_FMA>(a, cd, ws, t, p);
    } else {
        gw_dequant_units<BITS, BN, SWZ, GW_MULADD>(a, cd, ws, t, p);
    }
}

// out[m, n], out[m, n + 1] = the sums c0, c1 (times the row's scale when row-scaled,
// flags & 4) (+ bias), rounded once into the activation dtype (flags & 2: float32 out,
// holding the rounded values); columns past N skipped.
// ROW_SCALE false: the kernel never runs row-scaled (gemm_wo_sm90.cu: an FMUL on the
// accumulators' registers makes ptxas serialize the wgmma pipeline, C7515).
template <bool ROW_SCALE>
__device__ __forceinline__ void gw_store2(const GwArgs& a, int m, int n, float c0, float c1) {
    if (m >= a.M || n >= a.N) return;
    float v[2] = {c0, c1};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const bool in = n + e < a.N;
        if (ROW_SCALE && (a.flags & 4) != 0 && in)
            v[e] = __fmul_rn(v[e], wod_scale(a.scales, n + e, (a.flags & 1) != 0));
        const float b = a.bias != nullptr && in ? to_float(a.bias[n + e]) : 0.f;
        v[e] = to_float(from_float(v[e] + b));
    }
    const long long o = (long long)m * a.N + n;
    const bool pair = n + 1 < a.N && (o & 1) == 0;
    if ((a.flags & 2) != 0) {
        float* dst = static_cast<float*>(a.out) + o;
        if (pair) {
            *reinterpret_cast<v2u*>(dst) = v2u{__float_as_uint(v[0]), __float_as_uint(v[1])};
        } else {
            dst[0] = v[0];
            if (n + 1 < a.N) dst[1] = v[1];
        }
    } else {
        scalar_t* dst = static_cast<scalar_t*>(a.out) + o;
        if (pair) {
            *reinterpret_cast<unsigned int*>(dst) = pack2(v[0], v[1]);
        } else {
            dst[0] = from_float(v[0]);
            if (n + 1 < a.N) dst[1] = from_float(v[1]);
        }
    }
}

#define GW_PARAMS                                                                                 \
    const scalar_t *__restrict__ x, const unsigned char *__restrict__ codes,                      \
        const void *__restrict__ scales, const void *__restrict__ offsets,                        \
        const scalar_t *__restrict__ bias, void *__restrict__ out, int M, int N, int K,           \
        int code_zero, int gs, int G, int flags
#define GW_ARGS GwArgs{x, codes, scales, offsets, bias, out, M, N, K, code_zero, gs, G, flags}
