// wo_codes.cuh: the code side of cuda/gemv_wo.cu (its header comment has the design):
// launch constants, kernel arguments, the PTX helpers (host stand-ins under
// LLMC_HOST_EMULATION), the staged-activation layout, the 4-bit / 8-bit unpacking into mma
// operands, the work split, and one k-step of a lane's two code vectors (scales applied per
// the scale mode).
#pragma once
#include "common.cuh"
#include "gemv_skeleton.cuh"

#define WO_THREADS 512
#define WO_WARPS GEMV_WARPS

#define WO_ROW 0
#define WO_KSTEP 1
#define WO_DEQ 2
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

// ---- PTX helpers (host stand-ins under LLMC_HOST_EMULATION) ---------------------------
__device__ __forceinline__ v4u wo_ld16(const unsigned char* p) {
    v4u r;
#ifdef LLMC_HOST_EMULATION
    r = *reinterpret_cast<const v4u*>(p);
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
#endif
    return r;
}

// One raw scale / offset (f32 bits, or f16 bits in the low half).
__device__ __forceinline__ unsigned int wo_ld_scale(const unsigned char* row, int gi, bool f32) {
#ifdef LLMC_HOST_EMULATION
    if (f32) return *reinterpret_cast<const unsigned int*>(row + 4 * (long long)gi);
    return *reinterpret_cast<const unsigned short*>(row + 2 * (long long)gi);
#else
    unsigned int r;
    if (f32) {
        asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(r) : "l"(row + 4 * (long long)gi));
    } else {
        unsigned short h;
        asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(h) : "l"(row + 2 * (long long)gi));
        r = h;
    }
    return r;
#endif
}

__device__ __forceinline__ void wo_prefetch(const unsigned char* p) {
#ifdef LLMC_HOST_EMULATION
    (void)p;
#else
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

__device__ __forceinline__ float wo_h2f(unsigned int h) {
#ifdef LLMC_HOST_EMULATION
    return emu_half_to_float((unsigned short)h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#endif
}

__device__ __forceinline__ float wo_scale(unsigned int raw, bool f32) {
    return f32 ? __uint_as_float(raw) : wo_h2f(raw);
}

// d = a * b + c on two 16-bit values of the activation dtype, rounded once each.
__device__ __forceinline__ unsigned int wo_fma2(unsigned int a, unsigned int b, unsigned int c) {
#ifdef LLMC_HOST_EMULATION
    auto lo = [](unsigned int v) { return to_float((unsigned short)(v & 0xffffu)); };
    auto hi = [](unsigned int v) { return to_float((unsigned short)(v >> 16)); };
    const double l = (double)lo(a) * lo(b) + lo(c), h = (double)hi(a) * hi(b) + hi(c);
    return pack2((float)l, (float)h);
#else
    unsigned int d;
#if LLMC_DTYPE == 1
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
    return d;
#endif
}

// d += A (16 x 16) * B (16 x 8), float32 accumulation, operands in the activation dtype.
__device__ __forceinline__ void wo_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                       unsigned int b1) {
#ifdef LLMC_HOST_EMULATION
    mma16816(d, a, b0, b1);
#else
#if LLMC_DTYPE == 1
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
#endif
}

// The same mma on f16 operands whatever the build's dtype (the biased 8-bit codes).
__device__ __forceinline__ void wo_mma_h(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                         unsigned int b1) {
#ifdef LLMC_HOST_EMULATION
    emu_mma16816(d, a, b0, b1, 0);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// float -> f16 bits (round to nearest even), whatever the build's dtype.
__device__ __forceinline__ unsigned short wo_f2h(float f) {
#ifdef LLMC_HOST_EMULATION
    return emu_float_to_half(f);
#else
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#endif
}

// ---- layout ---------------------------------------------------------------------------
template <int BITS>
__host__ __device__ constexpr int wo_vb() {  // columns per 16-byte code vector
    return BITS == 4 ? 32 : 16;
}
template <int BITS>
__host__ __device__ constexpr int wo_ks() {  // columns per k-step (4 lanes x VB)
    return 4 * wo_vb<BITS>();
}

// 8-bit codes of the row / kstep modes are unpacked biased: one prmt a pair makes the f16
// values 1024 + q (bf16 has no exact 8-bit magic), so their mmas run on f16 operands and the
// activations are staged as f16 (exact for |x| < 65504; gemv_wo.cu's prologue scales the
// staged rows by a power of two where a value is larger). (magic + code_zero) times the
// activation sums comes off the mma sums, as for the 4-bit kstep mode.
template <int BITS, int SMODE>
__host__ __device__ constexpr bool wo_biased8() {
    return BITS == 8 && SMODE != WO_DEQ;
}

// Whether the staged activations are f16 (else the build's 16-bit dtype).
template <int BITS, int SMODE>
__host__ __device__ constexpr bool wo_x16() {
    return LLMC_DTYPE == 1 || wo_biased8<BITS, SMODE>();
}

// Byte offset of column c in a staged activation row (the pair order of the header).
template <int BITS>
__device__ __forceinline__ int wo_xoff(int c) {
    constexpr int KS = wo_ks<BITS>();
    const int ks = c / KS, r = c - ks * KS;
    if constexpr (BITS == 4) {  // [ks][word w][lane t][pair j][half]: 256 bytes per k-step
        const int t = r >> 5, w = (r >> 3) & 3, e = r & 7;
        return ks * 256 + w * 64 + t * 16 + (e & 3) * 4 + (e >> 2) * 2;
    } else {  // [ks][q][lane t][8 natural columns]: 128 bytes per k-step
        const int t = r >> 4, q = (r >> 3) & 1, e = r & 7;
        return ks * 128 + q * 64 + t * 16 + e * 2;
    }
}

// Constants of the code unpacking (16-bit pairs of the activation dtype).
struct WoConst {
    unsigned int one, nz;    // 1.0 | 1.0, -(magic + code_zero) twice
    unsigned int sixteenth, nz16;  // f16 4-bit odd pairs: 1/16 twice, -(64 + code_zero) twice
    unsigned int magic2;     // 4-bit: the magic exponent twice (0x4300 bf16, 0x6400 f16)
    float fz;                // 8-bit: 2^23 + code_zero
    float mz;                // 4-bit kstep: magic + code_zero (the bias of the biased codes)
    float mz8;               // biased 8-bit codes: 1024 + code_zero
};

__device__ __forceinline__ WoConst wo_const(int code_zero) {
    WoConst c;
    c.one = pack2(1.f, 1.f);
#if LLMC_DTYPE == 1
    const float magic = 1024.f;
#else
    const float magic = 128.f;
#endif
    const float nz = -(magic + (float)code_zero);
    c.nz = pack2(nz, nz);
    c.sixteenth = pack2(0.0625f, 0.0625f);
    const float nz16 = -(64.f + (float)code_zero);
    c.nz16 = pack2(nz16, nz16);
    c.fz = 8388608.f + (float)code_zero;
#if LLMC_DTYPE == 1
    c.magic2 = 0x64006400u;
#else
    c.magic2 = 0x43004300u;
#endif
    c.mz = magic + (float)code_zero;
    c.mz8 = 1024.f + (float)code_zero;
    return c;
}

// (a & m) | c in one lop3 (the compiler splits the two immediates into two ops).
__device__ __forceinline__ unsigned int wo_and_or(unsigned int a, unsigned int m, unsigned int c) {
#ifdef LLMC_HOST_EMULATION
    return (a & m) | c;
#else
    unsigned int d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(m), "r"(c));
    return d;
#endif
}

// 4-bit code word -> the pairs (j, j + 4) of magic + q, j = 0..3 (exact: 128 + q in bf16,
// 1024 + q in f16): one shift and one lop3 a pair, no subtraction. The kstep mode takes
// (magic + code_zero) times the k-step's activation sum off the mma sums instead.
__device__ __forceinline__ void wo_unpack4_biased(unsigned int wd, const WoConst& k,
                                                  unsigned int (&p)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = wo_and_or(wd >> (4 * j), 0x000f000fu, k.magic2);
}

// 4-bit code word -> the pairs (j, j + 4) of q - code_zero, j = 0..3 (exact).
__device__ __forceinline__ void wo_unpack4(unsigned int wd, const WoConst& k, unsigned int (&p)[4]) {
#if LLMC_DTYPE == 1
    const unsigned int w8 = wd >> 8;
    p[0] = wo_fma2((wd & 0x000f000fu) | 0x64006400u, k.one, k.nz);
    p[1] = wo_fma2((wd & 0x00f000f0u) | 0x64006400u, k.sixteenth, k.nz16);
    p[2] = wo_fma2((w8 & 0x000f000fu) | 0x64006400u, k.one, k.nz);
    p[3] = wo_fma2((w8 & 0x00f000f0u) | 0x64006400u, k.sixteenth, k.nz16);
#else
    unsigned int b[4];
    wo_unpack4_biased(wd, k, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = wo_fma2(b[j], k.one, k.nz);
#endif
}

// 8-bit code word -> four floats q - code_zero (exact).
__device__ __forceinline__ void wo_unpack8(unsigned int wd, const WoConst& k, float (&f)[4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = __uint_as_float(__byte_perm(wd, 0x4b000000u, 0x7440 + e)) - k.fz;
}

// 8-bit code word -> the f16 pairs (1024 + q0, 1024 + q1), (1024 + q2, 1024 + q3) (exact).
__device__ __forceinline__ void wo_unpack8_biased(unsigned int wd, unsigned int (&p)[2]) {
    p[0] = __byte_perm(wd, 0x64646464u, 0x4140);
    p[1] = __byte_perm(wd, 0x64646464u, 0x4342);
}

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
    constexpr int KS = wo_ks<BITS>(), VB = wo_vb<BITS>();
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
                                         const unsigned char* xk, bool has_row) {
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
            v4u xv = v4u{0u, 0u, 0u, 0u};
            if (has_row) xv = *reinterpret_cast<const v4u*>(xk + w * 64);
            const unsigned int a0[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
            wo_mma(acc, a0, xv.x, xv.y);
            const unsigned int a1[4] = {p[0][2], p[1][2], p[0][3], p[1][3]};
            wo_mma(acc, a1, xv.z, xv.w);
        }
    } else if constexpr (wo_biased8<BITS, SMODE>()) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            v4u xv = v4u{0u, 0u, 0u, 0u};
            if (has_row) xv = *reinterpret_cast<const v4u*>(xk + q * 64);
            const unsigned int xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int ww = 0; ww < 2; ++ww) {
                const int w = 2 * q + ww;
                unsigned int p[2][2];
                wo_unpack8_biased(cw[0][w], p[0]);
                wo_unpack8_biased(cw[1][w], p[1]);
                const unsigned int a[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
                wo_mma_h(acc, a, xw[2 * ww], xw[2 * ww + 1]);
            }
        }
    } else {
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
            v4u xv = v4u{0u, 0u, 0u, 0u};
            if (has_row) xv = *reinterpret_cast<const v4u*>(xk + q * 64);
            const unsigned int xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int ww = 0; ww < 2; ++ww) {
                const int w = 2 * q + ww;
                unsigned int p[2][2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float f[4];
                    wo_unpack8(cw[h][w], L.k, f);
                    if constexpr (SMODE == WO_DEQ) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) f[e] = fmaf(s[h], f[e], o[h]);
                    }
                    p[h][0] = pack2(f[0], f[1]);
                    p[h][1] = pack2(f[2], f[3]);
                }
                const unsigned int a[4] = {p[0][0], p[1][0], p[0][1], p[1][1]};
                wo_mma(acc, a, xw[2 * ww], xw[2 * ww + 1]);
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
                                             const unsigned char* xrow, bool has_row, int ks,
                                             const WoSums& xs, int t4) {
    const unsigned char* xk = xrow + ks * (wo_ks<BITS>() * 2);  // staged bytes per k-step
    if constexpr (SMODE == WO_KSTEP) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        wo_kstep<BITS, SMODE>(acc, cv, sc, L, xk, has_row);
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
        wo_kstep<BITS, SMODE>(tot, cv, sc, L, xk, has_row);
    }
}
