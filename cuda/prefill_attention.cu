// prefill_attention.cu: paged causal attention for prefill chunks on tensor cores
// (mma.sync m16n8k16, bf16 / fp16 inputs, float32 accumulation; FlashAttention-2 style
// online softmax).  Built only for 16-bit dtypes with HEAD_DIM % 16 == 0; other cases use
// paged_attention_kernel of decode_attention.cu.
//
// Grid (num_row_tiles, num_prefill_seqs, NKV), block 128 (4 warps x 16 rows).  A CTA
// serves BM = 64 "rows" of one kv head, a row being (token of the chunk, query head of
// the kv head's group): row r -> token r / G, head kvh * G + r % G, so the G heads that
// share a kv head read each K/V tile once.  Tiles are taken heaviest-first.
// The chunk of sequence s has ql tokens at positions seq_len - ql ... seq_len - 1; each
// attends to keys 0 .. its position, all read from the paged cache (the chunk's own K/V
// were written by rope_kv_kernel before).  K and V tiles of BN keys are gathered through
// the block table with cp.async (V's copy overlaps the QK^T product).
//
// prefill_attention_fp8_kernel (same arguments): K and V come from a float8_e4m3fn cache.
// A tile's codes are loaded into registers (16 bytes per load) while the previous product
// runs, converted exactly to the 16-bit operand type and stored into the same shared-memory
// tiles, so the tensor-core code is shared; k_scale is folded into the score scale (the
// caller passes scale_log2 * k_scale), v_scale into the output.
// The PTX helpers are host code under LLMC_HOST_EMULATION (tests/cuda/kernel_emulator.h).
#include "common.cuh"
#include "fp8.cuh"

#if LLMC_DTYPE != 0 && (HEAD_DIM % 16 == 0)

#define NQ NUM_Q_HEADS
#define NKV NUM_KV_HEADS
#define HD HEAD_DIM
#define G (NQ / NKV)
#define BM 64
#define BN (HD <= 128 ? 64 : 32)
#define LDS (HD + 8)

#include "mma_sync.cuh"

// Gather BN keys [kt, kt + BN) of kv head kvh into smem rows (zero-fill past kv_end).
__device__ __forceinline__ void load_tile(scalar_t* smem, const scalar_t* cache, const int* bt,
                                          int block_size, int kt, int kv_end, int kvh) {
    constexpr int chunks = HD / 8;
    for (int i = threadIdx.x; i < BN * chunks; i += blockDim.x) {
        const int key = i / chunks, c = i % chunks;
        const int j = kt + key;
        const scalar_t* src = cache;
        int bytes = 0;
        if (j < kv_end) {
            const int blk = bt[j / block_size];
            src = cache + (((long long)blk * block_size + (j % block_size)) * NKV + kvh) * HD + c * 8;
            bytes = 16;
        }
        cp_async16(smem_addr(smem + key * LDS + c * 8), src, bytes);
    }
}

// Fast tile gather: thread owns chunk column c = tid % CH of keys tid / CH + r * KPP.
// The cache rows (slot * NKV + kvh) of a tile are computed once and reused for K and V.
#define CH (HD / 8)
#define KPP (128 / CH)
#define PASSES (BN / KPP)
#define FAST_GATHER (128 % CH == 0 && BN % KPP == 0)

__device__ __forceinline__ void tile_rows(int* rows_, const int* bt, int block_size, int kt,
                                          int kv_end, int kvh) {
#pragma unroll
    for (int r = 0; r < PASSES; ++r) {
        const int j = kt + threadIdx.x / CH + r * KPP;
        rows_[r] = j < kv_end ? (bt[j / block_size] * block_size + j % block_size) * NKV + kvh : -1;
    }
}

__device__ __forceinline__ void copy_tile(scalar_t* smem, const scalar_t* cache, const int* rows_) {
    const int c = threadIdx.x % CH;
#pragma unroll
    for (int r = 0; r < PASSES; ++r) {
        const int key = threadIdx.x / CH + r * KPP;
        const bool ok = rows_[r] >= 0;
        cp_async16(smem_addr(smem + key * LDS + c * 8),
                   ok ? cache + (long long)rows_[r] * HD + c * 8 : cache, ok ? 16 : 0);
    }
}

// fp8 tiles: a thread loads items tid + r * 128 (r < P8) of the tile's BN * C8 16-byte
// chunks of codes (C8 per key row) into registers, and later stores them converted.
#define C8 (HD / 16)
#define P8 ((BN * C8 + 127) / 128)

__device__ __forceinline__ void load_tile_fp8(v4u (&reg)[P8], const fp8_t* cache, const int* bt,
                                              int block_size, int kt, int kv_end, int kvh) {
#pragma unroll
    for (int r = 0; r < P8; ++r) {
        const int i = threadIdx.x + r * 128;
        const int key = i / C8, c = i % C8, j = kt + key;
        if (i < BN * C8 && j < kv_end) {
            const long long row = ((long long)bt[j / block_size] * block_size + j % block_size) * NKV + kvh;
            reg[r] = *reinterpret_cast<const v4u*>(cache + row * HD + c * 16);
        } else {
            reg[r] = v4u{0u, 0u, 0u, 0u};
        }
    }
}

// 16 codes -> 16 operand values (exact), two 16-byte shared-memory stores.
__device__ __forceinline__ void store_chunk_fp8(scalar_t* dst, const v4u& c) {
    const unsigned w[4] = {c.x, c.y, c.z, c.w};
    unsigned o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if LLMC_DTYPE == 1
        fp8x4_to_half2x2(w[i], o[2 * i], o[2 * i + 1]);
#else
        float f[4];
        fp8x4_to_float(w[i], f);
        o[2 * i] = pack2(f[0], f[1]);
        o[2 * i + 1] = pack2(f[2], f[3]);
#endif
    }
    reinterpret_cast<v4u*>(dst)[0] = v4u{o[0], o[1], o[2], o[3]};
    reinterpret_cast<v4u*>(dst)[1] = v4u{o[4], o[5], o[6], o[7]};
}

__device__ __forceinline__ void store_tile_fp8(scalar_t* smem, const v4u (&reg)[P8]) {
#pragma unroll
    for (int r = 0; r < P8; ++r) {
        const int i = threadIdx.x + r * 128;
        if (i < BN * C8) store_chunk_fp8(smem + (i / C8) * LDS + (i % C8) * 16, reg[r]);
    }
}

template <typename cache_t>
__device__ __forceinline__ void prefill_attention(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    int max_blocks_per_seq, int block_size, const int* __restrict__ seq_lens,
    const int* __restrict__ cu_seqlens_q, int seq_begin, scalar_t* __restrict__ out,
    float scale_log2, float v_scale) {
    constexpr bool FP8 = sizeof(cache_t) == 1;
    alignas(16) __shared__ scalar_t sK[BN * LDS];
    alignas(16) __shared__ scalar_t sV[BN * LDS];

    const int s = seq_begin + blockIdx.y;
    const int kvh = blockIdx.z;
    const int tile = gridDim.x - 1 - blockIdx.x;
    const int q0 = cu_seqlens_q[s];
    const int ql = cu_seqlens_q[s + 1] - q0;
    const int sl = seq_lens[s];
    const int rows = ql * G;
    const int row0 = tile * BM;
    if (row0 >= rows || sl <= 0) return;
    const int ctx = sl - ql;
    const int* bt = block_tables + (long long)s * max_blocks_per_seq;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g8 = lane >> 2, tq = lane & 3;
    const int rA = row0 + warp * 16 + g8, rB = rA + 8;
    const bool vA = rA < rows, vB = rB < rows;
    const int qpA = vA ? ctx + rA / G : -1;
    const int qpB = vB ? ctx + rB / G : -1;
    const long long qoffA = ((long long)(q0 + rA / G) * NQ + kvh * G + rA % G) * HD;
    const long long qoffB = ((long long)(q0 + rB / G) * NQ + kvh * G + rB % G) * HD;
    const int last_row = min(row0 + BM, rows) - 1;
    const int kv_end = ctx + last_row / G + 1;

    unsigned qa[HD / 16][4];
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
        const int d = ks * 16 + 2 * tq;
        qa[ks][0] = vA ? *reinterpret_cast<const unsigned*>(q + qoffA + d) : 0u;
        qa[ks][1] = vB ? *reinterpret_cast<const unsigned*>(q + qoffB + d) : 0u;
        qa[ks][2] = vA ? *reinterpret_cast<const unsigned*>(q + qoffA + d + 8) : 0u;
        qa[ks][3] = vB ? *reinterpret_cast<const unsigned*>(q + qoffB + d + 8) : 0u;
    }

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float mA = LLMC_NEG_INF, mB = LLMC_NEG_INF, lA = 0.f, lB = 0.f;

    const unsigned sK0 = smem_addr(sK), sV0 = smem_addr(sV);
    // ldmatrix row addresses (bytes) relative to the tile base, see header comment.
    const int k_row = (lane >> 4) * 8 + (lane & 7), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7), v_col = (lane >> 4) * 8;

    // Pipeline: K(kt + BN) is copied during P.V of tile kt, V(kt) during Q.K^T of tile kt.
    const int min_qp = ctx + row0 / G;  // smallest position of the CTA's rows
    // fp8: K(kt + BN) codes are loaded into kr during P.V of tile kt, V(kt) into vr during
    // Q.K^T of tile kt (the 16-bit caches copy with cp.async instead)
    v4u kr[FP8 ? P8 : 1], vr[FP8 ? P8 : 1];
#if FAST_GATHER
    int trows[PASSES];
#endif
    if constexpr (FP8) {
        load_tile_fp8(kr, k_cache, bt, block_size, 0, kv_end, kvh);
    } else {
#if FAST_GATHER
        tile_rows(trows, bt, block_size, 0, kv_end, kvh);
        copy_tile(sK, k_cache, trows);
#else
        load_tile(sK, k_cache, bt, block_size, 0, kv_end, kvh);
#endif
        cp_async_commit();
    }
    for (int kt = 0; kt < kv_end; kt += BN) {
        if constexpr (FP8) {
            store_tile_fp8(sK, kr);  // every warp is done with K(kt - BN) (second barrier)
            load_tile_fp8(vr, v_cache, bt, block_size, kt, kv_end, kvh);
            __syncthreads();  // K(kt) stored; every warp is done with V(kt - BN)
        } else {
            cp_async_wait_all();
            __syncthreads();  // K(kt) landed; every warp is done with V(kt - BN)
#if FAST_GATHER
            copy_tile(sV, v_cache, trows);
#else
            load_tile(sV, v_cache, bt, block_size, kt, kv_end, kvh);
#endif
            cp_async_commit();
        }
        const bool diagonal = kt + BN - 1 > min_qp;  // some key of the tile needs the mask

        float sc[BN / 8][4];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                unsigned r[4];
                ldsm_x4(sK0 + ((np * 16 + k_row) * LDS + ks * 16 + k_col) * 2, r);
                mma16816(sc[2 * np], qa[ks], r[0], r[1]);
                mma16816(sc[2 * np + 1], qa[ks], r[2], r[3]);
            }
        }
        float mxA = LLMC_NEG_INF, mxB = LLMC_NEG_INF;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int key = kt + n * 8 + 2 * tq + (c & 1);
                const int qp = c < 2 ? qpA : qpB;
                const float v =
                    (!diagonal || key <= qp) ? sc[n][c] * scale_log2 : LLMC_NEG_INF;
                sc[n][c] = v;
            }
            mxA = fmaxf(mxA, fmaxf(sc[n][0], sc[n][1]));
            mxB = fmaxf(mxB, fmaxf(sc[n][2], sc[n][3]));
        }
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
        const float mnA = fmaxf(mA, mxA), mnB = fmaxf(mB, mxB);
        const float muA = mnA == LLMC_NEG_INF ? 0.f : mnA;
        const float muB = mnB == LLMC_NEG_INF ? 0.f : mnB;
        const float alA = exp2f(mA - muA), alB = exp2f(mB - muB);
        mA = mnA;
        mB = mnB;
        float psA = 0.f, psB = 0.f;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
            sc[n][0] = exp2f(sc[n][0] - muA);
            sc[n][1] = exp2f(sc[n][1] - muA);
            sc[n][2] = exp2f(sc[n][2] - muB);
            sc[n][3] = exp2f(sc[n][3] - muB);
            psA += sc[n][0] + sc[n][1];
            psB += sc[n][2] + sc[n][3];
        }
        lA = lA * alA + psA;
        lB = lB * alB + psB;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][0] *= alA;
            o[n][1] *= alA;
            o[n][2] *= alB;
            o[n][3] *= alB;
        }
        if constexpr (FP8) {
            store_tile_fp8(sV, vr);
            if (kt + BN < kv_end) load_tile_fp8(kr, k_cache, bt, block_size, kt + BN, kv_end, kvh);
            __syncthreads();  // V(kt) stored; every warp is done with K(kt)
        } else {
            cp_async_wait_all();
            __syncthreads();  // V(kt) landed; every warp is done with K(kt)
            if (kt + BN < kv_end) {
#if FAST_GATHER
                tile_rows(trows, bt, block_size, kt + BN, kv_end, kvh);
                copy_tile(sK, k_cache, trows);
#else
                load_tile(sK, k_cache, bt, block_size, kt + BN, kv_end, kvh);
#endif
                cp_async_commit();
            }
        }
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[4];
            pa[0] = pack2(sc[2 * kk][0], sc[2 * kk][1]);
            pa[1] = pack2(sc[2 * kk][2], sc[2 * kk][3]);
            pa[2] = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[3] = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < HD / 16; ++dp) {
                unsigned r[4];
                ldsm_x4_trans(sV0 + ((kk * 16 + v_row) * LDS + dp * 16 + v_col) * 2, r);
                mma16816(o[2 * dp], pa, r[0], r[1]);
                mma16816(o[2 * dp + 1], pa, r[2], r[3]);
            }
        }
    }

    lA += __shfl_xor_sync(0xffffffffu, lA, 1);
    lA += __shfl_xor_sync(0xffffffffu, lA, 2);
    lB += __shfl_xor_sync(0xffffffffu, lB, 1);
    lB += __shfl_xor_sync(0xffffffffu, lB, 2);
    const float iA = lA > 0.f ? v_scale / lA : 0.f, iB = lB > 0.f ? v_scale / lB : 0.f;
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        const int d = n * 8 + 2 * tq;
        if (vA) *reinterpret_cast<unsigned*>(out + qoffA + d) = pack2(o[n][0] * iA, o[n][1] * iA);
        if (vB) *reinterpret_cast<unsigned*>(out + qoffB + d) = pack2(o[n][2] * iB, o[n][3] * iB);
    }
}

#define PREFILL_ARGS(cache_t)                                                                \
    const scalar_t *__restrict__ q, const cache_t *__restrict__ k_cache,                     \
        const cache_t *__restrict__ v_cache, const int *__restrict__ block_tables,           \
        int max_blocks_per_seq, int block_size, const int *__restrict__ seq_lens,            \
        const int *__restrict__ cu_seqlens_q, int seq_begin, scalar_t *__restrict__ out,     \
        float scale_log2, float v_scale
#define PREFILL_CALL(cache_t)                                                                 \
    prefill_attention<cache_t>(q, k_cache, v_cache, block_tables, max_blocks_per_seq,          \
                               block_size, seq_lens, cu_seqlens_q, seq_begin, out, scale_log2, \
                               v_scale)

extern "C" __global__ void __launch_bounds__(128, 2) prefill_attention_kernel(PREFILL_ARGS(scalar_t)) {
    PREFILL_CALL(scalar_t);
}
extern "C" __global__ void __launch_bounds__(128, 2)
prefill_attention_fp8_kernel(PREFILL_ARGS(fp8_t)) {
    PREFILL_CALL(fp8_t);
}

#endif
