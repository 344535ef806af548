// gemm_wo_sm90.cu: the weight-only linear of larger steps on Hopper (sm_90a only: wgmma),
//   out[m, n] = round(sum_k x[m, k] * w16[n, k] (+ bias[n])),
// the arithmetic of gemm_wo.cu (w16 = the PackedWeight formula rounded once into the
// activation dtype, float32 accumulation, rounded once), with wgmma m64n128k16 in place of
// mma.sync: both operands K-major from shared memory in the 128-byte swizzle, the layout and
// descriptors of prefill_attention_sm90.cu's S = Q K^T (X rows are Q's, W rows are K's).
//
// CTA tile 128 x 128, BK = 64 (one 128-byte swizzled row per tile row), 384 threads, warp
// specialized as prefill_attention_sm90.cu:
//   WG0, producer: cp.async of each k-tile's X rows and code rows into stage kt % STAGES
//     (gemm_wo.cuh's loader, 128 threads), completing on the stage's "full" mbarrier
//     (cp.async.mbarrier.arrive.noinc, one arrival a thread); a stage is reused once the
//     consumers' 8 warps arrived on its "empty" mbarrier.
//   WG1, WG2, consumers (64 rows each; the dequantization is ALU work for both). Per k-tile
//     kt: wait on full[kt % STAGES]; named barrier (A: both warpgroups' wgmma of kt - 2 are
//     complete, so W[kt % 2] is free); dequantize tile kt's codes into W[kt % 2] (scales
//     loaded during the previous k-tile); fence.proxy.async (makes the producer's cp.async
//     rows and these st.shared visible to wgmma); named barrier (B); 4 wgmma k16 steps on
//     X slot kt, W[kt % 2]; commit; load tile kt + 1's scales; wait until only this group
//     is pending (wgmma of kt - 1 complete) and release kt - 1's stage.
// Shared memory (dynamic, base rounded up to 1024): X slots [STAGES][128][128 B] | W tiles
// [2][128][128 B] | code slots [STAGES][128][64 * BITS / 8 B] | mbarriers full[STAGES],
// empty[STAGES] (8 B each).
// History: until 2026-12-04 all 256 threads also issued the copies, before the fence; the
// fence compiles to MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC, which waits for the thread's memory
// operations in flight, so every k-tile paid a copy's latency: ~1.7 us a k-tile on the H200
// whatever M and the bits (docs/perf/archive-2026-12-03.md), 1.1 us once the dequantization
// lost its per-unit branches and the copies moved behind the wgmma.
// Requirements, launch arguments and flags: those of gemm_wo.cu (llmc.cuda.gemm_wo_ops),
// except row-scaled (flags & 4), which this kernel never takes (gemm_wo.cuh's gw_store2);
// grid ceil(M / 128) * ceil(N / 128), block GS_THREADS = 384, dynamic shared memory
// gs_smem_bytes.
#include "common.cuh"

#if LLMC_DTYPE != 0
#include "sm90.cuh"

__device__ __forceinline__ unsigned smem_addr(const void* p) { return smem_u32(p); }

#include "gemm_wo.cuh"

#define GS_BM 128
#define GS_BN 128
#define GS_STAGES 6
#define GS_TILE (128 * 128)  // bytes of one X slot or W tile
#define GS_THREADS 384

template <int BITS>
__device__ __forceinline__ void gemm_wo_sm90_body(const GwArgs& a) {
    constexpr int CS = GS_BN * GW_BK * BITS / 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw);
    unsigned char* base = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    unsigned char* xsl = base;
    unsigned char* wsl = base + GS_STAGES * GS_TILE;
    unsigned char* csl = wsl + 2 * GS_TILE;
    const unsigned bar0 = smem_u32(csl + GS_STAGES * CS);
#define GS_FULL(s) (bar0 + 8u * (s))
#define GS_EMPTY(s) (bar0 + 8u * (GS_STAGES + (s)))
    if (threadIdx.x == 0) {
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (unsigned)((GS_STAGES + 2) * GS_TILE + GS_STAGES * (CS + 16) + 1024))
            asm volatile("trap;");  // launcher passed too little
        for (int s = 0; s < GS_STAGES; ++s) {
            mbar_init(GS_FULL(s), 128);  // one (copy-completion) arrival per producer thread
            mbar_init(GS_EMPTY(s), 8);   // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int wg = threadIdx.x >> 7;
    int m0, n0;
    gw_origin<GS_BM, GS_BN>(a, m0, n0);
    const int KT = (a.K + GW_BK - 1) / GW_BK;

    if (wg == 0) {
        // ================= producer =================
        const int p = threadIdx.x;
        const GwLoader<BITS, GS_BM, GS_BN, 128> ld = gw_loader<BITS, GS_BM, GS_BN, 128>(a, m0, n0, p);
        for (int kt = 0; kt < KT; ++kt) {
            const int st = kt % GS_STAGES;
            if (kt >= GS_STAGES) mbar_wait(GS_EMPTY(st), ((kt / GS_STAGES) - 1) & 1);
            gw_load<BITS, GS_BM, GS_BN, true, 128>(a, ld, xsl + st * GS_TILE, csl + st * CS, kt, p);
            mbar_arrive_copies(GS_FULL(st));
        }
        asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives its thread
        return;
    }

    // ================= consumers =================
    const int cw = wg - 1, t = threadIdx.x - 128, wl = (t >> 5) & 3, lane = t & 31;
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.f;
    GwPre<GS_BN> next;  // tile kt + 1's scales, loaded while tile kt's wgmma runs
    gw_pre_load<GS_BN>(a, n0, 0, t, next);
    for (int kt = 0; kt < KT; ++kt) {
        const int st = kt % GS_STAGES;
        mbar_wait(GS_FULL(st), (kt / GS_STAGES) & 1);
        named_sync(1);  // A
        const GwPre<GS_BN> pre = next;
        unsigned char* w = wsl + (kt & 1) * GS_TILE;
        gw_dequant<BITS, GS_BN, true>(a, csl + st * CS, w, t, pre);
        fence_async_smem();  // cp.async / st.shared (generic proxy) -> wgmma (async proxy)
        named_sync(1);       // B
        wg_fence();
        const u64 da = make_desc(smem_u32(xsl + st * GS_TILE + cw * 64 * 128), 16, 1024);
        const u64 db = make_desc(smem_u32(w), 16, 1024);
#pragma unroll
        for (int kk = 0; kk < GW_BK / 16; ++kk) wgmma_ss_n128(d, da + 2 * kk, db + 2 * kk, 1);
        wg_commit();
        if (kt + 1 < KT) gw_pre_load<GS_BN>(a, n0, kt + 1, t, next);
        wg_wait<1>();
        if (kt >= 1 && lane == 0) mbar_arrive(GS_EMPTY((kt - 1) % GS_STAGES));
    }
    wg_wait<0>();
    pin(d);
#undef GS_FULL
#undef GS_EMPTY

    // accumulator n8 chunk j: d[4j], d[4j+1] = (row r, cols 8j + 2t, +1), d[4j+2..3] = row r + 8
    const int r = m0 + cw * 64 + wl * 16 + (lane >> 2), c = n0 + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < GS_BN / 8; ++j) {
        gw_store2<false>(a, r, c + 8 * j, d[4 * j], d[4 * j + 1]);
        gw_store2<false>(a, r + 8, c + 8 * j, d[4 * j + 2], d[4 * j + 3]);
    }
}

extern "C" __global__ void __launch_bounds__(GS_THREADS, 1) gemm_wo4_sm90(GW_PARAMS) {
    gemm_wo_sm90_body<4>(GW_ARGS);
}
extern "C" __global__ void __launch_bounds__(GS_THREADS, 1) gemm_wo8_sm90(GW_PARAMS) {
    gemm_wo_sm90_body<8>(GW_ARGS);
}

#endif  // LLMC_DTYPE != 0
