// gemm_wo_sm90.cu: the weight-only linear of larger steps on Hopper (sm_90a only: wgmma),
//   out[m, n] = round(sum_k x[m, k] * w16[n, k] (+ bias[n])),
// the arithmetic of gemm_wo.cu (w16 = the PackedWeight formula rounded once into the
// activation dtype, float32 accumulation, rounded once), with wgmma m64n128k16 in place of
// mma.sync: both operands K-major from shared memory in the 128-byte swizzle, the layout and
// descriptors of prefill_attention_sm90.cu's S = Q K^T (X rows are Q's, W rows are K's).
//
// CTA tile 128 x 128, BK = 64 (one 128-byte swizzled row per tile row), 256 threads = two
// warpgroups of 64 rows each; every thread also stages and dequantizes (no producer
// warpgroup: the dequantization is ALU work for all threads). Shared memory (dynamic, base
// rounded up to 1024): X slots [STAGES][128][128 B] | W tiles [2][128][128 B] | code slots
// [STAGES][128][64 * BITS / 8 B]. Per k-tile kt:
//   wait for tile kt's cp.async group; __syncthreads (A: every warpgroup's wgmma of kt - 2 is
//   complete, so its X slot and W tile are free);
//   cp.async of tile kt + STAGES - 2 into the slot of kt - 2 (STAGES - 2 tiles ahead);
//   dequantize tile kt's codes into W[kt % 2] (while wgmma of kt - 1 runs on the tensor
//   cores); fence.proxy.async; __syncthreads (B);
//   4 wgmma k16 steps on X slot kt, W[kt % 2]; commit; wait until only this group is
//   pending (wgmma of kt - 1 complete).
// Requirements, launch arguments and flags: those of gemm_wo.cu (llmc.cuda.gemm_wo_ops),
// except row-scaled (flags & 4), which this kernel never takes (gemm_wo.cuh's gw_store2);
// grid ceil(M / 128) * ceil(N / 128), block 256, dynamic shared memory gs_smem_bytes.
#include "common.cuh"

#if LLMC_DTYPE != 0
#include "sm90.cuh"

__device__ __forceinline__ unsigned smem_addr(const void* p) { return smem_u32(p); }

#include "gemm_wo.cuh"

#define GS_BM 128
#define GS_BN 128
#define GS_STAGES 6
#define GS_TILE (128 * 128)  // bytes of one X slot or W tile

template <int BITS>
__device__ __forceinline__ void gemm_wo_sm90_body(const GwArgs& a) {
    constexpr int CS = GS_BN * GW_BK * BITS / 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* base = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    unsigned char* xsl = base;
    unsigned char* wsl = base + GS_STAGES * GS_TILE;
    unsigned char* csl = wsl + 2 * GS_TILE;
    if (threadIdx.x == 0) {
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (unsigned)((GS_STAGES + 2) * GS_TILE + GS_STAGES * CS + 1024))
            asm volatile("trap;");  // launcher passed too little
    }
    const int wg = threadIdx.x >> 7, wl = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    int m0, n0;
    gw_origin<GS_BM, GS_BN>(a, m0, n0);
    const int KT = (a.K + GW_BK - 1) / GW_BK;

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
#pragma unroll
    for (int s = 0; s < GS_STAGES - 2; ++s)
        gw_stage<BITS, GS_BM, GS_BN, true, GS_STAGES>(a, xsl, GS_TILE, csl, CS, m0, n0, s, KT);
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<GS_STAGES - 3>();  // tile kt landed (this thread's copies)
        __syncthreads();                 // A
        const int st = kt % GS_STAGES;
        gw_stage<BITS, GS_BM, GS_BN, true, GS_STAGES>(a, xsl, GS_TILE, csl, CS, m0, n0,
                                                      kt + GS_STAGES - 2, KT);
        unsigned char* w = wsl + (kt & 1) * GS_TILE;
        gw_dequant<BITS, GS_BN, true>(a, csl + st * CS, w, n0, kt);
        fence_async_smem();  // st.shared / cp.async (generic proxy) -> wgmma (async proxy)
        __syncthreads();     // B
        wg_fence();
        const u64 da = make_desc(smem_u32(xsl + st * GS_TILE + wg * 64 * 128), 16, 1024);
        const u64 db = make_desc(smem_u32(w), 16, 1024);
#pragma unroll
        for (int kk = 0; kk < GW_BK / 16; ++kk) wgmma_ss_n128(d, da + 2 * kk, db + 2 * kk, 1);
        wg_commit();
        wg_wait<1>();
    }
    wg_wait<0>();
    pin(d);
    asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives its thread

    // accumulator n8 chunk j: d[4j], d[4j+1] = (row r, cols 8j + 2t, +1), d[4j+2..3] = row r + 8
    const int r = m0 + wg * 64 + wl * 16 + (lane >> 2), c = n0 + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < GS_BN / 8; ++j) {
        gw_store2<false>(a, r, c + 8 * j, d[4 * j], d[4 * j + 1]);
        gw_store2<false>(a, r + 8, c + 8 * j, d[4 * j + 2], d[4 * j + 3]);
    }
}

extern "C" __global__ void __launch_bounds__(GW_THREADS, 1) gemm_wo4_sm90(GW_PARAMS) {
    gemm_wo_sm90_body<4>(GW_ARGS);
}
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1) gemm_wo8_sm90(GW_PARAMS) {
    gemm_wo_sm90_body<8>(GW_ARGS);
}

#endif  // LLMC_DTYPE != 0
