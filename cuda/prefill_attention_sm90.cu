// prefill_attention_sm90.cu: paged causal prefill attention for Hopper (sm_90a only: wgmma,
// setmaxnreg), FlashAttention-3 style. 16-bit q / out (bf16 or f16), head_dim 64 or 128, KV
// cache in the activation dtype (prefill_sm90_kernel) or float8 e4m3 with one scale per
// tensor (prefill_sm90_fp8_kernel; real value = stored value * k_scale / v_scale).
//
// Rows, grid and causality are those of prefill_attention.cu: grid (row tiles, prefill seqs,
// NKV), a CTA serves BM = 128 rows of one kv head, row r -> token r / G, head kvh * G + r % G
// (the G heads of a kv head share each K/V tile); chunk tokens sit at positions
// seq_len - q_len ... seq_len - 1 and attend to every earlier key of the paged cache.
//
// Block of 384 threads = 3 warpgroups (warp specialisation):
//   WG0, producer (setmaxnreg.dec): loads the Q tile, then K and V tiles of BN = 128 keys
//     through the block table into a STAGES-deep ring, each stage with a "full" and an
//     "empty" mbarrier (loaders in prefill_sm90_producer.cuh). bf16/f16 caches: cp.async
//     16-byte copies completing on the full barrier (cp.async.mbarrier.arrive.noinc, one
//     arrival per producer thread), a tile's block-table entries shuffled from one load per
//     warp so the copies issue back to back; fp8 caches: each thread's 16-byte groups copied
//     raw (cp.async) into a 2-slot ring one tile ahead, then converted e4m3 -> 16-bit from
//     shared memory (exact), st.shared, proxy fence, a plain arrival. Every stage is
//     zero-filled past the sequence's last key.
//   WG1, WG2, consumers (setmaxnreg.inc): 64 query rows each. Per K/V tile t:
//     S = Q K^T   wgmma m64n128k16, A (Q) and B (K) from shared memory (K-major)
//     O += P V    wgmma m64n{HD}k16, A (P, bf16) from registers, B (V) MN-major
//     online softmax in float32 registers. QK^T of tile t and P V of tile t-1 are issued
//     together; the exponentials of tile t run while P V of tile t-1 is on the tensor cores,
//     and the two consumers take turns issuing (named barriers 1, 2: "ping-pong"), so one
//     warpgroup's softmax overlaps the other's matrix products.
//
// Shared memory (dynamic, base rounded up to 1024 bytes): Q [CB][BM][128 B], then STAGES K
// tiles and STAGES V tiles [CB][BN][128 B], then (fp8) the raw ring: 2 x (K, V) e4m3 tiles. Every tile is stored as CB = HD / 64 column
// blocks of 128-byte rows (64 16-bit elements) in the 128-byte swizzle: 16-byte chunk c of
// row r lives at r * 128 + ((c ^ (r % 8)) * 16) (swz). The wgmma descriptors below read
// exactly that (tests/cuda/test_prefill_sm90_layout.py checks the math against the PTX
// canonical layouts): K-major (Q, K): LBO 16 (unused), SBO 1024 (8-row groups), k-step of 16
// elements = +32 bytes inside the block, then the next column block; MN-major (V): SBO 1024
// (8 keys), LBO = BN * 128 (next 64 head dims), k-step of 16 keys = +2048 bytes.
#include "common.cuh"

#if LLMC_DTYPE != 0 && (HEAD_DIM == 64 || HEAD_DIM == 128)
#include "sm90.cuh"

#define NQ NUM_Q_HEADS
#define NKV NUM_KV_HEADS
#define HD HEAD_DIM
#define G (NQ / NKV)
#define BM 128                              // rows per CTA (2 consumer warpgroups x 64)
#define BN 128                              // keys per K / V tile
#define CH (HD / 8)                         // 16-byte chunks per 16-bit row
#define STAGES (HD == 128 ? 2 : 4)          // K and V ring depth
#define Q_BYTES (BM * HD * 2)
#define TILE_BYTES (BN * HD * 2)
#define SMEM_BYTES (Q_BYTES + 2 * STAGES * TILE_BYTES)  // + 1024 of alignment slack
#define NTHREADS 384
#define SCHED_BAR0 1                        // named barriers 1, 2: consumer ping-pong
#define RAW_BYTES (BN * HD)                 // fp8: one raw e4m3 K or V tile
// Producer variant, the one-line fallback: 1 = a tile's block-table entries loaded once per
// warp and shuffled to the keys, the copies issued back to back; fp8 tiles copied raw
// (cp.async) into a 2-slot ring and converted there, one tile ahead; 0 = one dependent table
// load per copy and fp8 converted from global loads in registers (the 88a49e6 producer,
// latency-bound: ~1 copy per table-load latency per thread).
#ifndef SM90_PRODUCER_V2
#define SM90_PRODUCER_V2 1
#endif

// Byte offset of 16-byte chunk c (0 .. CH-1) of row r in a [CB][rows][128 B] swizzled tile.
__device__ __forceinline__ unsigned swz(int r, int c, int rows) {
    return (unsigned)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

#include "prefill_sm90_producer.cuh"

// ---- consumer softmax ----------------------------------------------------------------
// S of tile kt (raw scores, this thread's rows A = lane / 4 and B = A + 8 of its warp's 16)
// -> exponentials in place (log2 domain, scale folded in), running maxima updated; returns
// the rescale factors of the rows' previous O and l, and the tile's partial row sums.
struct RowStep {
    float alA, alB, psA, psB;
};
__device__ __forceinline__ RowStep softmax_tile(float (&s)[64], float& mA, float& mB, int kt,
                                                bool diagonal, int qpA, int qpB, int tq,
                                                float scale_log2) {
    if (diagonal) {
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int key = kt + n * 8 + 2 * tq + (c & 1);
                if (key > (c < 2 ? qpA : qpB)) s[4 * n + c] = LLMC_NEG_INF;
            }
    }
    float mxA = LLMC_NEG_INF, mxB = LLMC_NEG_INF;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
        mxA = fmaxf(mxA, fmaxf(s[4 * n], s[4 * n + 1]));
        mxB = fmaxf(mxB, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
    const float mnA = fmaxf(mA, mxA * scale_log2), mnB = fmaxf(mB, mxB * scale_log2);
    const float muA = mnA == LLMC_NEG_INF ? 0.f : mnA;  // fully masked rows: exp2(-inf) = 0
    const float muB = mnB == LLMC_NEG_INF ? 0.f : mnB;
    RowStep r;
    r.alA = ex2(mA - muA);
    r.alB = ex2(mB - muB);
    mA = mnA;
    mB = mnB;
    r.psA = r.psB = 0.f;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
        s[4 * n] = ex2(fmaf(s[4 * n], scale_log2, -muA));
        s[4 * n + 1] = ex2(fmaf(s[4 * n + 1], scale_log2, -muA));
        s[4 * n + 2] = ex2(fmaf(s[4 * n + 2], scale_log2, -muB));
        s[4 * n + 3] = ex2(fmaf(s[4 * n + 3], scale_log2, -muB));
        r.psA += s[4 * n] + s[4 * n + 1];
        r.psB += s[4 * n + 2] + s[4 * n + 3];
    }
    return r;
}

// P (the exponentials, 16-bit) as wgmma A fragments: k-step kk covers keys 16kk .. 16kk+15,
// the same register layout as the accumulator's n8 chunks 2kk and 2kk+1.
__device__ __forceinline__ void pack_p(unsigned (&pa)[BN / 16][4], const float (&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack2(s[8 * kk], s[8 * kk + 1]);
        pa[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

__device__ __forceinline__ void rescale(float (&o)[HD / 2], float& lA, float& lB,
                                        const RowStep& r) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        o[4 * n] *= r.alA;
        o[4 * n + 1] *= r.alA;
        o[4 * n + 2] *= r.alB;
        o[4 * n + 3] *= r.alB;
    }
    lA = lA * r.alA + r.psA;
    lB = lB * r.alB + r.psB;
}

__device__ __forceinline__ void issue_qk(float (&s)[64], unsigned q_wg, unsigned k_st) {
    const u64 da = make_desc(q_wg, 16, 1024), db = make_desc(k_st, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {  // column block kk / 4, +32 bytes per k-step in it
        wgmma_ss_n128(s, da + (((kk >> 2) * BM * 128 + (kk & 3) * 32) >> 4),
                      db + (((kk >> 2) * BN * 128 + (kk & 3) * 32) >> 4), kk > 0);
    }
}

__device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const unsigned (&pa)[BN / 16][4],
                                         unsigned v_st) {
    const u64 db = make_desc(v_st, BN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs(o, pa[kk], db + ((kk * 16 * 128) >> 4));
}

template <bool FP8>
__device__ __forceinline__ void prefill_sm90(const scalar_t* __restrict__ q, const void* k_cache,
                                             const void* v_cache, const int* __restrict__ block_tables,
                                             int max_blocks_per_seq, int bs_shift,
                                             const int* __restrict__ seq_lens,
                                             const int* __restrict__ cu_seqlens_q, int seq_begin,
                                             scalar_t* __restrict__ out, float scale_log2,
                                             float out_scale) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ alignas(8) u64 bars[1 + 4 * STAGES];

    const int s_idx = seq_begin + blockIdx.y;
    const int kvh = blockIdx.z;
    const int tile = gridDim.x - 1 - blockIdx.x;  // heaviest (longest context) tiles first
    const int q0 = cu_seqlens_q[s_idx];
    const int ql = cu_seqlens_q[s_idx + 1] - q0;
    const int sl = seq_lens[s_idx];
    const int rows = ql * G;
    const int row0 = tile * BM;
    if (row0 >= rows || sl <= 0) return;  // uniform over the CTA: before any barrier
    const int ctx = sl - ql;
    const int* bt = block_tables + (long long)s_idx * max_blocks_per_seq;
    const int kv_end = ctx + (min(row0 + BM, rows) - 1) / G + 1;  // keys the CTA reads
    const int n_tiles = (kv_end + BN - 1) / BN;

    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const unsigned sQ = base, sK = base + Q_BYTES, sV = sK + STAGES * TILE_BYTES;
#if SM90_PRODUCER_V2
    const unsigned sR = sV + STAGES * TILE_BYTES;  // fp8: raw ring of 2 K + 2 V tiles
#endif
    const unsigned bar0 = smem_u32(bars);
    // bars: [0] Q full, [1 + s] K full, [1 + S + s] V full, [1 + 2S + s] K empty, [1 + 3S + s] V
    // empty (8 B each)
#define QFULL (bar0)
#define KFULL(s) (bar0 + 8u * (1 + (s)))
#define VFULL(s) (bar0 + 8u * (1 + STAGES + (s)))
#define KEMPTY(s) (bar0 + 8u * (1 + 2 * STAGES + (s)))
#define VEMPTY(s) (bar0 + 8u * (1 + 3 * STAGES + (s)))
    if (threadIdx.x == 0) {
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        const unsigned need = SMEM_BYTES + 1024 + (FP8 && SM90_PRODUCER_V2 ? 4 * RAW_BYTES : 0);
        if (dyn < need) asm volatile("trap;");  // launcher passed too little
        mbar_init(QFULL, 128);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(KFULL(s), 128);  // one (copy-completion) arrival per producer thread
            mbar_init(VFULL(s), 128);
            mbar_init(KEMPTY(s), 8);  // one arrival per consumer warp
            mbar_init(VEMPTY(s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        // ================= producer =================
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(FP8 ? 56 : 40));
        const int p = threadIdx.x;
#pragma unroll 4
        for (int i = 0; i < BM * CH / 128; ++i) {  // Q: chunk c of row r, zeros past the rows
            const int idx = p + i * 128, r = idx / CH, c = idx % CH, R = row0 + r;
            const scalar_t* src = q;
            if (R < rows)
                src = q + ((long long)(q0 + R / G) * NQ + kvh * G + R % G) * HD + c * 8;
            cp_async16(sQ + swz(r, c, BM), src, R < rows ? 16 : 0);
        }
        mbar_arrive_copies(QFULL);
#if SM90_PRODUCER_V2
        const int lane = p & 31;
        if constexpr (FP8) {
            // raw ring: slot r of K at sR + 2r * RAW_BYTES, of V one RAW_BYTES further. Tile t
            // is copied while tile t - 1 is converted; this thread's cp.async groups complete
            // in order K(t), V(t), K(t + 1), V(t + 1).
            const unsigned char* kc = (const unsigned char*)k_cache;
            const unsigned char* vc = (const unsigned char*)v_cache;
            int ent = tile_blocks(bt, bs_shift, 0, kv_end, lane);
            copy_raw_fp8(sR, kc, ent, bt, bs_shift, 0, kv_end, kvh, p);
            cp_async_commit();
            copy_raw_fp8(sR + RAW_BYTES, vc, ent, bt, bs_shift, 0, kv_end, kvh, p);
            cp_async_commit();
            for (int t = 0; t < n_tiles; ++t) {
                const int st = t % STAGES;
                const unsigned ph = ((t / STAGES) & 1) ^ 1;  // first round passes at once
                const unsigned raw = sR + (t & 1) * 2 * RAW_BYTES;
                const bool more = t + 1 < n_tiles;
                if (more) {  // the raw slot of tile t - 1: this thread converted it already
                    const unsigned nxt = sR + ((t + 1) & 1) * 2 * RAW_BYTES;
                    const int kt = (t + 1) * BN;
                    ent = tile_blocks(bt, bs_shift, kt, kv_end, lane);
                    copy_raw_fp8(nxt, kc, ent, bt, bs_shift, kt, kv_end, kvh, p);
                    cp_async_commit();
                    copy_raw_fp8(nxt + RAW_BYTES, vc, ent, bt, bs_shift, kt, kv_end, kvh, p);
                    cp_async_commit();
                    cp_async_wait<3>();  // K(t) landed
                } else {
                    cp_async_wait<1>();
                }
                mbar_wait(KEMPTY(st), ph);
                convert_raw_fp8(sK + st * TILE_BYTES, raw, KFULL(st), p);
                if (more)
                    cp_async_wait<2>();  // V(t) landed
                else
                    cp_async_wait<0>();
                mbar_wait(VEMPTY(st), ph);
                convert_raw_fp8(sV + st * TILE_BYTES, raw + RAW_BYTES, VFULL(st), p);
            }
        } else {
            for (int t = 0; t < n_tiles; ++t) {
                const int st = t % STAGES;
                const unsigned ph = ((t / STAGES) & 1) ^ 1;  // first round passes at once
                const int ent = tile_blocks(bt, bs_shift, t * BN, kv_end, lane);  // K and V
                mbar_wait(KEMPTY(st), ph);
                load_tile_v2(sK + st * TILE_BYTES, (const scalar_t*)k_cache, ent, bt, bs_shift,
                             t * BN, kv_end, kvh, p);
                mbar_arrive_copies(KFULL(st));
                mbar_wait(VEMPTY(st), ph);
                load_tile_v2(sV + st * TILE_BYTES, (const scalar_t*)v_cache, ent, bt, bs_shift,
                             t * BN, kv_end, kvh, p);
                mbar_arrive_copies(VFULL(st));
            }
        }
#else
        for (int t = 0; t < n_tiles; ++t) {
            const int st = t % STAGES;
            const unsigned ph = ((t / STAGES) & 1) ^ 1;  // first round passes at once
            mbar_wait(KEMPTY(st), ph);
            produce<FP8>(sK + st * TILE_BYTES, k_cache, KFULL(st), bt, bs_shift, t * BN, kv_end,
                         kvh, p);
            mbar_wait(VEMPTY(st), ph);
            produce<FP8>(sV + st * TILE_BYTES, v_cache, VFULL(st), bt, bs_shift, t * BN, kv_end,
                         kvh, p);
        }
#endif
        asm volatile("cp.async.wait_all;" ::: "memory");  // no copy outlives its thread
    } else {
        // ================= consumers =================
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(FP8 ? 208 : 216));
        const int cw = wg - 1;  // consumer 0 / 1: CTA rows cw * 64 .. cw * 64 + 63
        const int lane = threadIdx.x & 31, wl = (threadIdx.x >> 5) & 3, tq = lane & 3;
        const int RA = row0 + cw * 64 + wl * 16 + (lane >> 2), RB = RA + 8;
        const int qpA = RA < rows ? ctx + RA / G : -1;  // -1: padding row, every key masked
        const int qpB = RB < rows ? ctx + RB / G : -1;
        const int min_qp = ctx + row0 / G;  // smallest position among the CTA's rows
        const unsigned q_wg = sQ + cw * 64 * 128;
        const unsigned my_bar = SCHED_BAR0 + cw, other_bar = SCHED_BAR0 + (1 - cw);

        float s[64], o[HD / 2];
        unsigned pa[BN / 16][4];
#pragma unroll
        for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
        float mA = LLMC_NEG_INF, mB = LLMC_NEG_INF, lA = 0.f, lB = 0.f;

        if (cw == 1) named_arrive(other_bar);  // consumer 0 issues first
        mbar_wait(QFULL, 0);
        // section 0: S = Q K_0^T
        named_sync(my_bar);
        mbar_wait(KFULL(0), 0);
        fence_async_smem();
        wg_fence();
        issue_qk(s, q_wg, sK);
        wg_commit();
        named_arrive(other_bar);
        wg_wait<0>();
        pin(s);
        if (lane == 0) mbar_arrive(KEMPTY(0));
        RowStep r = softmax_tile(s, mA, mB, 0, BN - 1 > min_qp, qpA, qpB, tq, scale_log2);
        rescale(o, lA, lB, r);
        pack_p(pa, s);
        // sections 1 .. n-1: S = Q K_t^T and O += P_{t-1} V_{t-1}, issued together
        for (int t = 1; t < n_tiles; ++t) {
            const int st = t % STAGES, pst = (t - 1) % STAGES;
            named_sync(my_bar);
            mbar_wait(KFULL(st), (t / STAGES) & 1);
            mbar_wait(VFULL(pst), ((t - 1) / STAGES) & 1);
            fence_async_smem();
            wg_fence();
            issue_qk(s, q_wg, sK + st * TILE_BYTES);
            wg_commit();
            issue_pv(o, pa, sV + pst * TILE_BYTES);
            wg_commit();
            named_arrive(other_bar);
            wg_wait<1>();  // S of tile t is ready (groups complete in order)
            pin(s);
            if (lane == 0) mbar_arrive(KEMPTY(st));
            const int kt = t * BN;
            r = softmax_tile(s, mA, mB, kt, kt + BN - 1 > min_qp, qpA, qpB, tq, scale_log2);
            wg_wait<0>();  // P_{t-1} V_{t-1} done: O and the P registers are free
            pin(o);
            pin(pa);
            if (lane == 0) mbar_arrive(VEMPTY(pst));
            rescale(o, lA, lB, r);
            pack_p(pa, s);
        }
        // section n: O += P_{n-1} V_{n-1}
        const int lst = (n_tiles - 1) % STAGES;
        named_sync(my_bar);
        mbar_wait(VFULL(lst), ((n_tiles - 1) / STAGES) & 1);
        fence_async_smem();
        wg_fence();
        issue_pv(o, pa, sV + lst * TILE_BYTES);
        wg_commit();
        if (cw == 0) named_arrive(other_bar);  // consumer 1's last turn passes nothing on
        wg_wait<0>();
        pin(o);
        pin(pa);
        if (lane == 0) mbar_arrive(VEMPTY(lst));

        lA += __shfl_xor_sync(0xffffffffu, lA, 1);
        lA += __shfl_xor_sync(0xffffffffu, lA, 2);
        lB += __shfl_xor_sync(0xffffffffu, lB, 1);
        lB += __shfl_xor_sync(0xffffffffu, lB, 2);
        const float iA = lA > 0.f ? out_scale / lA : 0.f, iB = lB > 0.f ? out_scale / lB : 0.f;
        const long long offA = ((long long)(q0 + RA / G) * NQ + kvh * G + RA % G) * HD;
        const long long offB = ((long long)(q0 + RB / G) * NQ + kvh * G + RB % G) * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            const int d = n * 8 + 2 * tq;
            if (RA < rows)
                *reinterpret_cast<unsigned*>(out + offA + d) = pack2(o[4 * n] * iA, o[4 * n + 1] * iA);
            if (RB < rows)
                *reinterpret_cast<unsigned*>(out + offB + d) =
                    pack2(o[4 * n + 2] * iB, o[4 * n + 3] * iB);
        }
    }
#undef QFULL
#undef KFULL
#undef VFULL
#undef KEMPTY
#undef VEMPTY
}

// k_cache / v_cache: [num_blocks, 1 << bs_shift, NKV, HD] of scalar_t. scale_log2 =
// log2(e) / sqrt(HD); out_scale = 1.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
prefill_sm90_kernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                    const scalar_t* __restrict__ v_cache, const int* __restrict__ block_tables,
                    int max_blocks_per_seq, int bs_shift, const int* __restrict__ seq_lens,
                    const int* __restrict__ cu_seqlens_q, int seq_begin,
                    scalar_t* __restrict__ out, float scale_log2, float out_scale) {
    prefill_sm90<false>(q, k_cache, v_cache, block_tables, max_blocks_per_seq, bs_shift,
                        seq_lens, cu_seqlens_q, seq_begin, out, scale_log2, out_scale);
}

// The same over float8 e4m3 caches (1 byte per value): scale_log2 = log2(e) / sqrt(HD) *
// k_scale, out_scale = v_scale.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
prefill_sm90_fp8_kernel(const scalar_t* __restrict__ q, const unsigned char* __restrict__ k_cache,
                        const unsigned char* __restrict__ v_cache,
                        const int* __restrict__ block_tables, int max_blocks_per_seq,
                        int bs_shift, const int* __restrict__ seq_lens,
                        const int* __restrict__ cu_seqlens_q, int seq_begin,
                        scalar_t* __restrict__ out, float scale_log2, float out_scale) {
    prefill_sm90<true>(q, k_cache, v_cache, block_tables, max_blocks_per_seq, bs_shift,
                       seq_lens, cu_seqlens_q, seq_begin, out, scale_log2, out_scale);
}

#endif
