// rope_kv.cu: rotary embedding of q and k fused with the write of k and v into the paged
// KV cache.
//   qkv [T, (NQ + 2 NKV) * HD] (rows: q heads | k heads | v heads)
//   q_out [T, NQ, HD] = rope(q);  k_cache[slot, kh] = rope(k);  v_cache[slot, kh] = v
//   cache layout [num_blocks, tokens_per_block, NKV, HD] == [num_slots, NKV, HD]
// RoPE is the NeoX "rotate_half" form with float32 tables cos/sin [max_pos, HD/2]
// (llama3 / linear scaling is already folded into the tables).  slot < 0 skips the cache
// write (CUDA-graph padding rows); q is still written.  Positions are clamped to
// [0, max_pos) so a bad position cannot read out of bounds.
// The rotation is float32 products and sums rounded one by one (no FMA contraction), as
// torch's `x * cos + rotate_half(x) * sin` computes it.
// rope_kv_fp8_kernel: the cache holds float8_e4m3fn codes: k_cache = sat(rope(k) * inv_k),
// v_cache = sat(v * inv_v) with inv = float32(1 / scale) (one scale per layer for K and one
// for V; llmc.cuda.reference.to_cache), round to nearest even (fp8.cuh). Smooth K
// (SageAttention): k_mean [NKV, HD] float32 is subtracted from rope(k) first,
// k_cache = sat((rope(k) - k_mean) * inv_k), float32 ops rounded one by one as the
// reference; softmax cancels the shift q.k_mean, so the attention kernels are unchanged.
// The 16-bit kernel takes k_mean too and ignores it (nullptr there).
// Launch: grid min(T, 65535), block 128; pointers aligned to PV elements (checked by the
// Python wrapper).
//
// History (H200, 16384 tokens, GQA 32/8, hd 128, bf16, bench; % of copy bandwidth):
//   v1  (this) block 128 looping over the 448 work units, scalar cos/sin ...... 73%
//   v2  one unit per thread (block 448) and 16-byte cos/sin reads: 63% -- slower;
//       reverted (2026-11-30, commit 1e34cd6).
#include "common.cuh"
#include "fp8.cuh"
#include "pdl.cuh"

#define NQ NUM_Q_HEADS
#define NKV NUM_KV_HEADS
#define HD HEAD_DIM
#define HALF (HD / 2)
// Pair vector: elements of each half rotated per thread.
#define PV vec_width_for(HALF)
#define VV vec_width_for(HD)

// n values into the cache: the dtype as is (inv unused), or e4m3 codes of v * inv.
template <typename cache_t, int N>
__device__ __forceinline__ void store_cache(cache_t* p, const float* f, float inv) {
    if constexpr (sizeof(cache_t) == 1) {
        store_fp8<N>(p, f, inv);
    } else {
        store_vec<N>(p, f);
    }
}

template <typename cache_t>
__device__ __forceinline__ void rope_kv(const scalar_t* __restrict__ qkv,
                                        const long long* __restrict__ positions,
                                        const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t,
                                        cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
                                        const long long* __restrict__ slots,
                                        scalar_t* __restrict__ q_out, int T, int max_pos,
                                        float inv_k, float inv_v,
                                        const float* __restrict__ k_mean) {
    constexpr int pv = PV, vv = VV;
    constexpr int rot_units = (NQ + NKV) * (HALF / pv);
    constexpr int v_units = NKV * (HD / vv);
    pdl_trigger();  // attention may launch; it waits for these writes (cuda/pdl.cuh)
    pdl_wait();     // qkv: the previous kernel's
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const scalar_t* row = qkv + (long long)t * (NQ + 2 * NKV) * HD;
        long long pos = positions[t];
        pos = pos < 0 ? 0 : (pos >= max_pos ? max_pos - 1 : pos);
        const long long slot = slots[t];
        const float* c = cos_t + pos * HALF;
        const float* s = sin_t + pos * HALF;
        for (int u = threadIdx.x; u < rot_units + v_units; u += blockDim.x) {
            if (u < rot_units) {
                const int h = u / (HALF / pv);
                const int i0 = (u % (HALF / pv)) * pv;
                float x1[pv], x2[pv], y1[pv], y2[pv];
                load_vec<pv>(row + h * HD + i0, x1);
                load_vec<pv>(row + h * HD + HALF + i0, x2);
#pragma unroll
                for (int e = 0; e < pv; ++e) {
                    const float ce = c[i0 + e], se = s[i0 + e];
                    y1[e] = __fsub_rn(__fmul_rn(x1[e], ce), __fmul_rn(x2[e], se));
                    y2[e] = __fadd_rn(__fmul_rn(x2[e], ce), __fmul_rn(x1[e], se));
                }
                if (h < NQ) {
                    scalar_t* dst = q_out + ((long long)t * NQ + h) * HD;
                    store_vec<pv>(dst + i0, y1);
                    store_vec<pv>(dst + HALF + i0, y2);
                } else {
                    if (slot < 0) continue;
                    if constexpr (sizeof(cache_t) == 1) {
                        const float* m = k_mean + (h - NQ) * HD + i0;
#pragma unroll
                        for (int e = 0; e < pv; ++e) {
                            y1[e] = __fsub_rn(y1[e], m[e]);
                            y2[e] = __fsub_rn(y2[e], m[HALF + e]);
                        }
                    }
                    cache_t* dst = k_cache + (slot * NKV + (h - NQ)) * HD;
                    store_cache<cache_t, pv>(dst + i0, y1, inv_k);
                    store_cache<cache_t, pv>(dst + HALF + i0, y2, inv_k);
                }
            } else {
                if (slot < 0) continue;
                const int uu = u - rot_units;
                const int kh = uu / (HD / vv);
                const int i0 = (uu % (HD / vv)) * vv;
                float v[vv];
                load_vec<vv>(row + (NQ + NKV + kh) * HD + i0, v);
                store_cache<cache_t, vv>(v_cache + (slot * NKV + kh) * HD + i0, v, inv_v);
            }
        }
    }
}

#define ROPE_KV_ARGS(cache_t)                                                                  \
    const scalar_t *__restrict__ qkv, const long long *__restrict__ positions,                 \
        const float *__restrict__ cos_t, const float *__restrict__ sin_t,                      \
        cache_t *__restrict__ k_cache, cache_t *__restrict__ v_cache,                          \
        const long long *__restrict__ slots, scalar_t *__restrict__ q_out, int T, int max_pos, \
        float inv_k, float inv_v, const float *__restrict__ k_mean
#define ROPE_KV_CALL(cache_t)                                                                 \
    rope_kv<cache_t>(qkv, positions, cos_t, sin_t, k_cache, v_cache, slots, q_out, T, max_pos, \
                     inv_k, inv_v, k_mean)

extern "C" __global__ void rope_kv_kernel(ROPE_KV_ARGS(scalar_t)) { ROPE_KV_CALL(scalar_t); }
extern "C" __global__ void rope_kv_fp8_kernel(ROPE_KV_ARGS(fp8_t)) { ROPE_KV_CALL(fp8_t); }
