// decode_warp.cuh: decode attention for large batches, one warp per (sequence, kv head,
// chunk) unit.  Included by decode_attention.cu after decode_mma.cuh (its tensor-core pass,
// with NWARPS = 1) and merge_splits.
//
// Why: at many decode rows of short contexts (the 8B 128/128 row: ~500 rows of 128-256
// keys) the split kernel's CTA of 4 warps reads ~200 keys per (token, kv head), 3-4 tiles a
// warp, then merges its warps through shared memory and retires: each warp's few tiles
// wait behind the chain seq_lens -> block table -> K/V, and 2 resident CTAs per SM leave
// the SM idle while both sit in that chain or in the merge (the FP8 engine's profile,
// H100 2026-12-07: 49 % of copy at 128-256 keys against 87 % at 64 x 4,096).  Here a warp
// owns a whole unit: its tiles stream STAGES ahead through the whole context, there is no
// shared memory and no barrier, and the chain is paid once a unit, not once per 3 tiles.
//
// Units: a sequence of kv_len keys is ceil(kv_len / min_keys) chunks (at least 1, at most
// nsplit_max; equal lengths); unit u = chunk * (num_seqs * NKV) + seq * NKV + kvh, chunk
// major, so the chunks of one long sequence go to different warps.  The grid is persistent
// (as many warps as are resident, or fewer): warp w runs units w, w + W, w + 2W, ... and
// skips the chunks its sequence does not have.  A sequence of one chunk writes its output
// from registers; chunks write partials and the warp that arrives last (counters[seq, kv
// head], zero between launches) merges them (merge_splits).  Decode rows only (token i is
// sequence i); seq_len <= 0 (graph padding) writes zeros.  A warp skips the chunks its
// sequences lack, and after its chunk-0 units reads the batch's largest chunk count
// (max_chunks) and stops there, so a bound from the capture's max_seq_len costs ~nothing.
#pragma once

#if MMA_DECODE_16 || MMA_DECODE_FP8

// The most chunks any of the n sequences has (every lane gets it; 1 .. nsplit_max).
__device__ __forceinline__ int max_chunks(const int* __restrict__ seq_lens, int n, int min_keys,
                                          int nsplit_max) {
    int mx = 0;
    for (int i = threadIdx.x & 31; i < n; i += 32) mx = max(mx, seq_lens[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    return max(1, min(nsplit_max, (mx + min_keys - 1) / max(1, min_keys)));
}

template <typename cache_t, int S, bool KINT = false>
__device__ __forceinline__ void paged_attention_warps(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    int max_blocks_per_seq, int block_size, const int* __restrict__ seq_lens, int num_seqs,
    scalar_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
    float scale_log2, int min_keys, int bs_shift, int* __restrict__ counters, float v_scale,
    int nsplit_max) {
    constexpr bool F16 = sizeof(cache_t) == 1 || LLMC_DTYPE == 1;
    const int lane = threadIdx.x & 31, g8 = lane >> 2, tq = lane & 3;
    const int per_cta = blockDim.x >> 5;
    const int warps = gridDim.x * per_cta;
    const int items = num_seqs * NKV;
    const int units = items * nsplit_max;  // <= max_num_seqs * 8 * NKV (the host's budget)
    const int h0 = 2 * tq, h1 = 2 * tq + 1;  // this lane's O^T columns (heads)
    // chunks past the first exist only where a sequence is long: once its chunk-0 units are
    // done a warp learns the batch's most chunks and stops there (its units only grow)
    int cmax = nsplit_max, known = 0;
    for (int u = blockIdx.x * per_cta + (threadIdx.x >> 5); u < units; u += warps) {
        const int c = u / items, item = u - c * items;
        if (c > 0 && !known) {
            cmax = max_chunks(seq_lens, num_seqs, min_keys, nsplit_max);
            known = 1;
        }
        if (c >= cmax) break;  // warp-uniform
        const int t = item / NKV, kvh = item - t * NKV;
        const int kv_len = max(seq_lens[t], 0);
        const int nsplit = max(1, min(nsplit_max, (kv_len + min_keys - 1) / max(1, min_keys)));
        if (c >= nsplit) continue;  // warp-uniform
        const int chunk = (kv_len + nsplit - 1) / nsplit;
        const int kbeg = c * chunk, kend = min(kv_len, kbeg + chunk);

        unsigned qa[HD / 16][2];
        mma_load_q<F16>(q, t, kvh, scale_log2, qa);
        float m, l, o[HD / 16][4];
        mma_pass<1, cache_t, F16, S, KINT>(qa, k_cache, v_cache,
                                  block_tables + (long long)t * max_blocks_per_seq, block_size,
                                  bs_shift, kvh, kbeg, kend, 0, m, l, o);
        // (max, sum) of head g live in the lanes of quad g: heads h0, h1 in lanes 8tq, 8tq + 4
        const float l0 = __shfl_sync(0xffffffffu, l, 8 * tq);
        const float l1 = __shfl_sync(0xffffffffu, l, 8 * tq + 4);
        if (nsplit == 1) {
            const float f0 = l0 > 0.f ? v_scale / l0 : 0.f, f1 = l1 > 0.f ? v_scale / l1 : 0.f;
            scalar_t* o_row = out + ((long long)t * NQ + kvh * G) * HD;
#pragma unroll
            for (int mt = 0; mt < HD / 16; ++mt) {
                const int d0 = g8 * (HD / 8) + 2 * mt;
                if (h0 < G) {
                    const float v[2] = {o[mt][0] * f0, o[mt][2] * f0};
                    store_vec<2>(o_row + h0 * HD + d0, v);
                }
                if (h1 < G) {
                    const float v[2] = {o[mt][1] * f1, o[mt][3] * f1};
                    store_vec<2>(o_row + h1 * HD + d0, v);
                }
            }
            continue;
        }
        // one chunk of several: partials, then the last warp to arrive merges
        const long long pbase = ((long long)t * NQ + kvh * G) * nsplit_max + c;
        if (tq == 0 && g8 < G) {
            part_ml[(pbase + (long long)g8 * nsplit_max) * 2] = m;
            part_ml[(pbase + (long long)g8 * nsplit_max) * 2 + 1] = l;
        }
#pragma unroll
        for (int mt = 0; mt < HD / 16; ++mt) {
            const int d0 = g8 * (HD / 8) + 2 * mt;
            if (h0 < G) {
                float* p = part_acc + (pbase + (long long)h0 * nsplit_max) * HD + d0;
                p[0] = o[mt][0];
                p[1] = o[mt][2];
            }
            if (h1 < G) {
                float* p = part_acc + (pbase + (long long)h1 * nsplit_max) * HD + d0;
                p[0] = o[mt][1];
                p[1] = o[mt][3];
            }
        }
        __threadfence();  // this warp's partials are visible device-wide before it is counted
        __syncwarp();
        int last = 0;
        if (lane == 0) {
            int* ctr = counters + (long long)t * NKV + kvh;
            last = atomicAdd(ctr, 1) == nsplit - 1;
            if (last) *ctr = 0;  // every other chunk has arrived: ready for the next launch
        }
        if (!__shfl_sync(0xffffffffu, last, 0)) continue;
        __threadfence();
        for (int idx = lane; idx < G * HD; idx += 32)
            merge_splits(part_acc, part_ml, t, t, kvh, nsplit, nsplit_max, idx, out, v_scale);
    }
}

#define PAGED_WARPS_ARGS(cache_t)                                                              \
    const scalar_t *__restrict__ q, const cache_t *__restrict__ k_cache,                       \
        const cache_t *__restrict__ v_cache, const int *__restrict__ block_tables,             \
        int max_blocks_per_seq, int block_size, const int *__restrict__ seq_lens, int num_seqs, \
        scalar_t *__restrict__ out, float *__restrict__ part_acc, float *__restrict__ part_ml,  \
        float scale_log2, int min_keys, int bs_shift, int *__restrict__ counters,              \
        float v_scale, int nsplit_max
#define PAGED_WARPS_CALL(cache_t, S, KINT)                                                  \
    paged_attention_warps<cache_t, S, KINT>(q, k_cache, v_cache, block_tables, max_blocks_per_seq,    \
                                   block_size, seq_lens, num_seqs, out, part_acc, part_ml,   \
                                   scale_log2, min_keys, bs_shift, counters, v_scale,        \
                                   nsplit_max)

// Launch: grid (persistent CTAs), block 128 (any multiple of 32); see the header.  The
// _s* twins stream one tile more ahead (bench: is a warp's stream latency-bound?).
#if MMA_DECODE_16
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_kernel(PAGED_WARPS_ARGS(scalar_t)) {
    PAGED_WARPS_CALL(scalar_t, 2, false);
}
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_s3_kernel(PAGED_WARPS_ARGS(scalar_t)) {
    PAGED_WARPS_CALL(scalar_t, 3, false);
}
#endif
#if MMA_DECODE_FP8
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_fp8_kernel(PAGED_WARPS_ARGS(fp8_t)) {
    PAGED_WARPS_CALL(fp8_t, 3, false);
}
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_s4_fp8_kernel(PAGED_WARPS_ARGS(fp8_t)) {
    PAGED_WARPS_CALL(fp8_t, 4, false);
}
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_s5_fp8_kernel(PAGED_WARPS_ARGS(fp8_t)) {
    PAGED_WARPS_CALL(fp8_t, 5, false);
}
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_ik_fp8_kernel(PAGED_WARPS_ARGS(fp8_t)) {
    PAGED_WARPS_CALL(fp8_t, 3, true);
}
extern "C" __global__ void __launch_bounds__(128, 2)
paged_attention_warps_s4ik_fp8_kernel(PAGED_WARPS_ARGS(fp8_t)) {
    PAGED_WARPS_CALL(fp8_t, 4, true);
}
#endif

#endif  // MMA_DECODE_16 || MMA_DECODE_FP8
