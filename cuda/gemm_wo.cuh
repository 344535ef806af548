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

// cp.async of k-tile kt: X rows [BM][GW_BK] into xd, code rows [BN][CB] into cd (zeros past
// M, N and K; K % 32 == 0, so a 16-byte chunk is all in or all out).
template <int BITS, int BM, int BN, bool SWZ>
__device__ __forceinline__ void gw_load(const GwArgs& a, unsigned char* xd, unsigned char* cd,
                                        int m0, int n0, int kt) {
    constexpr int CB = GW_BK * BITS / 8, CCH = CB / 16, KPC = 128 / BITS;
    constexpr int XC = BM * (GW_BK / 8), CC = BN * CCH;  // 16-byte chunks of X and codes
    const int k0 = kt * GW_BK;
#pragma unroll
    for (int i = 0; i < (XC + GW_THREADS - 1) / GW_THREADS; ++i) {
        const int c = threadIdx.x + i * GW_THREADS;
        if (XC % GW_THREADS != 0 && c >= XC) break;
        const int r = c >> 3, k = k0 + (c & 7) * 8;
        const bool ok = m0 + r < a.M && k < a.K;
        const scalar_t* src = ok ? a.x + (long long)(m0 + r) * a.K + k : a.x;
        cp_async16(smem_addr(xd + gw_chunk<SWZ>(r, c & 7)), src, ok ? 16 : 0);
    }
    const long long rowbytes = (long long)a.K * BITS / 8;
#pragma unroll
    for (int i = 0; i < (CC + GW_THREADS - 1) / GW_THREADS; ++i) {
        const int c = threadIdx.x + i * GW_THREADS;
        if (CC % GW_THREADS != 0 && c >= CC) break;
        const int r = c / CCH, ch = c % CCH, k = k0 + ch * KPC;
        const bool ok = n0 + r < a.N && k < a.K;
        const unsigned char* src = ok ? a.codes + (n0 + r) * rowbytes + k * BITS / 8 : a.codes;
        cp_async16(smem_addr(cd + r * CB + ch * 16), src, ok ? 16 : 0);
    }
}

// One cp.async group: k-tile kt (when kt < KT) into slot kt % S of the X slots (xb bytes
// each) and code slots (cb bytes each); past KT an empty group keeps the count uniform.
template <int BITS, int BM, int BN, bool SWZ, int S>
__device__ __forceinline__ void gw_stage(const GwArgs& a, unsigned char* xsl, int xb,
                                         unsigned char* csl, int cb, int m0, int n0, int kt,
                                         int KT) {
    if (kt < KT) {
        const int sl = kt % S;
        gw_load<BITS, BM, BN, SWZ>(a, xsl + sl * xb, csl + sl * cb, m0, n0, kt);
    }
    cp_async_commit();
}

// The code tile cd of k-tile kt -> the 16-bit W tile ws [BN][GW_BK] (zeros past N and K):
// units of 8 columns of one group, one scale / offset load and one 16-byte store each.
// flags & 4 (row-scaled: one group a row, no offsets, as int8_wo): the exact integers
// q - code_zero (|.| <= 255: exact in bf16 / f16), the row's scale applied to the float32
// sum in gw_store2 (fewer operations a weight, and no per-weight rounding).
template <int BITS, int BN, bool SWZ>
__device__ __forceinline__ void gw_dequant(const GwArgs& a, const unsigned char* cd,
                                           unsigned char* ws, int n0, int kt) {
    constexpr int CB = GW_BK * BITS / 8;
    const bool f32 = (a.flags & 1) != 0, has_o = a.offsets != nullptr;
    const bool row_scaled = (a.flags & 4) != 0;
    // group of column k: none (one group a row), a shift (power-of-two groups) or a division
    const int gsl = a.G == 1 ? 31 : (__popc(a.gs) == 1 ? __ffs(a.gs) - 1 : -1);
    constexpr int U = BN * (GW_BK / 8);  // units of 8 columns
    static_assert(U % GW_THREADS == 0, "whole units per thread");
#pragma unroll 2
    for (int i = 0; i < U / GW_THREADS; ++i) {
        const int u = threadIdx.x + i * GW_THREADS;
        const int r = u >> 3, c0 = (u & 7) * 8, n = n0 + r, k = kt * GW_BK + c0;
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (n < a.N && k < a.K && row_scaled) {  // the integers; the scale in the epilogue
            unsigned int q[8];
            wod_codes8(cd + r * CB, c0, BITS, q);
            wod_ints8(q, a.code_zero, f);
        } else if (n < a.N && k < a.K) {
            const int grp = gsl == 31 ? 0 : gsl >= 0 ? k >> gsl : k / a.gs;
            const long long gi = (long long)n * a.G + grp;
            const float s = wod_scale(a.scales, gi, f32);
            const float o = has_o ? wod_scale(a.offsets, gi, f32) : 0.f;
            unsigned int q[8];
            wod_codes8(cd + r * CB, c0, BITS, q);
            wod_values8(q, s, o, has_o, a.code_zero, f);
        }
        store_vec<8>(reinterpret_cast<scalar_t*>(ws + gw_chunk<SWZ>(r, u & 7)), f);
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
