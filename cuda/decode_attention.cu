// decode_attention.cu: paged attention, one CTA per (query token, kv head, split).
//
// History (H200, batch 64 x 4096 ctx, GQA 32/8, hd 128, bf16; % of copy bandwidth):
//   v1  V loaded only after the scores, 150 registers, 3 CTAs/SM ............ 36%
//   v2  all K and V loads of a step issued together, 128 registers .......... 62%
//   v3  one kernel per call: the split count of each sequence is chosen on the device
//       from its own context (ceil(kv_len / min_keys), at most gridDim.z), so short
//       contexts run unsplit and surplus CTAs exit at once; the last CTA of a split
//       sequence (atomic counter, reset by it) merges the partials, so the separate
//       reduce kernel is gone; power-of-two block sizes index with shifts (no integer
//       division per key); bf16 -> f32 by mask/shift ........................ 69%
//   v4  (this) the split kernel's pass on tensor cores (decode_mma.cuh): ~5 CUDA-core
//       instructions per bf16 element (two for an e4m3 one's conversion) become ~1 per 16
//       elements; each warp streams its own 16-key tiles from global memory into registers
//       2 (bf16) / 3 (e4m3) tiles ahead, 8 warps per SM.  Target: 85 % for bf16 and e4m3
//       KV (issue 12); not yet measured (cuda/bench_fp8.py rows).
//
// The CTA serves the G = NQ / NKV query heads that share kv head `blockIdx.y`, so each K
// and V row is read from device memory once for all of them (GQA).  The keys of the
// token's context [0, kv_len) are divided into gridDim.z splits (flash-decoding); each
// split keeps an online softmax in float32 and writes either the final output (the
// sequence runs as one split) or a partial (acc, max, sum); the CTA that finishes last
// (counters[token, kv head], zero between launches) combines them and writes the output.
// The pass over a CTA's keys is decode_mma.cuh's (16-bit dtypes, head_dim % 16 == 0 and
// <= 128, G <= 8) or decode_cta.cuh's (everything else, and the cluster kernel); both leave
// each warp's softmax state in shared memory, combined here.  Scores are in the log2 domain
// (q is pre-scaled by scale * log2(e)).
//
// Token -> sequence: decode_mode = 1 means token i is sequence i (decode batch);
// otherwise the sequence is found by binary search in cu_seqlens_q, and the query at
// offset i of a chunk of ql tokens sees kv_len = seq_len - ql + i + 1 keys (causal,
// chunked-prefill aware).  This makes the kernel a correct (slower) prefill kernel too.
// Sequences with seq_len <= 0 (graph padding) write zeros.
//
// KV cache element type: the dtype (paged_attention_kernel, paged_attention_cluster_kernel)
// or float8_e4m3fn codes (the *_fp8_kernel twins, same arguments): codes are converted
// exactly in registers and the scales folded in: k_scale into q's pre-scaling (the caller
// passes scale_log2 * k_scale), v_scale into the output (out = A / L * v_scale).
#include "common.cuh"
#include "fp8.cuh"
#include "pdl.cuh"

#define NQ NUM_Q_HEADS
#define NKV NUM_KV_HEADS
#define HD HEAD_DIM
#define G (NQ / NKV)
#define NW 4
#define U 4

__device__ __forceinline__ int find_seq(const int* cu, int num_seqs, int t) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

#ifndef LLMC_HOST_EMULATION
// Coherent (L2) load of a float written by another CTA of the same launch.
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
#endif

#include "decode_cta.cuh"
#include "decode_mma.cuh"

// The split kernel's pass over its keys: tensor cores where decode_mma.cuh has a kernel for
// the config, the CUDA-core pass otherwise (4 CTAs per SM).  Tensor cores at head_dim 128
// take ~190-224 registers (2 CTAs per SM); at head_dim <= 64 the pass fits 128 registers
// without spilling, and 4 CTAs per SM (3 at the 130 registers ptxas picks when bounded to 2)
// read the 135M shape's 1,024 x [128, 256]-key decode batch at 82.7 % of copy instead of
// 66.6 % (bf16 KV; 512 rows: 75.0 against 63.4 %; H100, `python -m llmc.cuda.bench --only
// decode`, 2026-12-07); at 128 the bound spills (44.9 against 83.1 %).
template <typename cache_t>
__host__ __device__ constexpr bool use_mma() {
    return sizeof(cache_t) == 1 ? MMA_DECODE_FP8 : MMA_DECODE_16;
}
#define SPLIT_CTAS_PER_SM(mma) ((mma) && HD > 64 ? 2 : 4)

template <int NWARPS, typename cache_t>
__device__ __forceinline__ void attend_cta_split(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ bt, int block_size,
    int bs_shift, int t, int kvh, float scale_log2, int kbeg, int kend,
    float (&sm_ml)[NWARPS][G][2], float (&sm_acc)[NWARPS][G][HD]) {
#if MMA_DECODE_16 || MMA_DECODE_FP8
    if constexpr (use_mma<cache_t>()) {
        attend_cta_mma<NWARPS, cache_t>(q, k_cache, v_cache, bt, block_size, bs_shift, t, kvh,
                                        scale_log2, kbeg, kend, sm_ml, sm_acc);
    } else {
        attend_cta_simt<NWARPS, cache_t>(q, k_cache, v_cache, bt, block_size, bs_shift, t, kvh,
                                         scale_log2, kbeg, kend, sm_ml, sm_acc);
    }
#else
    attend_cta_simt<NWARPS, cache_t>(q, k_cache, v_cache, bt, block_size, bs_shift, t, kvh,
                                     scale_log2, kbeg, kend, sm_ml, sm_acc);
#endif
}

// The CTA's (max M, sum L, unnormalised acc A) of head g, dim d from its NWARPS warps'
// states (written by attend_cta, visible after a __syncthreads()).
template <int NWARPS>
__device__ __forceinline__ void combine_warp_states(const float (&sm_ml)[NWARPS][G][2],
                                                    const float (&sm_acc)[NWARPS][G][HD], int g,
                                                    int d, float& M, float& L, float& A) {
    M = LLMC_NEG_INF;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) M = fmaxf(M, sm_ml[w][g][0]);
    L = 0.f;
    A = 0.f;
    if (M != LLMC_NEG_INF) {
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float f = exp2f(sm_ml[w][g][0] - M);
            L += sm_ml[w][g][1] * f;
            A += sm_acc[w][g][d] * f;
        }
    }
}

// Launch: grid (tokens, NKV, max splits), block NW * 32.  min_keys: a sequence runs as
// ceil(kv_len / min_keys) splits (at least 1, at most gridDim.z); bs_shift: log2 of
// block_size, or -1.  counters: NKV ints per token, zero before the launch and after it.
// v_scale: the output factor of an fp8 V cache (1 otherwise).
template <typename cache_t>
__device__ __forceinline__ void paged_attention(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    int max_blocks_per_seq, int block_size, const int* __restrict__ seq_lens,
    const int* __restrict__ cu_seqlens_q, int num_seqs, int token_begin, int decode_mode,
    scalar_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
    float scale_log2, int min_keys, int bs_shift, int* __restrict__ counters, float v_scale) {
    const int tl = blockIdx.x;
    const int t = token_begin + tl;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z, nsplit_max = gridDim.z;

    const int s = decode_mode ? t : find_seq(cu_seqlens_q, num_seqs, t);
    const int q0 = cu_seqlens_q[s];
    const int ql = cu_seqlens_q[s + 1] - q0;
    const int sl = seq_lens[s];
    // rows past the last sequence's tokens (padding) attend to nothing -> zeros
    const bool live = sl > 0 && t - q0 < ql;
    const int kv_len = live ? sl - ql + (t - q0) + 1 : 0;
    const int nsplit =
        nsplit_max > 1 ? max(1, min(nsplit_max, (kv_len + min_keys - 1) / max(1, min_keys))) : 1;
    if (split >= nsplit) return;  // this sequence needs fewer splits (uniform per CTA)
    const int chunk = (kv_len + nsplit - 1) / nsplit;
    const int kbeg = split * chunk;
    const int kend = min(kv_len, kbeg + chunk);
    const int* bt = block_tables + (long long)s * max_blocks_per_seq;

    __shared__ float sm_ml[NW][G][2];
    __shared__ float sm_acc[NW][G][HD];
    __shared__ int sm_last;
    attend_cta_split<NW, cache_t>(q, k_cache, v_cache, bt, block_size, bs_shift, t, kvh, scale_log2,
                            kbeg, kend, sm_ml, sm_acc);
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
        const int g = idx / HD, d = idx % HD;
        float M, L, A;
        combine_warp_states<NW>(sm_ml, sm_acc, g, d, M, L, A);
        const int h = kvh * G + g;
        if (nsplit == 1) {
            out[((long long)t * NQ + h) * HD + d] = from_float(L > 0.f ? A / L * v_scale : 0.f);
        } else {
            const long long pidx = ((long long)tl * NQ + h) * nsplit_max + split;
            part_acc[pidx * HD + d] = A;
            if (d == 0) {
                part_ml[pidx * 2] = M;
                part_ml[pidx * 2 + 1] = L;
            }
        }
    }
    if (nsplit == 1) return;

    // Split sequence: the CTA that arrives last merges the nsplit partials of its G heads.
    __threadfence();  // this CTA's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        int* c = counters + (long long)tl * NKV + kvh;
        const int done = atomicAdd(c, 1);
        sm_last = done == nsplit - 1;
        if (sm_last) *c = 0;  // every other split has arrived: ready for the next launch
    }
    __syncthreads();
    if (!sm_last) return;
    __threadfence();
    for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
        const int g = idx / HD, d = idx % HD;
        const int h = kvh * G + g;
        const long long pbase = ((long long)tl * NQ + h) * nsplit_max;
        float M = LLMC_NEG_INF;
        for (int i = 0; i < nsplit; ++i) M = fmaxf(M, load_cg(part_ml + (pbase + i) * 2));
        float L = 0.f, A = 0.f;
        if (M != LLMC_NEG_INF) {
            for (int i = 0; i < nsplit; ++i) {
                const float f = exp2f(load_cg(part_ml + (pbase + i) * 2) - M);
                L += load_cg(part_ml + (pbase + i) * 2 + 1) * f;
                A += load_cg(part_acc + (pbase + i) * HD + d) * f;
            }
        }
        out[((long long)t * NQ + h) * HD + d] = from_float(L > 0.f ? A / L * v_scale : 0.f);
    }
}

#define PAGED_ATTENTION_ARGS(cache_t)                                                        \
    const scalar_t *__restrict__ q, const cache_t *__restrict__ k_cache,                     \
        const cache_t *__restrict__ v_cache, const int *__restrict__ block_tables,           \
        int max_blocks_per_seq, int block_size, const int *__restrict__ seq_lens,            \
        const int *__restrict__ cu_seqlens_q, int num_seqs, int token_begin, int decode_mode, \
        scalar_t *__restrict__ out, float *__restrict__ part_acc, float *__restrict__ part_ml, \
        float scale_log2, int min_keys, int bs_shift, int *__restrict__ counters, float v_scale
#define PAGED_ATTENTION_CALL(cache_t)                                                         \
    paged_attention<cache_t>(q, k_cache, v_cache, block_tables, max_blocks_per_seq, block_size, \
                             seq_lens, cu_seqlens_q, num_seqs, token_begin, decode_mode, out,   \
                             part_acc, part_ml, scale_log2, min_keys, bs_shift, counters, v_scale)

extern "C" __global__ void __launch_bounds__(NW * 32, SPLIT_CTAS_PER_SM(MMA_DECODE_16))
paged_attention_kernel(PAGED_ATTENTION_ARGS(scalar_t)) {
    pdl_trigger();  // o_proj's GEMV may launch on the SMs left free
    pdl_wait();     // q and the cache: rope_kv's
    PAGED_ATTENTION_CALL(scalar_t);
}
extern "C" __global__ void __launch_bounds__(NW * 32, SPLIT_CTAS_PER_SM(MMA_DECODE_FP8))
paged_attention_fp8_kernel(PAGED_ATTENTION_ARGS(fp8_t)) {
    pdl_trigger();  // o_proj's GEMV may launch on the SMs left free
    pdl_wait();     // q and the cache: rope_kv's
    PAGED_ATTENTION_CALL(fp8_t);
}

// ---------------------------------------------------------------------------------------
// Small decode batches (sm_90+): a cluster of CSPLIT CTAs per (token, kv head) splits the
// context, and the partials are merged through distributed shared memory: no partials in
// global memory, no fence, no atomic counter, no second kernel.  At batch 1 the split
// kernel above spends most of its ~12 us on those round trips (the keys themselves are
// ~1 MB per layer).  Each sequence uses ceil(kv_len / min_keys) of the CSPLIT CTAs (at
// least 1); the others contribute an empty state.  Decode rows only (token i = sequence i).
// Launch: grid (tokens, NKV, CSPLIT), block CNW * 32; cluster (1, 1, CSPLIT) is fixed.
// CNW = CLUSTER_WARPS, chosen by the host (KernelConfig.cluster_warps) so the warps' states
// fit 48 KiB of static shared memory: 8, fewer for large G * HD.
#define CSPLIT 8
#ifndef CLUSTER_WARPS
#define CLUSTER_WARPS 8
#endif
#define CNW CLUSTER_WARPS

// (Not in the host emulation: its CTAs run one after another, a cluster's cannot.)
#if (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900) && !defined(LLMC_HOST_EMULATION)
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// A float of CTA `rank`'s shared memory at the address `a` has in this CTA's.
__device__ __forceinline__ float ld_cluster(unsigned a, unsigned rank) {
    unsigned ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
    return v;
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <typename cache_t>
__device__ __forceinline__ void paged_attention_cluster(
    const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
    const cache_t* __restrict__ v_cache, const int* __restrict__ block_tables,
    int max_blocks_per_seq, int block_size, const int* __restrict__ seq_lens,
    scalar_t* __restrict__ out, float scale_log2, int min_keys, int bs_shift, float v_scale) {
    const int t = blockIdx.x;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;  // == the CTA's rank in its cluster

    const int sl = seq_lens[t];
    const int kv_len = sl > 0 ? sl : 0;  // graph padding rows (seq_len <= 0) write zeros
    const int nsplit = max(1, min(CSPLIT, (kv_len + min_keys - 1) / max(1, min_keys)));
    const int chunk = (kv_len + nsplit - 1) / nsplit;
    const int kbeg = split < nsplit ? split * chunk : 0;
    const int kend = split < nsplit ? min(kv_len, kbeg + chunk) : 0;
    const int* bt = block_tables + (long long)t * max_blocks_per_seq;

    // This CTA's state (max, sum, unnormalised acc) per head, from its warps' states.
    __shared__ float sm_ml[CNW][G][2];
    __shared__ float sm_acc[CNW][G][HD];
    __shared__ float cta_ml[G][2];
    __shared__ float cta_acc[G][HD];
    attend_cta_simt<CNW, cache_t>(q, k_cache, v_cache, bt, block_size, bs_shift, t, kvh, scale_log2,
                             kbeg, kend, sm_ml, sm_acc);
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
        const int g = idx / HD, d = idx % HD;
        float M, L, A;
        combine_warp_states<CNW>(sm_ml, sm_acc, g, d, M, L, A);
        cta_acc[g][d] = A;
        if (d == 0) {
            cta_ml[g][0] = M;
            cta_ml[g][1] = L;
        }
    }
    cluster_sync_all();  // every CTA's state is written and visible to the cluster

    // CTA `split` finishes its share of the G * HD outputs from all CSPLIT states.
    constexpr int per = (G * HD + CSPLIT - 1) / CSPLIT;
    for (int i = threadIdx.x; i < per; i += blockDim.x) {
        const int idx = split * per + i;
        if (idx >= G * HD) break;
        const int g = idx / HD, d = idx % HD;
        const unsigned a_m = smem_addr(&cta_ml[g][0]), a_l = smem_addr(&cta_ml[g][1]);
        const unsigned a_acc = smem_addr(&cta_acc[g][d]);
        float ms[CSPLIT];
        float M = LLMC_NEG_INF;
#pragma unroll
        for (int r = 0; r < CSPLIT; ++r) {
            ms[r] = ld_cluster(a_m, r);
            M = fmaxf(M, ms[r]);
        }
        float L = 0.f, A = 0.f;
        if (M != LLMC_NEG_INF) {
#pragma unroll
            for (int r = 0; r < CSPLIT; ++r) {
                const float f = exp2f(ms[r] - M);
                L += ld_cluster(a_l, r) * f;
                A += ld_cluster(a_acc, r) * f;
            }
        }
        out[((long long)t * NQ + kvh * G + g) * HD + d] = from_float(L > 0.f ? A / L * v_scale : 0.f);
    }
    cluster_sync_all();  // no CTA leaves while another still reads its shared memory
}
#define CLUSTER_ARGS(cache_t)                                                               \
    const scalar_t *__restrict__ q, const cache_t *__restrict__ k_cache,                    \
        const cache_t *__restrict__ v_cache, const int *__restrict__ block_tables,          \
        int max_blocks_per_seq, int block_size, const int *__restrict__ seq_lens,           \
        scalar_t *__restrict__ out, float scale_log2, int min_keys, int bs_shift, float v_scale
#define CLUSTER_CALL(cache_t)                                                                \
    paged_attention_cluster<cache_t>(q, k_cache, v_cache, block_tables, max_blocks_per_seq,   \
                                     block_size, seq_lens, out, scale_log2, min_keys, bs_shift, \
                                     v_scale)

extern "C" __global__ void __cluster_dims__(1, 1, CSPLIT) __launch_bounds__(CNW * 32, 2)
paged_attention_cluster_kernel(CLUSTER_ARGS(scalar_t)) {
    pdl_trigger();  // o_proj's GEMV may launch on the SMs left free
    pdl_wait();     // q and the cache: rope_kv's
    CLUSTER_CALL(scalar_t);
}
extern "C" __global__ void __cluster_dims__(1, 1, CSPLIT) __launch_bounds__(CNW * 32, 2)
paged_attention_cluster_fp8_kernel(CLUSTER_ARGS(fp8_t)) {
    pdl_trigger();  // o_proj's GEMV may launch on the SMs left free
    pdl_wait();     // q and the cache: rope_kv's
    CLUSTER_CALL(fp8_t);
}
#endif
