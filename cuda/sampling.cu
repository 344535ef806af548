// sampling.cu: one CTA per sampled row; writes only the token id (int64).
//
// Same function as llmc.cuda.reference.sample:
//   pen   = penalties(logits)  (repetition on prompt|output tokens, then frequency and
//           presence on output tokens; only when has_pen)
//   greedy rows (temperature <= 0): argmax(pen), first index on ties
//   sampled rows: l = pen / T; keep l >= kth (k-th largest, ties kept, k = 0 off);
//           top-p on the top-k-kept set: keep l >= tau, tau = the smallest kept value x
//           with mass(l > x) < p * mass(kept) (p >= 1 off, p <= 0 keeps the max ties);
//           min-p: keep exp(l - max) >= min_p (= p >= min_p * p_max);
//           token = argmax over kept of l - log(-log u), u = philox_uniform(seed, offset, v).
// Thresholds are found by bisection over the order-preserving 32-bit key of the float
// values (32 counting / mass passes each, only when the filter is on); values are
// recomputed from the logits on every pass (no scratch memory).  The Philox4x32-10 RNG
// reproduces reference.philox_uniform bit for bit.
// Plain greedy rows (no penalties) read the row as 16-byte vectors, GREEDY_ILP in flight per
// thread (rows whose length or base is not 16-byte aligned: scalar loads)
// (one row per CTA is latency-bound otherwise: ~50 us for a 128256-entry row on the H200).
// Launch: grid S, block SAMPLE_THREADS.
#include "common.cuh"

#define SAMPLE_THREADS 512
#define GREEDY_ILP 4  // 16-byte logits loads in flight per thread (plain greedy path)

struct alignas(16) greedy_vec {  // 4 logits (own type: NVRTC needs no CUDA headers)
    float x, y, z, w;
};

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

__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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

// This thread's running argmax over its indices, which arrive in increasing order: a larger
// value (or the first one) takes the place, so ties keep the first index.
__device__ __forceinline__ void argmax_take(float x, int v, float& best, int& bi) {
    if (x > best || bi == 0x7fffffff) {
        best = x;
        bi = v;
    }
}

// Warp argmax: largest value, smallest index among equal values.
__device__ __forceinline__ void warp_argmax(float& v, int& idx) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
}

// Block argmax: largest value, smallest index among equal values.
__device__ __forceinline__ int blk_argmax(float v, int idx, float* shv, int* shi) {
    warp_argmax(v, idx);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        shv[w] = v;
        shi[w] = idx;
    }
    __syncthreads();
    if (w == 0) {
        v = lane < (int)(blockDim.x >> 5) ? shv[lane] : LLMC_NEG_INF;
        idx = lane < (int)(blockDim.x >> 5) ? shi[lane] : 0x7fffffff;
        warp_argmax(v, idx);
        if (lane == 0) shi[32] = idx;
    }
    __syncthreads();
    return shi[32];
}

// This thread's argmax of a plain row (no penalties, no temperature): GREEDY_ILP 16-byte
// loads in flight; rows whose length or base is not 16-byte aligned read scalars.
__device__ __forceinline__ void greedy_argmax(const float* __restrict__ logits, int V,
                                              float& best, int& bi) {
    const int step = GREEDY_ILP * 4 * (int)blockDim.x;
    const bool vec = (V & 3) == 0 && ((unsigned long long)logits & 15ull) == 0;
    const int vend = vec ? V : 0;  // unaligned rows: all scalar (tail loop below)
    for (int base = 4 * threadIdx.x; base < vend; base += step) {
        greedy_vec l[GREEDY_ILP];
#pragma unroll
        for (int u = 0; u < GREEDY_ILP; ++u) {
            const int v = base + u * 4 * (int)blockDim.x;
            if (v < V) l[u] = *reinterpret_cast<const greedy_vec*>(logits + v);
        }
#pragma unroll
        for (int u = 0; u < GREEDY_ILP; ++u) {  // this thread's indices in increasing order
            const int v = base + u * 4 * (int)blockDim.x;
            if (v >= V) continue;
            const float e[4] = {l[u].x, l[u].y, l[u].z, l[u].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) argmax_take(e[i], v + i, best, bi);
        }
    }
    for (int v = vend + threadIdx.x; v < V; v += blockDim.x) argmax_take(logits[v], v, best, bi);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_kernel(const float* __restrict__ logits, int V, const float* __restrict__ temperature,
              const int* __restrict__ top_k, const float* __restrict__ top_p,
              const float* __restrict__ min_p, const long long* __restrict__ seeds,
              const long long* __restrict__ offsets, const float* __restrict__ rep,
              const float* __restrict__ pres, const float* __restrict__ freq,
              const int* __restrict__ counts, const unsigned char* __restrict__ prompt_mask,
              int has_pen, long long* __restrict__ out) {
    __shared__ float shf[33];
    __shared__ int shi[33];
    const int s = blockIdx.x;
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
    const float temp = temperature[s];
    c.temp = temp;
    c.scaled = temp > 0.f;

    if (!c.scaled) {  // greedy: argmax of the (penalised) logits
        float best = LLMC_NEG_INF;
        int bi = 0x7fffffff;
        if (has_pen) {
            for (int v = threadIdx.x; v < V; v += blockDim.x)
                argmax_take(proc_value(c, v), v, best, bi);
        } else {
            greedy_argmax(c.logits, V, best, bi);  // GREEDY_ILP 16-byte loads per thread
        }
        const int tok = blk_argmax(best, bi, shf, shi);
        if (threadIdx.x == 0) out[s] = tok;
        return;
    }

    float mx = LLMC_NEG_INF;
    for (int v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, proc_value(c, v));
    const float M = block_max(mx, shf);

    // top-k: kth key = the largest key x with count(key >= x) >= k.
    unsigned kth = 0u;
    const int k = top_k[s];
    if (k > 0 && k < V) {
        unsigned lo = 0u, hi = 0xffffffffu;
        while (lo < hi) {
            const unsigned mid = lo + (unsigned)(((unsigned long long)hi - lo + 1ull) >> 1);
            float cnt = 0.f;
            for (int v = threadIdx.x; v < V; v += blockDim.x)
                cnt += order_key(proc_value(c, v)) >= mid ? 1.f : 0.f;
            if (block_sum(cnt, shf) >= (float)k) lo = mid; else hi = mid - 1u;
        }
        kth = lo;
    }

    // top-p: tau = the smallest key x >= kth with mass(key > x) < p * mass(key >= kth).
    unsigned tau = kth;
    const float p = top_p[s];
    if (p < 1.f) {
        if (p <= 0.f) {
            tau = order_key(M);
        } else {
            float z = 0.f;
            for (int v = threadIdx.x; v < V; v += blockDim.x) {
                const float l = proc_value(c, v);
                if (order_key(l) >= kth) z += expf(l - M);
            }
            const float target = p * block_sum(z, shf);
            unsigned lo = kth, hi = 0xffffffffu;
            while (lo < hi) {
                const unsigned mid = lo + ((hi - lo) >> 1);
                float m = 0.f;
                for (int v = threadIdx.x; v < V; v += blockDim.x) {
                    const float l = proc_value(c, v);
                    if (order_key(l) > mid) m += expf(l - M);
                }
                if (block_sum(m, shf) < target) hi = mid; else lo = mid + 1u;
            }
            tau = lo;
        }
    }
    const float mp = min_p[s];
    const unsigned long long seed = (unsigned long long)seeds[s];
    const unsigned long long off = (unsigned long long)offsets[s];
    float best = LLMC_NEG_INF;
    int bi = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        const float l = proc_value(c, v);
        if (order_key(l) < tau) continue;
        if (mp > 0.f && expf(l - M) < mp) continue;
        const float u = philox_uniform(seed, off, (unsigned)v);
        argmax_take(l - logf(-logf(u)), v, best, bi);
    }
    const int tok = blk_argmax(best, bi, shf, shi);
    if (threadIdx.x == 0) out[s] = tok;
}
