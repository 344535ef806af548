// gemm_wo.cu: the weight-only linear of larger steps on tensor cores,
//   out[m, n] = round(sum_k x[m, k] * w16[n, k] (+ bias[n])),  x [M, K] 16-bit, w = PackedWeight
// where w16 = the PackedWeight formula (wo_dequant.cuh) rounded once into the activation
// dtype, the weight values of dequantize-then-cuBLAS (wo_dequant.cu + torch.mm) (row-scaled
// layouts, flags & 4: s[n] times the sum over the exact code - code_zero instead), without
// the 16-bit weight's round trip through memory: the codes (0.5 / 1 byte a weight) are read
// once per M-tile, dequantized into shared memory, and multiplied with mma.sync m16n8k16
// (bf16 / f16 operands, float32 accumulation); the sum is rounded once (float32 ``out``:
// the rounded values, as llmc.cuda.gemv_wo_ops.linear_wo promises).
//
// CTA tile BM x BN (128x128, 64x128, 32x64), BK = 64 columns a k-tile, 256 threads = 8 warps
// as 2 (M) x 4 (N), each warp (BM / 2) x (BN / 4) of m16n8 accumulators. A ring of S
// cp.async stages (GW_STAGES: 3 for 128-row tiles, 4 for the others) holds X rows [BM][64]
// and code rows [BN][64 * BITS / 8] of the next k-tiles (zero-filled past M, N, K). Per
// k-tile kt: wait for tile kt's group; __syncthreads (every warp is done with tile kt - 1);
// cp.async of tile kt + S - 1 into kt - 1's slot; tile kt's codes -> the W tile [BN][64]
// 16-bit (8 columns of one group a thread unit: one scale / offset load, one 16-byte shared
// store; zeros past N and K); __syncthreads; ldmatrix A fragments from X, B fragments from W
// (W is [n][k]: the mma's col-major B), 4 k16 steps of mma.
// Shared rows are padded by 8 elements (gemm_wo.cuh's plain layout: the 8 rows of an
// ldmatrix phase fall in distinct banks); staging, dequantization, the grouped tile order
// and the stores are gemm_wo.cuh's, shared with the wgmma kernel (gemm_wo_sm90.cu).
//
// Requirements (the host falls back to dequantize-then-cuBLAS otherwise): 16-bit
// activations, K % 32 == 0 (whole 16-byte chunks of X and of code rows), group_size % 8 == 0,
// 16-byte-aligned x / codes bases, x contiguous. Any M >= 1 and N >= 1.
// Launch: grid (ceil(M / BM) * ceil(N / BN)), block 256, dynamic shared memory
// gw_smem_bytes (llmc.cuda.gemm_wo_ops). flags: 1 f32 scales, 2 float32 out, 4 row-scaled
// (one group a row, no offsets: the W tile holds code - code_zero, the scale multiplies the
// float32 sum; gemm_wo.cuh).
// Arguments: x, codes, scales, offsets|null, bias|null, out, M, N, K, code_zero, gs, G, flags.
// The PTX helpers are host code under LLMC_HOST_EMULATION (tests/cuda/kernel_emulator.h).
#include "common.cuh"

#if LLMC_DTYPE != 0

#include "mma_sync.cuh"

#ifndef LLMC_HOST_EMULATION
// all but the N most recent groups complete
template <int N>
__device__ __forceinline__ void gw_wait_stages() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
template <int N>
inline void gw_wait_stages() {}  // the emulator's cp.async copies at once
#endif  // LLMC_HOST_EMULATION

#include "gemm_wo.cuh"

// cp.async stages (X and code slots): 3 for 128-row tiles (two CTAs an SM fit), else 4
#define GW_STAGES(BM) ((BM) == 128 ? 3 : 4)

template <int BITS, int BM, int BN>
__device__ __forceinline__ void gemm_wo_body(const GwArgs& a) {
    constexpr int WM = BM / 2, WN = BN / 4, MT = WM / 16, NT = WN / 8, S = GW_STAGES(BM);
    constexpr int XB = BM * GW_LDS * 2, CS = BN * (GW_BK * BITS / 8);  // bytes of a slot
    static_assert(MT >= 1 && NT % 2 == 0, "tile: 16-row warp tiles, pairs of n8 tiles");
#ifdef LLMC_HOST_EMULATION
    unsigned char* smem = emu_dyn_smem;
#else
    extern __shared__ v4u gw_smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>(gw_smem_raw);
#endif
    // X slots [S][BM][GW_LDS] | W [BN][GW_LDS] (16-bit) | code slots [S][CS bytes]
    unsigned char* xsl = smem;
    scalar_t* ws = reinterpret_cast<scalar_t*>(smem + S * XB);
    unsigned char* csl = smem + S * XB + BN * GW_LDS * 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
    int m0, n0;
    gw_origin<BM, BN>(a, m0, n0);

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    const int KT = (a.K + GW_BK - 1) / GW_BK;
    const GwLoader<BITS, BM, BN, GW_THREADS> ld =
        gw_loader<BITS, BM, BN, GW_THREADS>(a, m0, n0, threadIdx.x);
#pragma unroll
    for (int s = 0; s < S - 1; ++s) gw_stage<BITS, BM, BN, false, S>(a, ld, xsl, XB, csl, CS, s, KT);
    for (int kt = 0; kt < KT; ++kt) {
        gw_wait_stages<S - 2>();  // tile kt landed (this thread's copies)
        __syncthreads();          // every warp is past tile kt - 1: its slot and W are free
        const int st = kt % S;
        gw_stage<BITS, BM, BN, false, S>(a, ld, xsl, XB, csl, CS, kt + S - 1, KT);
        GwPre<BN> pre;
        gw_pre_load<BN>(a, n0, kt, threadIdx.x, pre);
        gw_dequant<BITS, BN, false>(a, csl + st * CS, reinterpret_cast<unsigned char*>(ws),
                                    threadIdx.x, pre);
        __syncthreads();
        const scalar_t* xt = reinterpret_cast<const scalar_t*>(xsl + st * XB);
#pragma unroll
        for (int kk = 0; kk < GW_BK / 16; ++kk) {
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) {  // matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
                const int row = wm * WM + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4(smem_addr(xt + row * GW_LDS + kk * 16 + (lane >> 4) * 8), af[i]);
            }
#pragma unroll
            for (int j = 0; j < NT / 2; ++j) {  // matrices (n 0-7: b0, b1) (n 8-15: b0, b1)
                const int row = wn * WN + j * 16 + (lane & 7) + (lane >> 4) * 8;
                unsigned r[4];
                ldsm_x4(smem_addr(ws + row * GW_LDS + kk * 16 + ((lane >> 3) & 1) * 8), r);
                bf[2 * j][0] = r[0];
                bf[2 * j][1] = r[1];
                bf[2 * j + 1][0] = r[2];
                bf[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma16816(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }
    cp_async_wait_all();  // only empty groups remain: no copy outlives its thread

    // c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g + 8, ...)
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int m = m0 + wm * WM + i * 16 + g, n = n0 + wn * WN + j * 8 + 2 * t4;
            gw_store2<true>(a, m, n, acc[i][j][0], acc[i][j][1]);
            gw_store2<true>(a, m + 8, n, acc[i][j][2], acc[i][j][3]);
        }
}

// two CTAs an SM (<= 128 registers a thread): one CTA's dequantization overlaps the other's
// mma and the stalls of its barriers
#define GW_KERNEL(BITS, BM, BN)                                                                   \
    extern "C" __global__ void __launch_bounds__(GW_THREADS, 2)                                   \
        gemm_wo##BITS##_##BM##x##BN(GW_PARAMS) {                                                  \
        gemm_wo_body<BITS, BM, BN>(GW_ARGS);                                                      \
    }

GW_KERNEL(4, 128, 128)
GW_KERNEL(4, 64, 128)
GW_KERNEL(4, 32, 64)
GW_KERNEL(8, 128, 128)
GW_KERNEL(8, 64, 128)
GW_KERNEL(8, 32, 64)

#endif  // LLMC_DTYPE != 0
