// gemv_wo.cu: fused small-batch (M = 1..8 token rows) decode GEMVs on weight-only quantized
// weights (llmc.cuda.reference_wo.PackedWeight: uint8 codes, 4 bits two per byte (even k in
// the low nibble) or 8 bits, code_zero, groups of gs columns with one f16 / f32 scale and an
// optional offset each), memory-bound on the codes. 16-bit activations (f16 / bf16) only.
//
// Four kernels per (BITS, SMODE, stream) (extern "C" names gemv_wo{4,8}_{row,kstep,deq}_
// {norm,norm_silu,add,linear}[_ring|_scalar]; M is a run-time argument):
//   norm       out[m, n] = round(sum_k w[n, k] * xn[m, k] (+ bias[n]))              (qkv)
//   norm_silu  W = [2I, K] gate | up: act[m, j] = round(round(silu(round(g))) * round(u))
//   add        residual[m, n] = round(residual[m, n] + round(sum_k w[n, k] x[m, k])) (o, down)
//   linear     out[m, n] = round(sum_k w[n, k] x[m, k] (+ bias[n])), out float32 or dtype
// with xn = round(x * rsqrt(mean(x^2) + eps) * norm_w) and w[n, k] = s * (q - code_zero) + o
// of the element's group: the compositions of llmc.cuda.reference (norm_linear, ...).
//
// Dot products on tensor cores (mma.m16n8k16, f32 accumulate, A and B in the activation
// dtype), as cuda/gemv_fp8.cu: a *tile* is 16 weight rows (gate_up: 8 gate + the 8 matching
// up rows), the mma's n the 8 token rows (rows >= M read as zeros). Lane (g = lane / 4,
// t = lane % 4) streams one 16-byte vector of codes of tile rows g and g + 8 per k-step
// (ld.global.nc.L1::no_allocate): VB = 32 (4-bit) or 16 (8-bit) columns, a k-step
// KS = 4 VB columns. The sum over k does not care which column takes which mma slot as long
// as weights and activations agree, so the codes are unpacked where they lie:
//   4-bit: word w (columns 8w..8w+7 of the vector) -> four 16-bit pairs (j, j + 4), j < 4,
//          by one shift and one 3-input lop3 with a magic exponent each (bf16: 128 + q, f16:
//          1024 + q). kstep mode feeds these *biased* codes to the mma and takes (magic +
//          code_zero) x the k-step's activation sum off its sums (the per-k-step sums are then
//          always staged); row / deq modes first subtract magic + code_zero by one fma2
//          (exact: small integers; deq: f16 odd pairs as 1024 + 16 q, scaled by 1/16);
//   8-bit: row / kstep: two bytes -> the f16 pair (1024 + q0, 1024 + q1) by one prmt (biased
//          as above; f16 mmas, so the activations are staged as f16 also in bf16 builds, the
//          rows times a power of two when a value reaches 32768: exact, undone in the
//          epilogue); deq: byte e -> float 2^23 + q by one prmt, one fadd (- 2^23 -
//          code_zero), exact, and one cvt per pair.
// The activations are staged once per CTA in shared memory as 16-bit values, in that pair
// order, rows at stride S (K padded to whole k-steps, + 64 bytes: the two token rows of one
// LDS.128 phase fall in different banks), the pad zeroed.
//
// Scales (SMODE), chosen by the host from gs:
//   row    gs == K: one group per row; the mma sums are scaled in the epilogue (int8_wo);
//   kstep  gs % KS == 0: every k-step lies in one group; each k-step's mma sums (of exact
//          q - z values) are scaled and added in float32 (int4_wo g128); offsets add
//          o * sum_k x over the k-step (per-k-step sums staged beside the activations);
//   deq    gs < KS (GGUF blocks, g16 / g32 / g64): each weight is dequantized before the
//          mma: w = fma2(q - z, s, o) in 16 bits (4-bit) or fma(s, q - z, o) in float32
//          rounded once (8-bit) (deviation from the float32 weights: one 16-bit rounding).
// Scale loads (2 or 4 bytes) travel with the code loads of their k-step (kstep, deq).
//
// Work: tiles round-robin over the CTAs (grid <= SMs, <= tiles; 512 threads, one CTA per
// SM), 16 tiles per round; with c < 16 tiles in a round, 16 / c warps share each tile over
// contiguous shares of the k-steps and add their sums through shared memory (split-K for
// small N). The weight stream of a warp's share:
//   _ring (the default): cuda/wo_ring.cuh: every lane copies its code vectors and scale words
//          (cp.async) into its slots of a per-warp shared-memory ring of R one-k-step
//          stages (R = flags >> 8, 2..16, as many as the host's shared-memory budget holds
//          up to WoOps.wo_stages), R - 1 k-steps in flight while one is unpacked: (R - 1) x
//          16 KB of codes per SM, whatever the registers hold; the first R k-steps are issued
//          before the prologue; flags & WO_PREFETCH asks the L2 for 256 bytes a copy;
//   vector (the register stream): batches of wo_u<SMODE>() k-steps (4 in row mode, else 2)
//          double-buffered in registers; with flags & WO_PREFETCH each batch's loads also
//          prefetch (L2) the batch two after the next. The first batch is loaded, and the
//          next two prefetched into L2, before the prologue (rms scale, staging).
// Both call wo_mma_kstep per k-step in the same order: the same results, bit for bit.
//
// The *_scalar kernels (row bytes not a multiple of 16, or a misaligned base) load codes
// by bytes and x by elements: correct, slow. Launch: grid min(SMs, tiles), block 512,
// dynamic smem M * S + M * xsum_len * 4 bytes (+ the ring, 16-byte aligned after them: R x
// 16 warps x 512 x (2 + scale chunks) bytes; the host runs the unfused sequence when the
// staging exceeds its budget, the register stream when fewer than 2 stages fit). The PTX
// helpers are host code under LLMC_HOST_EMULATION (tests/cuda/kernel_emulator.h). PDL
// (cuda/pdl.cuh): the first code loads / ring stages and L2 prefetch precede pdl_wait().
//
// History: v1 (register stream, measured at a633fdc, 8B layer, T = 1): int4 g128 31 % of the
// copy rate, int8 48.5 %, Q4_K-like 32.9 %; the L2 prefetch flag changed nothing. Its SASS
// (nvcc 13, sm_90, -Xptxas -v): 126-128 registers (the cap of __launch_bounds__(512, 1)),
// no spills, one CTA of 16 warps per SM; the LDG.E.NA.128 of batch i + 1 are issued before
// batch i's unpack / HMMAs (not serialised), but a batch is 2 k-steps in kstep / deq mode
// (64 code bytes a lane) and 4 in row mode (128): at most 32 KB (kstep, deq) or 64 KB (row)
// of codes in flight per SM, one batch through the whole prologue; the offsets' per-k-step
// sums were shared-memory float atomics with 16 lanes on one address (CAS loops).
// v2: the _ring kernels (89-100 registers, no spills) by default: at M = 1, K = 4096
// 7 stages for int4 g128 and Q4_K-like (96 KB of codes in flight per SM), 8 for int8
// per-channel (112 KB); the prologue's sums shuffled over the lanes of one k-step, one atomic
// each. Not yet measured on the H200 (bench rows "(stages S)", S = 0: v1). (Measured later:
// slower than v1; the register stream stayed the default, WoOps.wo_stages = 0.)
// v3 (this, 2026-12-03): ncu of v1 on the H200 showed the register kernels issue-bound, not
// starved of bytes in flight (int4 gate_up: ~5.9 weights a warp instruction, 1.9 IPC; a pure
// read of the same pattern with 8 loads in flight a lane reached 95 % of copy): SASS of the
// int4 kstep k-step was 252 instructions for 2,048 weights. Biased codes (no fma2 a pair,
// the lop3 no longer split in two), no token-row predicate, the scale form fixed at compile
// time in the vector register stream: 156 (int4 kstep), int8 row 64 for 1,024. Measured (one
// 8B layer, T = 1, % of copy): int4 g128 31.6 -> 38.4, int8 48.5 -> 50.2 (59 % without the
// L2 prefetch, now off for these codes), Q4_K-like 32.9 -> 38.8. Then the group index as a
// shift in the fixed-form stream (the division cost ~25 instructions a k-step) and no
// bounds check a code load where the rows hold whole k-steps: int4 kstep 131
// instructions a k-step, int8 row 53 (not yet timed on the H200). The prologue (row mode)
// summed x per row by one float atomic a warp, in arrival order: int8_wo outputs differed
// run to run (an H100 layer chain, 2026-12-07); now the warp sums are added in warp order.
#include "common.cuh"
#include "pdl.cuh"

#include "wo_codes.cuh"
#include "wo_prologue.cuh"
#include "wo_ring.cuh"

template <int BITS, int SMODE>
__device__ __forceinline__ void wo_mma_batch(float (&tot)[4], const WoBatch<BITS, SMODE>& B,
                                             const WoLane& L, const unsigned char* xrow,
                                             int kb, int n, const WoSums& xs,
                                             int t4) {
#pragma unroll
    for (int u = 0; u < wo_u<SMODE>(); ++u) {
        if (u < n) {
            wo_mma_kstep<BITS, SMODE>(tot, B.c[u], B.sc[u], L, xrow, kb + u, xs, t4);
        }
    }
}

// The warp's k-steps [s0, s1) (s0 < s1), batch A already loaded when `preloaded`.
template <int BITS, int SMODE, bool VECTOR>
__device__ __forceinline__ void wo_stream(float (&tot)[4], WoBatch<BITS, SMODE>& A,
                                          WoBatch<BITS, SMODE>& B, const WoLane& L,
                                          const unsigned char* xrow, int s0, int s1,
                                          bool preloaded, const WoSums& xs, int t4) {
    constexpr int U = wo_u<SMODE>();
    int kb = s0;
    if (!preloaded) wo_load_batch<BITS, SMODE, VECTOR>(A, L, kb, min(U, s1 - kb));
    while (true) {  // two batches per trip: A and B swap roles without register moves
        int next = min(U, s1 - kb - U);
        if (next > 0) wo_load_batch<BITS, SMODE, VECTOR>(B, L, kb + U, next);
        wo_prefetch_batch<SMODE>(L, kb + 3 * U, s1);
        wo_mma_batch<BITS, SMODE>(tot, A, L, xrow, kb, min(U, s1 - kb), xs, t4);
        kb += U;
        if (kb >= s1) break;
        next = min(U, s1 - kb - U);
        if (next > 0) wo_load_batch<BITS, SMODE, VECTOR>(A, L, kb + U, next);
        wo_prefetch_batch<SMODE>(L, kb + 3 * U, s1);
        wo_mma_batch<BITS, SMODE>(tot, B, L, xrow, kb, min(U, s1 - kb), xs, t4);
        kb += U;
        if (kb >= s1) break;
    }
}

// wo_stream with the scale form fixed at compile time where it is the common one (f16
// scales, with or without offsets, power-of-two groups, whole k-steps a row): a copy of the
// lane whose f32 / has_o / pow2 / whole are constants, so the per-k-step scale loads, group
// indices, offset terms and code loads carry no run-time branches. Same operations, same bits
// as the generic stream.
template <int BITS, int SMODE, bool VECTOR>
__device__ __forceinline__ void wo_stream_fixed(float (&tot)[4], WoBatch<BITS, SMODE>& A,
                                                WoBatch<BITS, SMODE>& B, const WoLane& L,
                                                const unsigned char* xrow, int s0, int s1,
                                                bool preloaded, const WoSums& xs, int t4) {
    // (row mode loads no scales a k-step: any K; the scalar kernels: the generic stream)
    if (VECTOR && !L.f32 && (SMODE == WO_ROW || L.pow2) && L.whole) {
        WoLane F = L;
        F.f32 = false;
        F.pow2 = true;   // the group index a shift
        F.whole = true;  // no bounds check a code load
        if (L.has_o) {
            F.has_o = true;
            wo_stream<BITS, SMODE, VECTOR>(tot, A, B, F, xrow, s0, s1, preloaded, xs, t4);
        } else {
            F.has_o = false;
            wo_stream<BITS, SMODE, VECTOR>(tot, A, B, F, xrow, s0, s1, preloaded, xs, t4);
        }
    } else {
        wo_stream<BITS, SMODE, VECTOR>(tot, A, B, L, xrow, s0, s1, preloaded, xs, t4);
    }
}

// ---- epilogue ---------------------------------------------------------------------------
__device__ __forceinline__ float wo_silu(float g) { return g / (1.f + expf(-g)); }

// Outputs of one tile: v[0..1] = row g, tokens 2 t4 and 2 t4 + 1; v[2..3] = row g + 8.
template <int MODE>
__device__ __forceinline__ void wo_store(const WoArgs& a, const float (&v)[4], int tile, int g,
                                         int t4) {
    const int n_out = a.n_out;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int m = 2 * t4 + e;
        if (m >= a.M) continue;
        if constexpr (MODE == 1) {
            const int j = tile * 8 + g;
            if (j >= n_out) continue;
            const float gs = to_float(from_float(wo_silu(to_float(from_float(v[e])))));
            scalar_t* o = static_cast<scalar_t*>(a.out) + (long long)m * n_out + j;
            *o = from_float(gs * to_float(from_float(v[2 + e])));
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = tile * 16 + 8 * h + g;
                if (n >= n_out) continue;
                float y = v[2 * h + e];
                const long long i = (long long)m * n_out + n;
                if constexpr (MODE == 2) {
                    scalar_t* o = static_cast<scalar_t*>(a.out) + i;
                    *o = from_float(to_float(*o) + to_float(from_float(y)));
                } else {
                    if (a.bias != nullptr) y += to_float(a.bias[n]);
                    if (MODE == 3 && (a.flags & WO_OUT_F32)) {
                        static_cast<float*>(a.out)[i] = to_float(from_float(y));
                    } else {
                        static_cast<scalar_t*>(a.out)[i] = from_float(y);
                    }
                }
            }
        }
    }
}

// Row mode: the per-row scale (and offset times the row's sum of x) applied at the end; the
// biased 8-bit codes' (1024 + code_zero) x the row's sum of x taken off with it.
template <int BITS, int SMODE>
__device__ __forceinline__ void wo_row_scale(float (&v)[4], const WoLane& L, const WoSums& xs,
                                             int t4) {
    if constexpr (SMODE == WO_ROW) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float s = wo_scale(wo_ld_scale(L.s[h], 0, L.f32), L.f32);
            float o = 0.f;
            if (L.has_o) o = wo_scale(wo_ld_scale(L.o[h], 0, L.f32), L.f32);
            if constexpr (BITS == 8) o = fmaf(-s, L.k.mz8, o);  // biased codes: 1024 + z
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                v[2 * h + e] *= s;
                if (xs.xsum != nullptr) v[2 * h + e] += o * xs.xsum[min(2 * t4 + e, xs.M - 1)];
            }
        }
    }
}

template <int MODE, int BITS, int SMODE, bool VECTOR, bool RING>
__device__ __forceinline__ void gemv_wo_body(const WoArgs& a) {
    constexpr int VW = VECTOR ? 8 : 1;  // activation elements per prologue load
    constexpr int KS = wo_ks<BITS>(), U = wo_u<SMODE>();
#ifdef LLMC_HOST_EMULATION
    v4u* wo_smem = reinterpret_cast<v4u*>(emu_dyn_smem);
#else
    extern __shared__ v4u wo_smem[];
#endif
    unsigned char* xs = reinterpret_cast<unsigned char*>(wo_smem);
    __shared__ float part[WO_WARPS][4][32];  // split-K partial sums [warp][value][lane]
    __shared__ float red[WO_WARPS][8];
    __shared__ float tot[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    const int K = a.K, n_out = a.n_out;
    const int tiles = MODE == 1 ? (n_out + 7) / 8 : (n_out + 15) / 16;
    const int ksteps = (K + KS - 1) / KS;
    pdl_trigger();  // the next kernel may launch (llmc.cuda.pdl_launch)
    const int c = gemv_cta_tiles(tiles);
    if (c <= 0) {  // the host keeps grid <= tiles; CTA-uniform
        pdl_wait();
        return;
    }
    const int nsum = SMODE == WO_ROW ? 1 : ksteps;
    float* xsum = nullptr;
    if (wo_has_sums<BITS, SMODE>(a.offsets != nullptr)) {
        xsum = reinterpret_cast<float*>(xs + (long long)a.M * a.S);
    }
    const WoSums sums{xsum, nsum, a.M};
    // token rows >= M read row M - 1: their mma columns are never stored (no predicate, no
    // zeroed fragments in the k-step loop)
    const unsigned char* xrow = xs + min(g, a.M - 1) * a.S + 16 * t4;
    const WoConst kc = wo_const(a.code_zero);
    // ring: after the staging and the sums, 16-byte aligned (llmc.cuda.gemv_wo_ops)
    const int R = a.flags >> WO_STAGES_SHIFT;
    const long long sum_bytes = xsum ? (long long)a.M * nsum * 4 : 0;
    const long long ring_off = ((long long)a.M * a.S + sum_bytes + 15) & ~15ll;
    const int stage = wo_ring_chunks<BITS, SMODE>(a.gs) * 512;  // bytes a warp
    unsigned char* lane0 = wo_ring_lane(xs + ring_off, R, stage, warp, lane);

    WoBatch<BITS, SMODE> A, B;
    GemvWork w = gemv_work(0, c, ksteps, warp);
    WoLane L = wo_lane<BITS, MODE>(a, w.tile, g, t4, kc);
    if constexpr (RING) {  // the first R k-steps in flight before the prologue
        if (w.active && w.s0 < w.s1) wo_ring_fill<BITS, SMODE>(lane0, R, stage, L, w.s0, w.s1);
    } else if (w.active && w.s0 < w.s1) {  // start the weight stream before the prologue
        wo_load_batch<BITS, SMODE, VECTOR>(A, L, w.s0, min(U, w.s1 - w.s0));
        const unsigned char* rp =
            a.w + (long long)gemv_tile_row<MODE>(w.tile, lane & 15, n_out) * L.rowbytes;
        const int beg = 64 * (w.s0 + U);
        const int end = min(min(64 * w.s1, L.rowbytes), beg + 64 * 2 * U);
        for (int off = beg + 128 * (lane >> 4); off < end; off += 256) wo_prefetch(rp + off);
    }
    pdl_wait();  // x and the outputs: the previous kernel's (the codes and scales were not)
    const float back = wo_prologue<MODE, BITS, SMODE, VW>(a, xs, xsum, nsum, red, tot);

    for (int r = 0; r * WO_WARPS < c; ++r) {
        if (r > 0) {
            w = gemv_work(r, c, ksteps, warp);
            L = wo_lane<BITS, MODE>(a, w.tile, g, t4, kc);
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (w.active && w.s0 < w.s1) {
            if constexpr (RING) {
                if (r > 0) wo_ring_fill<BITS, SMODE>(lane0, R, stage, L, w.s0, w.s1);
                wo_ring_stream<BITS, SMODE>(acc, lane0, R, stage, L, xrow, w.s0, w.s1,
                                            sums, t4);
            } else {
                wo_stream_fixed<BITS, SMODE, VECTOR>(acc, A, B, L, xrow, w.s0, w.s1, r == 0,
                                                     sums, t4);
            }
        }
        gemv_split_add(acc, part, w, warp, lane);  // the other warps' shares
        if (w.active && w.part == 0) {
            wo_row_scale<BITS, SMODE>(acc, L, sums, t4);
            if (back != 1.f) {  // the prologue's power of two (CTA-uniform)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[j] *= back;
            }
            wo_store<MODE>(a, acc, w.tile, g, t4);
        }
        gemv_split_done(w);
    }
}

// One kernel per (mode, bits, scale mode, vector); all share one signature.
#define WO_KERNEL(NAME, MODE, BITS, SMODE, VECTOR, RING)                                           \
    extern "C" __global__ void __launch_bounds__(WO_THREADS, 1) NAME(                          \
        const scalar_t* __restrict__ x, const scalar_t* __restrict__ norm_w, float eps,        \
        const unsigned char* __restrict__ w, const void* __restrict__ scales,                  \
        const void* __restrict__ offsets, const scalar_t* __restrict__ bias, void* out, int N,  \
        int K, int M, int S, int gs, int G, int code_zero, int flags) {                        \
        gemv_wo_body<MODE, BITS, SMODE, VECTOR, RING>(                                             \
            WoArgs{x, norm_w, eps, w, scales, offsets, bias, out, N, K, M, S, gs, G, code_zero, \
                   flags});                                                                    \
    }

#define WO_MODES(PFX, BITS, SMODE, VECTOR, RING, SFX)               \
    WO_KERNEL(PFX##_norm##SFX, 0, BITS, SMODE, VECTOR, RING)        \
    WO_KERNEL(PFX##_norm_silu##SFX, 1, BITS, SMODE, VECTOR, RING)   \
    WO_KERNEL(PFX##_add##SFX, 2, BITS, SMODE, VECTOR, RING)         \
    WO_KERNEL(PFX##_linear##SFX, 3, BITS, SMODE, VECTOR, RING)

#define WO_FAMILY(PFX, BITS, SMODE)                                                     \
    WO_MODES(PFX, BITS, SMODE, true, false, ) WO_MODES(PFX, BITS, SMODE, false, false, _scalar) \
    WO_MODES(PFX, BITS, SMODE, true, true, _ring)

WO_FAMILY(gemv_wo4_row, 4, WO_ROW)
WO_FAMILY(gemv_wo4_kstep, 4, WO_KSTEP)
WO_FAMILY(gemv_wo4_deq, 4, WO_DEQ)
WO_FAMILY(gemv_wo8_row, 8, WO_ROW)
WO_FAMILY(gemv_wo8_kstep, 8, WO_KSTEP)
WO_FAMILY(gemv_wo8_deq, 8, WO_DEQ)
