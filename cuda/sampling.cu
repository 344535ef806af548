// sampling.cu: token ids (int64) of the sampled rows; the function of
// llmc.cuda.reference.sample, bit for bit:
//   pen   = penalties(logits)  (repetition on prompt|output tokens, then frequency and
//           presence on output tokens; only when has_pen)
//   greedy rows (temperature <= 0, or every row when all_greedy): argmax(pen), first index
//           on ties
//   sampled rows: l = pen / T, M = max l (a row whose M is not finite takes its first max);
//           e = expf(l - M); keys = the order-preserving 32-bit image of l (-0 == +0);
//           top-k: keep key >= kth = the k-th largest key (ties kept, k = 0 off);
//           top-p on the top-k-kept set K, masses q = floor(e * 2**32) (exact integers):
//           keep key >= tau = the smallest key x in K with
//           double(mass of K above x) < double(p) * double(mass of K)   (p <= 0: max ties);
//           min-p: keep e >= min_p;
//           token = argmax over kept of l - logf(-logf(u)), u = philox_uniform(seed, offset, v).
// The thresholds are radix selects over the keys, 8 bits a round (4 rounds each, only when
// the filter is on), with integer histograms: the sums are exact in any order, so the kept
// set (and the token) does not depend on how a row is split or on the rest of the batch.
//
// Versions (the record):
//  1. one CTA per row, 32 bisection passes per threshold over recomputed values:
//     3.65 ms for 64 x 128256 top-k 50 + top-p 0.9 on the H200 (64 CTAs on 132 SMs, every
//     pass latency-bound), 0.24 ms temperature only.
//  2. sample_cluster_kernel (sm_90): a thread-block cluster of SAMPLE_CLUSTER CTAs
//     per row; each CTA keeps its slice of l in shared memory (one read of the logits), the
//     radix histograms are summed across the cluster through distributed shared memory.
//     sample_kernel: the same code with one CTA per row that re-reads the logits on every
//     pass (devices below sm_90, rows whose slices do not fit shared memory; the host
//     emulation runs this one).
//  3. the radix rounds skip a warp none of whose lanes holds a candidate key (one
//     vote instead of a match and two reductions): after round 0 the candidates are the
//     keys of one bin, so most warps of rounds 1-3 add nothing (the same histograms).
//     H200, 2026-12-02 (`python -m llmc.cuda.bench --only sampling`): top-k 50 + top-p 0.9
//     of 64 x 128,256 in 0.188 ms (v2 0.234), top-p 0.9 alone 0.316 (v2 0.336); at 512 rows
//     temperature 0.7 + top-p 0.9 1.921 ms, of which the first radix round ~0.96 ms
//     (scripts/sampling_variants.py: stopping after 1 / 2 rounds gives 1.441 / 1.708 ms;
//     plain per-lane atomics instead of the warp match: 2.797 ms).
//  4. the bin masses are added with two 32-bit shared atomics and a carry (mass_add)
//     instead of one 64-bit atomic: 1.803 ms at 512 rows (6 % less; same tokens).
//  5. (this) no warp aggregation: each lane adds its own key with 32-bit atomics (the
//     __match_any_sync and two reductions per warp-iteration cost more than the atomics
//     they saved): 0.879 ms at 512 rows, 0.159 ms for top-p 0.9 alone at 64 rows (0.305 in
//     v4), same tokens; mass_add skips the high word's atomic when it adds 0.
// Launch: sample_cluster_kernel grid (SAMPLE_CLUSTER, S), block SAMPLE_THREADS, dynamic
// shared memory 4 * slice floats (slice = sample_slice(V)); sample_kernel grid S, block
// SAMPLE_THREADS, no dynamic shared memory.
#include "common.cuh"

#define SAMPLE_THREADS 256  // == RADIX_BINS: thread t owns histogram bin t
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SAMPLE_CLUSTER 8  // CTAs per row of sample_cluster_kernel (portable cluster size)
#define RADIX_BINS 256
#define GREEDY_ILP 4  // 16-byte logits loads in flight per thread (plain rows)

struct alignas(16) greedy_vec {  // 4 logits (own type: NVRTC needs no CUDA headers)
    float x, y, z, w;
};

#include "sampling_select.cuh"

// ---- Philox4x32-10 (reference.philox_uniform, bit for bit) -------------------------------
__device__ __forceinline__ unsigned philox_word0(unsigned c0, unsigned c1, unsigned c2,
                                                 unsigned c3, unsigned k0, unsigned k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const unsigned n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    return c0;
}

__device__ __forceinline__ float philox_uniform(unsigned long long seed,
                                                unsigned long long offset, unsigned v) {
    const unsigned x = philox_word0(v, (unsigned)offset, (unsigned)(offset >> 32), 0u,
                                    (unsigned)seed, (unsigned)(seed >> 32));
    return (float)(2u * (x >> 9) + 1u) * 5.9604644775390625e-08f;  // 2**-24
}

struct RowCtx {
    const float* logits;
    const int* counts;
    const unsigned char* pmask;
    float rep, pres, freq, temp;
    int has_pen, scaled;
};

__device__ __forceinline__ float proc_value(const RowCtx& c, int v) {
    float l = c.logits[v];
    if (c.has_pen) {
        const int n = c.counts[v];
        if (c.pmask[v] || n > 0) l = l > 0.f ? __fdiv_rn(l, c.rep) : __fmul_rn(l, c.rep);
        l = __fsub_rn(l, __fmul_rn(c.freq, (float)n));
        l = __fsub_rn(l, __fmul_rn(c.pres, n > 0 ? 1.f : 0.f));
    }
    if (c.scaled) l = __fdiv_rn(l, c.temp);
    return l;
}

// ---- argmax (largest value, smallest index among equal values) ---------------------------
// This thread's running argmax over its indices, which arrive in increasing order.
__device__ __forceinline__ void argmax_take(float x, int v, float& best, int& bi) {
    if (x > best || bi == 0x7fffffff) {
        best = x;
        bi = v;
    }
}

__device__ __forceinline__ void argmax_merge(float ov, int oi, float& v, int& idx) {
    if (ov > v || (ov == v && oi < idx) || idx == 0x7fffffff) {
        if (oi != 0x7fffffff) {
            v = ov;
            idx = oi;
        }
    }
}

__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        argmax_merge(ov, oi, v, idx);
    }
}

// The row's argmax over its C CTAs; the token is valid in thread 0 of rank 0.
template <int C>
__device__ __forceinline__ int row_argmax(float v, int idx, int rank) {
    __shared__ float shv[SAMPLE_WARPS + 1];
    __shared__ int shi[SAMPLE_WARPS + 1];
    warp_argmax(v, idx);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        shv[w] = v;
        shi[w] = idx;
    }
    __syncthreads();
    if (w == 0) {
        v = lane < SAMPLE_WARPS ? shv[lane] : LLMC_NEG_INF;
        idx = lane < SAMPLE_WARPS ? shi[lane] : 0x7fffffff;
        warp_argmax(v, idx);
        if (lane == 0) {
            shv[SAMPLE_WARPS] = v;
            shi[SAMPLE_WARPS] = idx;
        }
    }
    row_sync<C>();  // every CTA's argmax is published
    if (rank == 0 && threadIdx.x == 0) {
        float vs[C];
        int is[C];
#pragma unroll
        for (int r = 0; r < C; ++r) {
            vs[r] = row_ld<C>(&shv[SAMPLE_WARPS], r);
            is[r] = row_ld<C>(&shi[SAMPLE_WARPS], r);
        }
        v = vs[0];
        idx = is[0];
#pragma unroll
        for (int r = 1; r < C; ++r) argmax_merge(vs[r], is[r], v, idx);  // ranks in vocab order
    }
    if (C > 1) row_sync<C>();  // no CTA leaves while rank 0 still reads its shared memory
    return idx == 0x7fffffff ? 0 : idx;
}

// The row's max over its C CTAs (every thread gets it). Its slot is written once.
template <int C>
__device__ __forceinline__ float row_max(float v) {
    __shared__ float shm[33];
    v = block_max(v, shm);
    __shared__ float pub;
    if (threadIdx.x == 0) pub = v;
    row_sync<C>();
    float ms[C];
#pragma unroll
    for (int r = 0; r < C; ++r) ms[r] = row_ld<C>(&pub, r);
    float m = pub;
#pragma unroll
    for (int r = 0; r < C; ++r) m = fmaxf(m, ms[r]);
    return m;
}

// This thread's argmax of a plain row slice (no penalties, no temperature): GREEDY_ILP
// 16-byte loads in flight; slices whose base is not 16-byte aligned read scalars.
__device__ __forceinline__ void greedy_argmax(const float* __restrict__ logits, int n, int base0,
                                              float& best, int& bi) {
    const int step = GREEDY_ILP * 4 * (int)blockDim.x;
    const bool vec = ((unsigned long long)logits & 15ull) == 0;
    const int vend = vec ? n & ~3 : 0;
    for (int base = 4 * threadIdx.x; base < vend; base += step) {
        greedy_vec l[GREEDY_ILP];
#pragma unroll
        for (int u = 0; u < GREEDY_ILP; ++u) {
            const int v = base + u * 4 * (int)blockDim.x;
            if (v < vend) l[u] = *reinterpret_cast<const greedy_vec*>(logits + v);
        }
#pragma unroll
        for (int u = 0; u < GREEDY_ILP; ++u) {  // this thread's indices in increasing order
            const int v = base + u * 4 * (int)blockDim.x;
            if (v >= vend) continue;
            const float e[4] = {l[u].x, l[u].y, l[u].z, l[u].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) argmax_take(e[i], base0 + v + i, best, bi);
        }
    }
    for (int v = vend + threadIdx.x; v < n; v += blockDim.x)
        argmax_take(logits[v], base0 + v, best, bi);
}

// ---- the row ---------------------------------------------------------------------------------
#define SAMPLE_PARAMS                                                                           \
    const float *__restrict__ logits, int V, const float *__restrict__ temperature,             \
        const int *__restrict__ top_k, const float *__restrict__ top_p,                         \
        const float *__restrict__ min_p, const long long *__restrict__ seeds,                   \
        const long long *__restrict__ offsets, const float *__restrict__ rep,                   \
        const float *__restrict__ pres, const float *__restrict__ freq,                         \
        const int *__restrict__ counts, const unsigned char *__restrict__ prompt_mask,          \
        int has_pen, int all_greedy, long long *__restrict__ out
#define SAMPLE_ARGS                                                                             \
    logits, V, temperature, top_k, top_p, min_p, seeds, offsets, rep, pres, freq, counts,       \
        prompt_mask, has_pen, all_greedy, out

// Row s, CTA `rank` of C: the slice [start, start + n) of the vocabulary (CACHED: its values
// l kept in `vals`, else recomputed from the logits on every pass).
template <int C, bool CACHED>
__device__ __forceinline__ void sample_row(SAMPLE_PARAMS, int s, int rank, float* vals) {
    __shared__ RadixHist hist;
    const int slice = C == 1 ? V : ((V + C - 1) / C + 3) & ~3;  // multiple of 4: aligned
    const int start = min(V, rank * slice);
    const int n = min(V, start + slice) - start;
    RowCtx c;
    c.logits = logits + (long long)s * V;
    c.has_pen = has_pen;
    if (has_pen) {
        c.counts = counts + (long long)s * V;
        c.pmask = prompt_mask + (long long)s * V;
        c.rep = rep[s];
        c.pres = pres[s];
        c.freq = freq[s];
    }
    const float temp = all_greedy ? 0.f : temperature[s];  // all_greedy: every row (no slice)
    c.temp = temp;
    c.scaled = temp > 0.f;

    float best = LLMC_NEG_INF;
    int bi = 0x7fffffff;
    if (!c.scaled) {  // greedy: argmax of the (penalised) logits
        if (has_pen) {
            for (int v = start + threadIdx.x; v < start + n; v += SAMPLE_THREADS)
                argmax_take(proc_value(c, v), v, best, bi);
        } else {
            greedy_argmax(c.logits + start, n, start, best, bi);
        }
        const int tok = row_argmax<C>(best, bi, rank);
        if (rank == 0 && threadIdx.x == 0) out[s] = tok;
        return;
    }

    // l of this slice (into shared memory when CACHED) and the row max
    float mx = LLMC_NEG_INF;
    const bool vec = !has_pen && ((unsigned long long)(c.logits + start) & 15ull) == 0;
    if (CACHED && vec) {
        const int nv = n >> 2;
        for (int j = threadIdx.x; j < nv; j += SAMPLE_THREADS) {
            greedy_vec x = reinterpret_cast<const greedy_vec*>(c.logits + start)[j];
            x.x = __fdiv_rn(x.x, temp);
            x.y = __fdiv_rn(x.y, temp);
            x.z = __fdiv_rn(x.z, temp);
            x.w = __fdiv_rn(x.w, temp);
            reinterpret_cast<greedy_vec*>(vals)[j] = x;
            mx = fmaxf(mx, fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
        }
        for (int i = 4 * nv + threadIdx.x; i < n; i += SAMPLE_THREADS) {
            const float l = proc_value(c, start + i);
            vals[i] = l;
            mx = fmaxf(mx, l);
        }
    } else {
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            const float l = proc_value(c, start + i);
            if (CACHED) vals[i] = l;
            mx = fmaxf(mx, l);
        }
    }
    const float M = row_max<C>(mx);  // also orders the slice's writes before the reads below
    auto val = [&](int i) -> float {
        if constexpr (CACHED) return vals[i];
        else return proc_value(c, start + i);
    };

    if (!is_finite(M)) {  // all -inf, or a +inf: the first maximum
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) argmax_take(val(i), start + i, best, bi);
        const int tok = row_argmax<C>(best, bi, rank);
        if (rank == 0 && threadIdx.x == 0) out[s] = tok;
        return;
    }

    int xchg = 0;
    unsigned tau = 0u;  // keep key >= tau (0: every key)
    const int k = top_k[s];
    if (k > 0 && k < V) tau = select_top_k<C>(hist, xchg, rank, n, val, k);
    const float p = top_p[s];
    if (p < 1.f) tau = p <= 0.f ? order_key(M) : select_top_p<C>(hist, xchg, rank, n, val, tau, M, p);

    const float mp = min_p[s];
    const unsigned long long seed = (unsigned long long)seeds[s];
    const unsigned long long off = (unsigned long long)offsets[s];
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        const float l = val(i);
        if (order_key(l) < tau) continue;
        if (mp > 0.f && expf(__fsub_rn(l, M)) < mp) continue;
        const float u = philox_uniform(seed, off, (unsigned)(start + i));
        argmax_take(__fsub_rn(l, logf(-logf(u))), start + i, best, bi);
    }
    const int tok = row_argmax<C>(best, bi, rank);
    if (rank == 0 && threadIdx.x == 0) out[s] = tok;
}

// One CTA per row, values recomputed from the logits on every pass (any arch, any V).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel(SAMPLE_PARAMS) {
    sample_row<1, false>(SAMPLE_ARGS, blockIdx.x, 0, nullptr);
}

#ifdef SAMPLE_HAS_CLUSTER
// SAMPLE_CLUSTER CTAs per row (blockIdx.x = rank, blockIdx.y = row), slices in shared memory.
extern "C" __global__ void __cluster_dims__(SAMPLE_CLUSTER, 1, 1) __launch_bounds__(SAMPLE_THREADS)
sample_cluster_kernel(SAMPLE_PARAMS) {
    extern __shared__ greedy_vec slice_smem[];
    sample_row<SAMPLE_CLUSTER, true>(SAMPLE_ARGS, blockIdx.y, blockIdx.x,
                                     reinterpret_cast<float*>(slice_smem));
}
#endif
